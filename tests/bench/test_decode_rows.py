"""bench/decode_rows.py: the rows each ladder runs for a number of active slots, a timed step per case, and its
argument checks (a tiny random model: what is measured is the bench's bookkeeping, not the speed)."""

import jax
import pytest
from bench_script import load

from aepo_jax.model import init_params, preset
from aepo_jax.rollout import SamplingParams

MOD = load("decode_rows")
CFG = preset(
  "smollm2-135m", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2
)


def test_rows_of_the_engine_sizes_against_the_doubling_ladder():
  params = init_params(CFG, jax.random.PRNGKey(0))
  kw = dict(max_slots=16, max_len=48, eos_ids=(), sampling=SamplingParams(0.7))
  ours, base = MOD.Engine(CFG, **kw), MOD.DoublingEngine(CFG, **kw)
  assert ours.uses_cpu_kernels(params)
  assert ours.decode_row_sizes() == (4, 8, 12) and base.decode_row_sizes() == (4, 8)
  for active, rows_ours, rows_base in ((3, 4, 4), (6, 8, 8), (10, 12, 16), (13, 16, 16)):
    (r1, ms1), (r0, ms0) = MOD.step_ms([ours, base], params, active, 8, steps=2, repeats=2)
    assert (r1, r0) == (rows_ours, rows_base) and ms1 > 0 and ms0 > 0


def test_bad_arguments_are_named():
  with pytest.raises(SystemExit):
    MOD.main(["--active=40"])  # more active slots than --slots=32
  with pytest.raises(SystemExit):
    MOD.main(["--contexts=230"])  # no room for the timed steps within --max-len=240
