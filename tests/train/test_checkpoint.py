"""Checkpointer: round trip, keep-last-N + best, another model's checkpoint, bad work directories,
and a save killed half-way that must never become the latest checkpoint."""

import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from etils import epath

from aepo_jax.train import CheckpointError, Checkpointer, base_config, check_writable, to_json

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _state(seed=0):
  params = {"w": jax.random.normal(jax.random.key(seed), (4, 6)), "b": jnp.arange(6, dtype=jnp.float32)}
  opt = optax.adamw(1e-3)
  opt_state = opt.init(params)
  # one real update so the moments are not all zero
  grads = jax.tree.map(jnp.ones_like, params)
  updates, opt_state = opt.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  return {
    "params": params,
    "opt_state": opt_state,
    "rng": np.asarray(jax.random.key_data(jax.random.key(seed))),
    "count": np.int32(3),
  }  # a numpy scalar leaf: orbax rejects these unless converted


def _meta(config=None, **extra):
  return {"config": to_json(config or base_config()), "data_state": {"next_index": 7}, **extra}


def _equal(a, b):
  return all(jax.tree.leaves(jax.tree.map(lambda x, y: bool(np.array_equal(np.asarray(x), np.asarray(y))), a, b)))


def test_round_trip_is_bit_exact(tmp_path):
  state = _state()
  ck = Checkpointer(str(tmp_path / "ck"), keep=2)
  ck.save(5, state, _meta(nan_count=1))
  ck.wait()
  restored, meta = ck.restore(None, jax.tree.map(np.asarray, state), base_config())
  assert _equal(restored, state)
  assert meta["data_state"] == {"next_index": 7} and meta["nan_count"] == 1
  assert jax.tree.structure(restored["opt_state"]) == jax.tree.structure(state["opt_state"])
  params = ck.restore_params(5, state["params"])  # export path: the optimizer state is not read
  assert _equal(params, state["params"])
  ck.close()


@pytest.mark.parametrize("compression", [True, False])
def test_round_trip_with_and_without_compression(tmp_path, compression):
  """checkpoint.compression=False (cpu_default) writes raw arrays: bit-exact round trip, larger on disk for
  compressible data; either kind is readable by a Checkpointer with the other setting."""
  state = _state()
  state["params"]["zeros"] = jnp.zeros((256, 256), jnp.float32)  # compressible
  writer = Checkpointer(str(tmp_path / "ck"), async_save=False, compression=compression)
  writer.save(1, state, _meta())
  writer.close()
  size = sum(f.stat().st_size for f in (tmp_path / "ck").rglob("*") if f.is_file())
  assert (size < 256 * 256 * 4) == compression, size
  reader = Checkpointer(str(tmp_path / "ck"), compression=not compression)
  restored, _ = reader.restore(None, jax.tree.map(np.asarray, state), base_config())
  assert _equal(restored, state)
  reader.close()


def test_keep_last_n_plus_best(tmp_path):
  ck = Checkpointer(str(tmp_path / "ck"), keep=2, best_metric="eval/accuracy", best_mode="max", async_save=False)
  acc = {1: 0.2, 2: 0.9, 3: None, 4: 0.1, 5: None, 6: 0.3}
  for step, a in acc.items():
    ck.save(step, _state(), _meta(), metrics=None if a is None else {"eval/accuracy": a})
  assert ck.all_steps() == [2, 5, 6]  # last two + the best (step 2), the rest deleted
  assert ck.best_step() == 2
  ck.close()


def test_checkpoint_of_another_model_names_the_fields(tmp_path):
  saved = base_config()
  saved.model.overrides.num_layers = 2
  ck = Checkpointer(str(tmp_path / "ck"))
  ck.save(1, _state(), _meta(saved))
  ck.wait()
  current = base_config()
  current.model.name = "qwen3-0.6b"
  current.model.overrides.num_layers = 4
  with pytest.raises(CheckpointError) as e:
    ck.restore(None, _state(), current)
  msg = str(e.value)
  assert "model.name: checkpoint='smollm2-135m-instruct' current='qwen3-0.6b'" in msg
  assert "model.overrides.num_layers: checkpoint=2 current=4" in msg
  ck.close()


def test_structure_mismatch_is_a_clear_error(tmp_path):
  ck = Checkpointer(str(tmp_path / "ck"))
  ck.save(1, _state(), _meta())
  ck.wait()
  other = _state()
  other["params"]["w"] = np.zeros((5, 6), np.float32)
  with pytest.raises(CheckpointError, match="does not match the current model/optimizer state"):
    ck.restore(1, other)
  ck.close()


def test_unwritable_workdir_errors(tmp_path, monkeypatch):
  with pytest.raises(CheckpointError, match="has .* MiB free but a checkpoint needs about"):
    check_writable(str(tmp_path), need_bytes=1 << 60)
  a_file = tmp_path / "file"
  a_file.write_text("x")
  with pytest.raises(CheckpointError, match="is not writable"):
    check_writable(str(a_file / "sub"))

  def read_only(*a, **k):
    raise OSError(errno.EROFS, "Read-only file system")

  monkeypatch.setattr(epath.Path, "write_bytes", read_only)
  with pytest.raises(CheckpointError, match="the file system is read-only"):
    check_writable(str(tmp_path / "ro"))


def _unshare_ok():
  return (
    shutil.which("unshare") and subprocess.run(["unshare", "-r", "-m", "true"], capture_output=True).returncode == 0
  )


@pytest.mark.skipif(not _unshare_ok(), reason="needs unprivileged user+mount namespaces (unshare -r -m)")
@pytest.mark.parametrize(
  "opts,needle", [("ro,size=1m", "the file system is read-only"), ("size=1m", "MiB free but a checkpoint needs")]
)
def test_real_read_only_and_full_disks(tmp_path, opts, needle):
  """A tmpfs mounted read-only / 1 MiB small in a private mount namespace; the trainer refuses to start."""
  mnt = tmp_path / "mnt"
  mnt.mkdir()
  code = f"from aepo_jax.train import check_writable\ncheck_writable({str(mnt / 'run')!r})\n"
  script = f"mount -t tmpfs -o {opts} none {mnt} && exec {sys.executable} -c \"$0\""
  out = subprocess.run(
    ["unshare", "-r", "-m", "sh", "-c", script, code],
    capture_output=True,
    text=True,
    cwd=ROOT,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
    timeout=120,
  )
  assert out.returncode != 0 and needle in out.stderr, out.stderr[-1500:]


_CHILD = textwrap.dedent("""
    import sys, time
    import numpy as np, jax.numpy as jnp
    from aepo_jax.train import Checkpointer
    ck = Checkpointer(sys.argv[1], keep=3, async_save=True)
    ck.save(1, {"w": jnp.ones((4, 4))}, {"step": 1}); ck.wait()
    print("saved1", flush=True)
    big = {"w": jnp.asarray(np.random.default_rng(0).standard_normal((48, 1024, 1024), np.float32))}
    ck.save(2, big, {"step": 2})
    print("saving2", flush=True)
    time.sleep(120)
""")


def test_killed_mid_save_is_never_latest(tmp_path):
  directory = str(tmp_path / "ck")
  child = subprocess.Popen(
    [sys.executable, "-c", _CHILD, directory],
    stdout=subprocess.PIPE,
    text=True,
    cwd=ROOT,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  try:
    for line in child.stdout:
      if line.startswith("saving2"):
        break
    os.kill(child.pid, signal.SIGKILL)
  finally:
    child.kill()
    child.wait()
  leftovers = os.listdir(directory)
  assert "1" in leftovers and "2" not in leftovers
  assert any(name.startswith("2.") and "tmp" in name for name in leftovers), leftovers  # killed mid-write
  ck = Checkpointer(directory)
  assert ck.latest_step() == 1 and ck.all_steps() == [1]
  state, meta = ck.restore(None, {"w": np.zeros((4, 4), np.float32)})
  assert meta == {"step": 1} and np.all(np.asarray(state["w"]) == 1)
  ck.save(2, {"w": jnp.full((4, 4), 2.0)}, {"step": 2})  # the interrupted step can be written again
  ck.close()
  assert Checkpointer(directory).latest_step() == 2


def test_attention_impl_override_is_not_a_model_mismatch():
  """`model.overrides.attention_impl` picks an execution path, not parameters: resuming across it is allowed."""
  from aepo_jax.train import base_config
  from aepo_jax.checkpoint import model_mismatch

  a, b = base_config(), base_config()
  b.model.overrides.attention_impl = "xla"
  assert model_mismatch(a, b) == []
  b.model.overrides.num_layers = 2
  assert model_mismatch(a, b) == ["model.overrides.num_layers: checkpoint='<unset>' current=2"]
