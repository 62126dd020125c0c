"""Reading what a compiled program moves from its HLO text: loop trip counts, collectives, large copies."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from aepo_jax.parallel import make_mesh
from aepo_jax.train import _hlo

_TEXT = """HloModule m

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  %constant.1 = s32[]{:T(128)} constant(5)
  ROOT %lt = pred[] compare(%i, %constant.1), direction=LT
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]) parameter(0)
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %ag = f32[64]{0} all-gather(%x), dimensions={0}
  %ars = f32[8]{0} all-reduce-start(%x), to_apply=%add
  %ard = f32[8]{0} all-reduce-done(%ars)
  ROOT %t = (s32[], f32[8]) tuple(%i, %ard)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %w = (s32[], f32[8]) while(%t0), condition=%cond, body=%body
  %c = f32[1024]{0} copy(%big)
  ROOT %r = f32[8]{0} all-reduce(%a), to_apply=%add
}
"""


def test_trip_counts_weight_collectives_and_copies():
  comps, entry = _hlo.computations(_TEXT)
  assert entry == "main" and set(comps) == {"cond", "body", "main"}
  assert _hlo.multiplicities(comps, entry)["body"] == 5
  c = _hlo.collectives(_TEXT)
  assert (c["all-gather"].count, c["all-gather"].bytes) == (5, 5 * 64 * 4)  # once per iteration
  assert (c["all-reduce"].count, c["all-reduce"].bytes) == (6, 6 * 8 * 4)  # 5 async in the loop + 1 outside
  assert _hlo.large_copies(_TEXT, 4096) == [("f32[1024]{0}", 1.0)]
  assert _hlo.large_copies(_TEXT, 4097) == []


def test_a_compiled_cpu_program_reads_back():
  """A real compiled program (8 CPU devices): a psum inside a 3-step fori_loop counts three times."""
  mesh = make_mesh((1, 8, 1), jax.devices()[:8])

  def f(x):
    def body(i, acc):
      return jax.lax.psum(acc * 0.5 + x, "fsdp")  # depends on the carry: XLA cannot hoist it

    return jax.lax.fori_loop(0, 3, body, jnp.zeros_like(x))

  fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("fsdp"), out_specs=P("fsdp"), check_vma=False))
  x = jax.device_put(jnp.ones((8, 16), jnp.float32), NamedSharding(mesh, P("fsdp")))
  text = fn.lower(x).compile().as_text()
  c = _hlo.collectives(text)
  assert c["all-reduce"].count == 3, {k: v.count for k, v in c.items()}
  assert c["all-reduce"].bytes == 3 * 1 * 16 * 4
