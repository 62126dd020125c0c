"""The main job on 2 emulated hosts makes the RL update one process makes on the same global batch (issue #30).

Run A: `launch/tpu_pod.py --config=configs/testing/tiny_rl.py --emulate_topology=v5p:2x2x2`, 2 processes (gloo), the
training mesh (data 1, fsdp 4, tensor 2) spanning the hosts in the slice's order, 1 SFT step and 1 RL step. The random
tiny model earns reward ~0 everywhere (all advantages 0: an equality would be vacuous), so a driver replaces the
reward with a hash of each response's tokens in {0, 0.5, 1}, which differs within a group, and process 0 saves the
global trajectories and rewards `_batch.gather_trajectories` hands every host.
Run B: one process with 8 CPU devices, the same mesh shape and config, starting from A's SFT checkpoint (copied into
its workdir: the SFT phase finds itself finished and hands its parameters to RL); a driver makes its rollout return
A's global trajectories and its reward return A's rewards, so B's RL step trains on exactly A's global batch.
Checked: the RL step-1 checkpoints agree (Adam's first moment, the sharpest check, then second moment and the
parameters) and so do train/loss and train/grad_norm, within float32 tolerances derived below.

Both runs set algo.entropy_advantage_coef=0: AEPO's factor 1 + a(H - mean H)/std H is ill-conditioned on a random
model, whose token entropies all sit near ln 320 (std 6.3e-4 over the step's 204 tokens): one float32 ulp of the mean
entropy (4.8e-7), which the two reduction orders may well differ by, moves every token's factor by 1.5e-4, and the
loss and gradient with it (seen with a = 0.2: the factors' means 1.00012 vs 0.99997, the first moments 2e-4 apart).
Without it, a difference in the update is the multi-host path's, not that amplification's.
"""

import inspect
import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap

import jax
import numpy as np
import optax
import pytest

from aepo_jax import model as model_lib
from aepo_jax import parallel
from aepo_jax.checkpoint import model_config_from_json
from aepo_jax.testing import free_port, run_processes
from aepo_jax.train import Checkpointer, from_json

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
U32 = float(np.finfo(np.float32).eps) / 2  # unit roundoff of float32, 2**-24


def hashed_rewards(tokens_bt, prompt_len_b, response_len_b):
  """A deterministic reward per trajectory from its response tokens (CRC-32, independent of PYTHONHASHSEED):
  0, 0.5 or 1, so the trajectories of a group differ."""
  import zlib

  import numpy as np

  out = [
    (zlib.crc32(np.asarray(tok[p : p + n], np.int32).tobytes()) % 3) / 2
    for tok, p, n in zip(tokens_bt, prompt_len_b, response_len_b)
  ]
  return np.asarray(out, np.float32)


DRIVER = textwrap.dedent(inspect.getsource(hashed_rewards)) + textwrap.dedent("""
    import os, pickle, runpy, sys
    from aepo_jax.train import _batch, _objective, _wiring

    mode, batch_file = sys.argv[1], sys.argv[2]
    launcher = os.path.join(os.getcwd(), "launch", "tpu_pod.py")
    sys.argv = [launcher] + sys.argv[3:]
    if mode == "pod":  # run A: the hashed reward; process 0 keeps the global batch of RL step 1
      _objective.make_reward = lambda config: lambda traj, prompts: hashed_rewards(
        traj.tokens_bt, traj.prompt_len_b, traj.response_len_b
      )
      gather, calls = _batch.gather_trajectories, []

      def gather_and_save(traj, rewards_b, *, pad_id):
        out = gather(traj, rewards_b, pad_id=pad_id)
        calls.append(1)
        import jax
        if len(calls) == 1 and jax.process_index() == 0:
          with open(batch_file, "wb") as f:
            pickle.dump(out, f)
        return out

      _batch.gather_trajectories = gather_and_save
    else:  # run B: A's global trajectories and rewards
      with open(batch_file, "rb") as f:
        saved_traj, saved_rewards = pickle.load(f)
      _wiring.Rollout.__call__ = lambda self, weights, prompts, key, should_stop=None: saved_traj
      _objective.make_reward = lambda config: lambda traj, prompts: saved_rewards
    runpy.run_path(launcher, run_name="__main__")
""")


def _flags(tmp_path, workdir):
  from aepo_jax.testing import tiny_tokenizer

  return [
    "--config=configs/testing/tiny_rl.py",
    f"--config.workdir={workdir}",
    f"--config.model.tokenizer={tiny_tokenizer(tmp_path / 'tok')}",
    "--config.checkpoint.shared_workdir=True",
    "--config.mesh.data=1",
    "--config.mesh.fsdp=4",
    "--config.mesh.tensor=2",
    "--config.sft.steps=1",
    "--config.train.steps=1",
    "--config.eval.before_rl=False",
    "--config.eval.after_rl=False",
    "--config.algo.entropy_advantage_coef=0.0",  # see the module docstring
  ]


def _env(**extra):
  env = dict(os.environ, JAX_PLATFORMS="cpu", **extra)
  env.pop(parallel.EMULATE_TOPOLOGY_ENV, None)
  return env


def _run_pod(tmp_path, workdir, batch_file):
  """Run A: 2 processes as the hosts of v5p:2x2x2 (as tests/parallel/test_slice_order.py `_launch_emulated`)."""
  env = _env()
  env.pop("XLA_FLAGS", None)  # the launcher gives each process the slice's 4 devices per host
  cmd = [sys.executable, "-c", DRIVER, "pod", str(batch_file), *_flags(tmp_path, workdir)]
  cmd += ["--emulate_topology=v5p:2x2x2", f"--coordinator_address=127.0.0.1:{free_port()}", "--num_processes=2"]
  results = run_processes([cmd + [f"--process_id={i}"] for i in range(2)], cwd=ROOT, env=env, timeout=1500)
  logs = [out for _, out, _ in results]
  return logs


def _run_one(tmp_path, workdir, batch_file):
  """Run B: one process, 8 CPU devices, the same mesh (1, 4, 2)."""
  env = _env(XLA_FLAGS="--xla_force_host_platform_device_count=8")
  cmd = [sys.executable, "-c", DRIVER, "one", str(batch_file), *_flags(tmp_path, workdir)]
  done = subprocess.run(
    cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1500
  )
  assert done.returncode == 0, done.stdout[-5000:]
  return done.stdout


def _rl_record(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rl = [r for r in map(json.loads, f) if "reward/mean" in r]
  assert [r["step"] for r in rl] == [1], rl
  return rl[0]


def _state(workdir, phase, step):
  """{'params', 'opt_state'} of a checkpoint, on this process's first device, as numpy."""
  ck = Checkpointer(f"{workdir}/checkpoints/{phase}", read_only=True)
  meta = ck.restore_meta(step)
  config = from_json(meta["config"])
  shapes = model_lib.param_shapes(model_config_from_json(meta["model_config"]))
  if phase == "sft":
    return {"params": jax.device_get(ck.restore_params(step, shapes))}, config
  from aepo_jax.train import _rl

  optimizer = _rl.make_optimizer(config, config.train.steps)
  target = {
    "params": shapes,
    "opt_state": jax.eval_shape(optimizer.init, shapes),
    "rng": np.asarray(jax.random.key_data(jax.random.key(0))),
  }
  state, _ = ck.restore(step, target)
  return jax.device_get({"params": state["params"], "opt_state": state["opt_state"]}), config


def _leaves(tree):
  return [
    (jax.tree_util.keystr(p), np.asarray(x, np.float64)) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
  ]


@pytest.mark.slow
def test_two_emulated_hosts_make_the_update_one_process_makes_on_the_same_global_batch(tmp_path):
  import importlib.util

  if importlib.util.find_spec("libtpu") is None:  # the slice's device order comes from libtpu's topology
    pytest.skip('libtpu is not installed (pip install -e ".[tpu]")')
  pod, one = tmp_path / "pod", tmp_path / "one"
  batch_file = tmp_path / "pod_batch.pkl"
  _run_pod(tmp_path, pod, batch_file)
  os.makedirs(one / "checkpoints")
  shutil.copytree(pod / "checkpoints" / "sft", one / "checkpoints" / "sft")  # B's RL starts where A's did
  log_b = _run_one(tmp_path, one, batch_file)
  assert "SFT already finished (step 1)" in log_b, log_b[-3000:]
  print("POD_EQUALITY " + json.dumps(_compare(pod, one, batch_file)))


def _compare(pod, one, batch_file) -> dict:
  """Asserts that run A (`pod`) and run B (`one`) made the same RL step 1; returns the measured differences."""
  # -- the global batch: both hosts' trajectories, the rewards still on their rows, differing within groups ------
  with open(batch_file, "rb") as f:
    traj, rewards = pickle.load(f)
  assert len(rewards) == 8 and len(set(np.asarray(traj.group_id_b).tolist())) == 2, traj.group_id_b
  np.testing.assert_array_equal(rewards, hashed_rewards(traj.tokens_bt, traj.prompt_len_b, traj.response_len_b))
  from aepo_jax.train import _objective

  (sa, config), (sb, _) = _state(pod, "rl", 1), _state(one, "rl", 1)
  adv_bt = np.asarray(
    _objective.advantage_fn(config)(
      rewards, np.asarray(traj.group_id_b), np.asarray(traj.loss_mask_bt), tree=(traj.parent_b, traj.fork_pos_b)
    )
  )
  adv_max = float(np.abs(adv_bt[np.asarray(traj.loss_mask_bt) > 0]).max())
  assert adv_max > 0.1, adv_max  # the update has a non-zero gradient
  ma, mb = _rl_record(pod), _rl_record(one)
  assert ma["reward/std"] > 0 and ma["reward/std"] == mb["reward/std"] and ma["reward/mean"] == mb["reward/mean"]
  assert ma["rollout/trajectories"] == mb["rollout/trajectories"] == 8

  # -- tolerances (float32) ----------------------------------------------------------------------------------------
  # A and B run the same SPMD program on a (1, 4, 2) mesh; only the order of float32 sums differs (the fsdp/tensor
  # all-reduces: gloo across 2 processes vs XLA:CPU within one). The longest reduction in the loss and in each
  # gradient element is over the batch's tokens, n = rows x seq_len; two orders of a sum of n float32 terms differ by
  # at most 2(n-1)u times the sum of their magnitudes (u = 2**-24). We take the magnitude as the leaf's largest first
  # moment (for the loss: the largest |advantage|, each token's term being |A| times a ratio of 1 at step 1).
  n = 8 * (config.rollout.max_prompt_len + config.rollout.max_response_len)
  rel = 2 * (n - 1) * U32  # 2.6e-4 at n = 8 x 272

  # -- Adam's moments: mu = (1 - b1) clip(g), nu = (1 - b2) clip(g)**2 after one update -----------------------------
  p0 = _state(pod, "sft", 1)[0]["params"]
  report = {}
  mu_a, mu_b = optax.tree_utils.tree_get(sa["opt_state"], "mu"), optax.tree_utils.tree_get(sb["opt_state"], "mu")
  nu_a, nu_b = optax.tree_utils.tree_get(sa["opt_state"], "nu"), optax.tree_utils.tree_get(sb["opt_state"], "nu")
  worst_mu = worst_nu = 0.0
  mu_scale = max(float(np.abs(x).max()) for _, x in _leaves(mu_b))
  assert mu_scale > 1e-6, mu_scale  # a non-zero gradient
  for (path, a), (_, b) in zip(_leaves(mu_a), _leaves(mu_b)):
    scale = float(np.abs(b).max())
    diff = float(np.abs(a - b).max())
    worst_mu = max(worst_mu, diff / max(scale, 1e-30))
    assert diff <= rel * scale, (
      f"mu{path}: max |A - B| = {diff:.3g}, tolerance {rel * scale:.3g} (max |mu| {scale:.3g})"
    )
  for (path, a), (_, b) in zip(_leaves(nu_a), _leaves(nu_b)):
    scale = float(np.abs(b).max())
    diff = float(np.abs(a - b).max())
    worst_nu = max(worst_nu, diff / max(scale, 1e-30))
    assert diff <= 2 * rel * scale, f"nu{path}: max |A - B| = {diff:.3g}, tolerance {2 * rel * scale:.3g}"  # g**2
  report["mu_max_abs_diff"] = max(float(np.abs(a - b).max()) for (_, a), (_, b) in zip(_leaves(mu_a), _leaves(mu_b)))
  report["mu_max_abs"] = mu_scale
  report["mu_max_rel_diff_per_leaf"] = worst_mu
  report["nu_max_rel_diff_per_leaf"] = worst_nu

  # -- parameters: each run's is the AdamW step of its own moments from the shared start ---------------------------
  # Adam normalises the update to about lr * sign(g), so near-zero gradient elements turn moment differences far
  # inside the tolerance above into parameter differences up to 2 lr: the parameters are checked as the AdamW step
  # (computed here in float64) of each run's moments, which then bound how far A's and B's may differ.
  # optax works in float32: its hyperparameters are float32 and so are the bias corrections 1 - b**1 (1 - 0.999 is
  # 9.99987e-4 in float32, 1.3e-5 from 1e-3: a 6e-9 change of a 1e-3 update).
  o = config.optim
  lr, eps, wd = (float(np.float32(x)) for x in (o.lr, o.eps, o.weight_decay))
  bc1, bc2 = (float(np.float32(1) - np.float32(b)) for b in (o.b1, o.b2))

  def adamw(p, mu, nu):
    return p - lr * ((mu / bc1) / (np.sqrt(nu / bc2) + eps) + wd * p)

  worst_p = moved = 0.0
  for (path, p), (_, a), (_, b), (_, ma_), (_, na), (_, mb_), (_, nb) in zip(
    _leaves(p0),
    _leaves(sa["params"]),
    _leaves(sb["params"]),
    _leaves(mu_a),
    _leaves(nu_a),
    _leaves(mu_b),
    _leaves(nu_b),
  ):
    # The float32 step's own rounding: a few ulps of p and of the update (seen: under 3).
    rounding = 8 * U32 * (np.abs(p) + lr)
    ua, ub = adamw(p, ma_, na), adamw(p, mb_, nb)
    assert np.all(np.abs(a - ua) <= rounding), f"A params{path} are not the AdamW step of A's moments"
    assert np.all(np.abs(b - ub) <= rounding), f"B params{path} are not the AdamW step of B's moments"
    bound = np.abs(ua - ub) + 2 * rounding
    assert np.all(np.abs(a - b) <= bound), f"params{path}: A and B differ beyond what their moments explain"
    worst_p = max(worst_p, float(np.abs(a - b).max()))
    moved = max(moved, float(np.abs(b - p).max()))
  assert moved > 0.5 * lr, moved  # the step moved the parameters by about lr
  report["params_max_abs_diff"] = worst_p
  report["params_lr"] = lr

  # -- metrics of the step ---------------------------------------------------------------------------------------
  for key, scale in (("train/loss", adv_max), ("train/grad_norm", abs(mb["train/grad_norm"]))):
    diff = abs(ma[key] - mb[key])
    report[f"{key}_abs_diff"] = diff
    report[key] = [ma[key], mb[key]]
    assert diff <= rel * scale, f"{key}: A {ma[key]!r}, B {mb[key]!r}, tolerance {rel * scale:.3g}"
  assert mb["train/grad_norm"] > 0
  report["tolerance_rel"] = rel
  return report
