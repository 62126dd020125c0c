"""A checkpoint on gs:// (the local GCS emulator) evaluates exactly like the same checkpoint on local disk."""

import jax
import numpy as np
import pytest

from aepo_jax.eval import EvalInputError, check_inputs, load_policy, read_records, run_evaluation

from eval_helpers import SETTINGS, save_checkpoint, toy_data_root


def _strip(records):
  return [{k: v for k, v in r.items() if k != "seconds"} for r in records]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_gs_checkpoint_gives_identical_results(
  gcs_emulator, orbax_ckpt, tiny_config, tiny_params, tok_dir, tmp_path, monkeypatch
):
  monkeypatch.setenv("AEPO_ARPO_DATA", toy_data_root(str(tmp_path / "data")))
  gs_dir = f"{gcs_emulator}/run"
  # ocdbt=False: the emulator intermittently fails tensorstore's conditional OCDBT manifest writes
  # (tests/train/test_checkpoint_gcs.py covers OCDBT on gs:// with a retry on exactly that error).
  save_checkpoint(f"{gs_dir}/checkpoints/rl", tiny_config, tiny_params, tok_dir, ocdbt=False)
  with pytest.raises(EvalInputError, match="does not exist"):
    check_inputs(f"{gcs_emulator}/no_such_run", "gsm8k")

  local_plan, gs_plan = check_inputs(orbax_ckpt, "gsm8k"), check_inputs(gs_dir, "gsm8k")
  assert (gs_plan.checkpoint.kind, gs_plan.checkpoint.directory) == ("orbax", f"{gs_dir}/checkpoints/rl")
  local_pol, gs_pol = load_policy(local_plan.checkpoint), load_policy(gs_plan.checkpoint)
  assert gs_pol.config == local_pol.config
  jax.tree.map(np.testing.assert_array_equal, gs_pol.params, local_pol.params)

  out = {}
  for name, plan in (("local", local_plan), ("gs", gs_plan)):  # each run loads its own checkpoint
    summary = run_evaluation(plan, str(tmp_path / name), settings=SETTINGS, ks=(1, 2), limit=3, show_progress=False)
    out[name] = (summary, read_records(str(tmp_path / name / "gsm8k.jsonl")))
    assert summary["source"].startswith(f"orbax {plan.checkpoint.directory}")
  assert len(out["gs"][1]) == 6
  assert _strip(out["gs"][1]) == _strip(out["local"][1])
  assert out["gs"][0]["benchmarks"] == out["local"][0]["benchmarks"]
