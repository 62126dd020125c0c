"""Checkpoint integrity: bytes flipped, files truncated or missing, NaN saved; each is named (file or array) at
restore, the newest intact step is used instead (or the run stops, on request), and keep-last-N never deletes
the step a run resumed from. The trainer-level reproductions (tiny SFT run, rerun) are at the end, marked slow."""

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from etils import epath

from aepo_jax.train import CheckpointError, Checkpointer
from aepo_jax.checkpoint import CheckpointCorruptError
from aepo_jax.checkpoint._integrity import MANIFEST, array_checksums

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _state(seed=0, scale=1.0):
  params = {"w": jax.random.normal(jax.random.key(seed), (64, 256)) * scale, "b": jnp.arange(256, dtype=jnp.float32)}
  opt = optax.adamw(1e-3)
  opt_state = opt.init(params)
  updates, opt_state = opt.update(jax.tree.map(jnp.ones_like, params), opt_state, params)
  return {
    "params": optax.apply_updates(params, updates),
    "opt_state": opt_state,
    "rng": np.asarray(jax.random.key_data(jax.random.key(seed))),
  }


def _abstract():
  return jax.tree.map(np.asarray, _state())


def _largest_file(step_dir) -> str:
  files = [os.path.join(d, n) for d, _, names in os.walk(os.path.join(step_dir, "state")) for n in names]
  return max(files, key=os.path.getsize)


def flip(path, n=64):
  """Inverts `n` bytes in the middle of `path`."""
  data = bytearray(open(path, "rb").read())
  mid = len(data) // 2
  data[mid : mid + n] = bytes(b ^ 0xFF for b in data[mid : mid + n])
  open(path, "wb").write(bytes(data))


def _two_steps(directory, keep=3, **kw) -> Checkpointer:
  ck = Checkpointer(directory, keep=keep, **kw)
  ck.save(1, _state(1), {"step": 1})
  ck.save(2, _state(2), {"step": 2})
  ck.wait()
  return ck


def _equal(a, b):
  return all(jax.tree.leaves(jax.tree.map(lambda x, y: bool(np.array_equal(np.asarray(x), np.asarray(y))), a, b)))


def test_checksums_see_one_changed_bit_and_moved_values_and_not_sharding():
  x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
  base = array_checksums({"x": x})["['x']"]["sum"]
  bit = x.copy()
  bit.view(np.uint32)[3, 5] ^= 1
  swapped = x.copy()
  swapped[[0, 1]] = swapped[[1, 0]]
  assert array_checksums({"x": bit})["['x']"]["sum"] != base
  assert array_checksums({"x": swapped})["['x']"]["sum"] != base
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
  sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")))
  assert array_checksums({"x": sharded})["['x']"]["sum"] == base
  bf16 = array_checksums({"y": jnp.asarray(x, jnp.bfloat16), "i": np.arange(5, dtype=np.int8), "m": x > 0})
  assert all(v["sum"] and v["nonfinite"] == 0 for v in bf16.values())
  assert array_checksums({"x": np.array([1.0, np.nan, np.inf], np.float32)})["['x']"]["nonfinite"] == 2


def test_flipped_bytes_are_named_and_the_run_falls_back(tmp_path):
  d = str(tmp_path / "ck")
  ck = _two_steps(d, keep=2)  # async saves: the manifest is written by the save thread before the commit
  assert all(os.path.exists(os.path.join(d, s, MANIFEST)) for s in ("1", "2"))
  victim = _largest_file(os.path.join(d, "2"))
  flip(victim)
  rel = os.path.relpath(victim, os.path.join(d, "2"))
  with pytest.raises(CheckpointCorruptError) as e:
    ck.restore(2, _abstract())
  assert f"{d}/2 is damaged: {rel} differs from the sha256 recorded at save" in str(e.value)
  assert e.value.step == 2 and e.value.problems
  step, state, meta = ck.restore_newest_intact(_abstract())
  assert step == 1 and meta == {"step": 1} and _equal(state, _state(1))
  assert sorted(os.listdir(d)) == ["1", "2.damaged"] and ck.all_steps() == [1]
  # keep-last-N never deletes the step the run resumed from; the damaged step can be written again.
  for s in (2, 3, 4):
    ck.save(s, _state(s), {"step": s})
  ck.wait()
  assert ck.all_steps() == [1, 3, 4]
  ck.close()
  fresh = Checkpointer(d, keep=2)  # a new run that has not resumed pins nothing
  fresh.save(5, _state(5), {"step": 5})
  fresh.close()
  assert fresh.all_steps() == [4, 5]


def test_value_checksums_name_the_array_when_the_manifest_is_gone(tmp_path):
  """Raw zarr chunks (no OCDBT, no compression): the flipped bytes are array values; only the checksums in meta
  can tell, and they name the array."""
  d = str(tmp_path / "ck")
  ck = _two_steps(d, ocdbt=False, compression=False)
  os.remove(os.path.join(d, "2", MANIFEST))
  chunks = os.path.join(d, "2", "state", "params.w")  # one zarr array per leaf
  flip(max((os.path.join(p, n) for p, _, names in os.walk(chunks) for n in names), key=os.path.getsize))
  with pytest.raises(CheckpointCorruptError) as e:
    ck.restore(2, _abstract())
  assert "['params']['w']: checksum" in str(e.value) and "at save (values changed in storage)" in str(e.value)
  with pytest.raises(CheckpointCorruptError, match="values changed in storage"):
    ck.restore_params(2, _abstract()["params"])  # evaluation's path checks the parameters too
  ck.close()


def test_truncated_data_file_is_one_clear_paragraph(tmp_path, capfd):
  d = str(tmp_path / "ck")
  ck = _two_steps(d)
  victim = _largest_file(os.path.join(d, "2"))
  size = os.path.getsize(victim)
  with open(victim, "r+b") as f:
    f.truncate(size // 3)
  rel = os.path.relpath(victim, os.path.join(d, "2"))
  with pytest.raises(CheckpointCorruptError, match=f"{rel} has {size // 3} bytes, {size} at save \\(truncated\\)"):
    ck.restore(2, _abstract())
  os.remove(os.path.join(d, "2", MANIFEST))  # a checkpoint written before manifests: tensorstore meets the file
  with pytest.raises(CheckpointCorruptError) as e:
    ck.restore(2, _abstract())
  msg = str(e.value)
  assert msg.startswith(f"checkpoint {d}/2 is damaged: state/ cannot be read (") and "\n" not in msg, msg
  assert ck.restore_newest_intact(_abstract())[0] == 1
  ck.close()
  assert "Event loop is closed" not in capfd.readouterr().err


def test_missing_state_dir_is_named_not_a_model_mismatch(tmp_path):
  d = str(tmp_path / "ck")
  ck = _two_steps(d)
  shutil.rmtree(os.path.join(d, "2", "state"))
  with pytest.raises(CheckpointCorruptError, match=f"{d}/2 is damaged: state/ is missing\\.$"):
    ck.restore(2, _abstract())
  os.remove(os.path.join(d, "2", MANIFEST))
  with pytest.raises(CheckpointCorruptError, match="state/ is missing"):
    ck.restore(2, _abstract())
  assert ck.restore_newest_intact(_abstract())[0] == 1
  ck.close()


def test_on_corrupt_stop_names_the_intact_step_and_moves_nothing(tmp_path):
  d = str(tmp_path / "ck")
  ck = _two_steps(d)
  flip(_largest_file(os.path.join(d, "2")))
  with pytest.raises(CheckpointCorruptError) as e:
    ck.restore_newest_intact(_abstract(), on_corrupt="stop")
  assert "Step 1 is intact: set --config.checkpoint.on_corrupt=fallback" in str(e.value)
  assert sorted(os.listdir(d)) == ["1", "2"]
  flip(_largest_file(os.path.join(d, "1")))
  with pytest.raises(CheckpointCorruptError, match="No checkpoint in .* is intact: restore the named files"):
    ck.restore_newest_intact(_abstract())  # nothing to fall back to: stop, and leave everything in place
  assert sorted(os.listdir(d)) == ["1", "2"]
  ck.close()


def test_non_finite_state_is_damaged(tmp_path, caplog):
  d = str(tmp_path / "ck")
  ck = Checkpointer(d, async_save=False)
  ck.save(1, _state(1), {"step": 1})
  bad = _state(2)
  bad["opt_state"][0].nu["w"] = bad["opt_state"][0].nu["w"].at[3, 4].set(jnp.inf)
  with caplog.at_level(logging.WARNING, logger="aepo_jax.checkpoint"):
    ck.save(2, bad, {"step": 2})
  assert "saving non-finite values in ['opt_state'][0].nu['w']" in caplog.text
  with pytest.raises(CheckpointCorruptError, match=r"\['opt_state'\]\[0\]\.nu\['w'\]: 1 non-finite values \(already"):
    ck.restore(2, _abstract())
  assert ck.restore_newest_intact(_abstract())[0] == 1
  ck.close()


def test_structure_change_is_a_mismatch_not_damage(tmp_path):
  d = str(tmp_path / "ck")
  ck = _two_steps(d)
  other = _abstract()
  other["params"]["w"] = np.zeros((32, 256), np.float32)
  with pytest.raises(CheckpointError) as e:
    ck.restore_newest_intact(other)  # every step would "fail": this must not move anything aside
  assert not isinstance(e.value, CheckpointCorruptError)
  assert "['params']['w']: shape [64, 256] in the checkpoint, [32, 256] now" in str(e.value)
  assert sorted(os.listdir(d)) == ["1", "2"]
  ck.close()


def test_checkpoint_without_integrity_records_still_restores(tmp_path):
  """Written as before checksums and manifests existed (plain Orbax, same items): restored, finiteness checked."""
  d = str(tmp_path / "ck")
  mgr = ocp.CheckpointManager(
    epath.Path(d), item_handlers={"state": ocp.PyTreeCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
  )
  mgr.save(1, args=ocp.args.Composite(state=ocp.args.PyTreeSave(_state(1)), meta=ocp.args.JsonSave({"step": 1})))
  mgr.wait_until_finished()
  mgr.close()
  ck = Checkpointer(d)
  state, meta = ck.restore(1, _abstract())
  assert meta == {"step": 1} and _equal(state, _state(1))
  ck.close()


# ---------------------------------------------------------------------------------------------------------
# The trainer: configs/testing/tiny_sft.py for 6 steps (checkpoints 3 and 6, keep=2), damage step 6, rerun to 9.
# ---------------------------------------------------------------------------------------------------------
DRIVER = textwrap.dedent("""
    import sys
    from aepo_jax.train import load_config, run
    overrides = {"workdir": sys.argv[1], "sft.steps": int(sys.argv[2])}
    overrides.update(a.split("=", 1) for a in sys.argv[3:])
    summary = run(load_config("configs/testing/tiny_sft.py", overrides=overrides))
    print("final_nll", summary["sft/final_nll"], flush=True)
""")


def _train(workdir, steps, *overrides, cache_dir=None):
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
  if cache_dir is not None:  # a persistent compilation cache: the rerun loads the first run's programs
    env.update(JAX_COMPILATION_CACHE_DIR=str(cache_dir), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  return subprocess.run(
    [sys.executable, "-c", DRIVER, str(workdir), str(steps), *overrides],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )


def _nll(workdir):
  out = {}
  for line in open(os.path.join(workdir, "metrics.jsonl")):
    r = json.loads(line)
    out.setdefault(r["step"], []).append(r["sft/nll"])
  return out


def _cache(six_steps):
  """The compilation cache six_steps wrote. Reruns whose steps are compared bit for bit with six_steps' compile
  their own programs instead (a cached executable once differed from a fresh compile by 1 ulp: see
  tests/train/test_resume.py)."""
  return six_steps.parent / "jax_cache"


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("integrity") / "six"
  out = _train(workdir, 6, cache_dir=_cache(workdir))
  assert out.returncode == 0, out.stderr[-3000:]
  assert sorted(os.listdir(workdir / "checkpoints" / "sft")) == ["3", "6"]
  return workdir


def _copy(six_steps, tmp_path):
  workdir = tmp_path / "run"
  shutil.copytree(six_steps, workdir)
  return workdir, workdir / "checkpoints" / "sft"


@pytest.mark.slow
def test_trainer_falls_back_from_flipped_bytes_and_keeps_the_good_step(six_steps, tmp_path):
  workdir, ckpts = _copy(six_steps, tmp_path)
  victim = _largest_file(ckpts / "6")
  flip(victim)
  out = _train(workdir, 9)
  assert out.returncode == 0, out.stderr[-3000:]
  rel = os.path.relpath(victim, ckpts / "6")
  assert f"checkpoints/sft/6 is damaged: {rel} differs from the sha256 recorded at save" in out.stderr
  assert f"resuming from step 3, the newest intact checkpoint in {ckpts}" in out.stderr
  assert sorted(os.listdir(ckpts)) == ["3", "6", "6.damaged", "9"]  # step 3 outlives keep=2
  assert np.isfinite(float(out.stdout.split("final_nll")[-1]))
  nll = _nll(workdir)
  assert all(nll[s][-1] == nll[s][0] for s in (4, 5, 6))  # steps 4-6 again, bit-identical from step 3


@pytest.mark.slow
def test_trainer_stops_on_request_naming_the_file_and_the_intact_step(six_steps, tmp_path):
  workdir, ckpts = _copy(six_steps, tmp_path)
  victim = _largest_file(ckpts / "6")
  flip(victim)
  out = _train(workdir, 9, "checkpoint.on_corrupt=stop", cache_dir=_cache(six_steps))
  assert out.returncode != 0
  last = out.stderr.strip().splitlines()[-1]
  assert os.path.relpath(victim, ckpts / "6") in last and "Step 3 is intact" in last, out.stderr[-3000:]
  assert sorted(os.listdir(ckpts)) == ["3", "6"]


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated_without_manifest", "missing_state"])
def test_trainer_falls_back_from_truncated_or_missing_parts(six_steps, tmp_path, damage):
  workdir, ckpts = _copy(six_steps, tmp_path)
  if damage == "missing_state":
    shutil.rmtree(ckpts / "6" / "state")
    needle = "checkpoints/sft/6 is damaged: state/ is missing."
  else:
    os.remove(ckpts / "6" / MANIFEST)  # the array reader meets the short file itself
    victim = _largest_file(ckpts / "6")
    with open(victim, "r+b") as f:
      f.truncate(os.path.getsize(victim) // 2)
    needle = "checkpoints/sft/6 is damaged: state/ cannot be read ("
  out = _train(workdir, 9, cache_dir=_cache(six_steps))
  assert out.returncode == 0, out.stderr[-3000:]
  assert needle in out.stderr and f"resuming from step 3, the newest intact checkpoint in {ckpts}" in out.stderr
  assert "does not match" not in out.stderr and "Event loop is closed" not in out.stderr
  assert sorted(os.listdir(ckpts)) == ["3", "6", "6.damaged", "9"]
  assert np.isfinite(float(out.stdout.split("final_nll")[-1]))
