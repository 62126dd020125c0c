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


_INPLACE = """HloModule m

%fused_update (param_0: f32[4096,256], param_1: f32[1,256], param_2: s32[]) -> f32[4096,256] {
  %param_0 = f32[4096,256]{1,0} parameter(0)
  %param_1 = f32[1,256]{1,0} parameter(1)
  %param_2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  ROOT %dus = f32[4096,256]{1,0} dynamic-update-slice(%param_0, %param_1, %param_2, %zero)
}

%fused_slice (param_0.1: f32[4096,256], param_1.1: s32[]) -> f32[8,256] {
  %param_0.1 = f32[4096,256]{1,0} parameter(0)
  %param_1.1 = s32[] parameter(1)
  %zero.1 = s32[] constant(0)
  %b = f32[4096,256]{1,0} bitcast(%param_0.1)
  ROOT %ds = f32[8,256]{1,0} dynamic-slice(%b, %param_1.1, %zero.1), dynamic_slice_sizes={8,256}
}

%cond (p: (s32[], f32[4096,256])) -> pred[] {
  %p = (s32[], f32[4096,256]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %constant.1 = s32[] constant(10)
  ROOT %lt = pred[] compare(%i, %constant.1), direction=LT
}

%body (p: (s32[], f32[4096,256])) -> (s32[], f32[4096,256]) {
  %p = (s32[], f32[4096,256]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %buf = f32[4096,256]{1,0} get-tuple-element(%p), index=1
  %rows = f32[8,256]{1,0} fusion(%buf, %i), kind=kLoop, calls=%fused_slice
  %row = f32[1,256]{1,0} reduce(%rows), dimensions={0}, to_apply=%add
  %vmem = f32[1024,256]{1,0:S(1)} copy(%buf2)
  %new = f32[4096,256]{1,0} fusion(%buf, %row, %i), kind=kLoop, calls=%fused_update
  ROOT %t = (s32[], f32[4096,256]) tuple(%i, %new)
}

ENTRY %main (a: f32[4096,256]) -> f32[4096,256] {
  %a = f32[4096,256]{1,0} parameter(0)
  %w = (s32[], f32[4096,256]) while(%t0), condition=%cond, body=%body
  ROOT %r = f32[4096,256]{1,0} get-tuple-element(%w), index=1
}
"""


def test_hbm_bytes_count_slices_and_in_place_updates_not_their_buffers():
  """Per iteration (10): the slice fusion reads 8 rows (8 KiB) and writes them, the reduce reads them and writes a
  row, the in-place update reads the row and writes it (never the 4 MiB buffer); the VMEM copy (S(1)) is not HBM."""
  row, rows, scalar = 256 * 4, 8 * 256 * 4, 4
  per_iter = (rows + scalar + rows) + (rows + row) + (row + scalar + row)
  assert _hlo.hbm_bytes(_INPLACE) == 10 * per_iter


def test_hbm_bytes_of_compiled_cpu_programs():
  """Without loops the count is XLA's cost analysis; a donated buffer updated in place in an 8-step loop counts the
  updates (8 x a row read and written, plus scalars), not 8 x the 16 MiB buffer."""

  def mlp(w1, w2, x):
    return jnp.tanh(x @ w1) @ w2

  args = [jnp.ones((512, 1024)), jnp.ones((1024, 256)), jnp.ones((64, 512))]
  compiled = jax.jit(mlp).lower(*args).compile()
  assert _hlo.hbm_bytes(compiled.as_text()) == compiled.cost_analysis()["bytes accessed"]

  def fill(buf, v):
    return jax.lax.fori_loop(0, 8, lambda i, b: jax.lax.dynamic_update_slice(b, v[None] * i, (i, 0)), buf)

  text = jax.jit(fill, donate_argnums=0).lower(jnp.ones((4096, 1024)), jnp.ones((1024,))).compile().as_text()
  assert 8 * 2 * 1024 * 4 <= _hlo.hbm_bytes(text) < 8 * 2 * 1024 * 4 + 4096  # + a few scalars per step
