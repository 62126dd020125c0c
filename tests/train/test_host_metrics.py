"""Per-host rollout time and trajectories of an RL step (`hosts/*`): on one process they are its own values."""

from aepo_jax.train import _rl


def test_host_rollout_metrics_on_one_process():
  m = _rl.host_rollout_metrics(12.5, 8, step=1)
  assert m == {
    "hosts/rollout_s_max": 12.5,
    "hosts/rollout_s_min": 12.5,
    "hosts/trajectories_max": 8.0,
    "hosts/trajectories_min": 8.0,
  }
