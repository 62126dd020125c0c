"""bench/compare_algorithms.py: every algorithm gets the same budget, a sweep into another sweep's folder is refused,
and a killed sweep continues where it stopped without redoing a finished run (tiny model, real SFT and RL)."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from absl import app

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "compare_algorithms.py")


def _module():
  sys.path.insert(0, os.path.join(ROOT, "bench"))
  spec = importlib.util.spec_from_file_location("compare_algorithms", SCRIPT)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


MOD = _module()


def _spec(tmp_path, **kw):
  spec = dict(
    config=os.path.join(ROOT, "configs", "cpu_default.py"),
    algorithms=["grpo", "arpo", "aepo", "dapo", "gspo"],
    seeds=[0, 1],
    steps=3,
    eval_every=0,
    set=[],
    out=str(tmp_path),
    keep_checkpoints=False,
  )
  spec.update(kw)
  return spec


def test_every_algorithm_gets_the_same_budget_and_its_own_objective(tmp_path):
  from aepo_jax.train import flatten

  runs = MOD.plan(_spec(tmp_path))
  assert [(r["kind"], r["algorithm"], r["seed"]) for r in runs[:6]] == [
    ("sft", "sft", 0),
    ("rl", "grpo", 0),
    ("rl", "arpo", 0),
    ("rl", "aepo", 0),
    ("rl", "dapo", 0),
    ("rl", "gspo", 0),
  ]
  rl = {r["algorithm"]: flatten(r["config"]) for r in runs if r["kind"] == "rl" and r["seed"] == 1}
  for key in (
    "rollout.n",
    "data.prompts_per_step",
    "rollout.max_response_len",
    "optim.lr",
    "train.steps",
    "tools.retry_count",
  ):
    assert len({str(c[key]) for c in rl.values()}) == 1, key
  assert rl["grpo"]["train.steps"] == 3
  assert {a: c["rollout.policy"] for a, c in rl.items()} == {
    "grpo": "none",
    "arpo": "arpo",
    "aepo": "aepo",
    "dapo": "none",
    "gspo": "none",
  }
  assert {a: c["algo.loss"] for a, c in rl.items()} == {
    "grpo": "grpo",
    "arpo": "arpo",
    "aepo": "aepo",
    "dapo": "dapo",
    "gspo": "gspo",
  }
  assert rl["aepo"]["algo.entropy_advantage_coef"] == 0.2 and rl["arpo"]["algo.entropy_advantage_coef"] == 0.0
  assert rl["aepo"]["rollout.enable_dynamic_rollouts"] and not rl["arpo"]["rollout.enable_dynamic_rollouts"]
  arpo = next(r for r in runs if r["algorithm"] == "arpo")
  assert arpo["reverted"] == ["tools.retry_count"]  # the preset's 3 retries put back to the base's 1
  for r in runs:
    c = r["config"]
    assert (c.train.seed, c.sft.seed, c.data.seed) == (r["seed"],) * 3
    if r["kind"] == "rl":  # RL starts from its seed's SFT checkpoint
      assert c.mode == "rl" and c.model.init == "checkpoint"
      assert c.model.name == os.path.join(str(tmp_path), "sft", f"seed{r['seed']}", "work", "checkpoints", "sft")


def test_unknown_algorithm_and_another_sweeps_folder_are_refused(tmp_path):
  with pytest.raises(app.UsageError, match="no preset 'ppo2'"):
    MOD.preset("ppo2")
  MOD.check_spec(_spec(tmp_path))
  MOD.check_spec(_spec(tmp_path, seeds=[2], algorithms=["grpo"]))  # more seeds: added to the sweep
  with open(tmp_path / "sweep.json") as f:
    assert json.load(f)["seeds"] == [0, 1, 2]
  with pytest.raises(app.UsageError, match="steps: 3 there, 5 now"):
    MOD.check_spec(_spec(tmp_path, steps=5))


def test_a_variant_is_its_preset_with_its_own_keys(tmp_path):
  from aepo_jax.train import flatten

  label = "aepo+train.max_staleness=1+algo.off_policy=decoupled"
  runs = MOD.plan(_spec(tmp_path, algorithms=["aepo", label], seeds=[0]))
  plain, variant = (flatten(r["config"]) for r in runs[1:])
  diff = {k for k in plain if plain[k] != variant[k]}
  assert diff == {"train.max_staleness", "algo.off_policy", "workdir"}, diff
  assert variant["train.max_staleness"] == 1 and variant["algo.off_policy"] == "decoupled"
  assert runs[2]["dir"].endswith(os.path.join("rl", label, "seed0"))
  with pytest.raises(app.UsageError, match="no config key 'train.max_stale'"):
    MOD.plan(_spec(tmp_path, algorithms=["aepo+train.max_stale=1"], seeds=[0]))
  with pytest.raises(app.UsageError, match="KEY=VALUE"):
    MOD.parse_label("aepo+train.max_staleness")


def test_throughput_table_gives_ratios_on_the_same_seeds():
  import _compare_report as report

  def rec(algo, seed, traj, secs, compile_s=None):
    n = len(traj)
    return dict(
      algorithm=algo,
      seed=seed,
      trajectories=traj,
      rollout_s=secs,
      rollout_compile_s=compile_s,
      slot_occupancy=[0.5] * n,
      staleness_mean=[0.0] * n,
    )

  records = [
    rec("sync", 0, [16, 16, 16], [60.0, 20.0, 20.0], [50.0, 4.0, 4.0]),  # the first step is left out: 0.8/s
    rec("sync", 1, [16, 16], [50.0, 16.0]),  # 1.0/s (no compile metric: counted as 0)
    rec("partial", 0, [16, 16, 16], [60.0, 10.0, 10.0], [50.0, 0.0, 0.0]),  # 1.6/s: 2x (1.6x without compiles)
    rec("partial", 1, [16, 16], [50.0, 8.0]),  # 2.0/s: 2x
  ]
  assert report.trajectories_per_rollout_s(records[0]) == 0.8
  assert report.trajectories_per_rollout_s(records[0], compiles=False) == 1.0  # 32 / (16 + 16)
  table = report.throughput_table(records)
  # steps 2..: 2x; compiles excluded: 1.6x and 2x; all steps: 48/80 = 0.6/s vs 48/100 = 0.48/s (1.25x) and 32/58 vs
  # 32/66 (1.14x)
  assert (
    "| partial | 2 | 1.800 [1.600, 2.000] | 2.00 [2.00, 2.00] | 1.800 [1.600, 2.000] | 1.80 [1.60, 2.00] | "
    "0.576 [0.552, 0.600] | 1.19 [1.14, 1.25] |" in table
  ), table
  assert (
    "| sync | 2 | 0.900 [0.800, 1.000] | 1.00 [1.00, 1.00] | 1.000 [1.000, 1.000] | 1.00 [1.00, 1.00] | "
    "0.482 [0.480, 0.485] | 1.00 [1.00, 1.00] |" in table
  ), table


def test_steady_state_columns_count_the_same_steps_once_every_run_is_full(tmp_path):
  """With a partial arm of max_staleness K (from its record, else its label), the table adds the rates over steps
  K+2.. of every arm (the carried run is full there), trajectories and sampled tokens, with their ratios; without one
  it adds nothing. --records prints the tables of a saved results.json; a wrong file is named."""
  import _compare_report as report

  def rec(algo, traj, secs, toks, **kw):
    return dict(algorithm=algo, seed=0, trajectories=traj, rollout_s=secs, decode_tokens=toks,
                slot_occupancy=[0.5] * 5, staleness_mean=[0.0] * 5, **kw)  # fmt: skip

  sync = rec("sync", [16] * 5, [60.0, 20.0, 20.0, 20.0, 20.0], [1600] * 5)
  partial = rec("config+train.max_staleness=2", [16, 16, 16, 32, 32], [60.0, 10.0, 10.0, 16.0, 16.0], [1600] * 5)
  assert report.max_staleness(partial) == 2 and report.max_staleness(sync) == 0
  assert report.max_staleness(dict(partial, max_staleness=1)) == 1  # the record's own value first
  assert report.trajectories_per_rollout_s(partial, from_step=4) == 2.0  # 64 / 32
  assert report.trajectories_per_rollout_s(sync, from_step=4) == 0.8
  table = report.throughput_table([sync, partial])
  header, rule = table.splitlines()[:2]
  assert "steps 4.. (every run full)" in header and rule.count("---") == header.count("|") - 1
  assert table.splitlines()[3].endswith(
    "| 2.000 [2.000, 2.000] | 2.50 [2.50, 2.50] | 100.0 [100.0, 100.0] | 1.25 [1.25, 1.25] |"
  )
  assert "every run full" not in report.throughput_table([sync, dict(partial, algorithm="other")])
  saved = os.path.join(ROOT, "docs", "results", "partial_rollouts_ramp_10_steps.json")  # staleness up to 3
  out = subprocess.run([sys.executable, SCRIPT, f"--records={saved}"], capture_output=True, text=True, check=True)
  assert "steps 5.. (every run full)" in out.stdout and "| config+train.max_staleness=0 | 3 |" in out.stdout
  (tmp_path / "bad.json").write_text("[1, 2]")
  with pytest.raises(SystemExit, match="bad.json: not a results.json"):
    report.tables_from(str(tmp_path / "bad.json"))


def test_step_windows_give_per_seed_ratios_over_those_steps_only():
  """--windows=A-B,..: per arm and window, the trajectory and token rates over steps A..B (both included) as ratios
  to the first arm's run of the same seed, seed by seed and their mean, and the mean staleness per token over those
  steps; a missing seed is n/a; bad windows named; --windows without --records refused."""
  import _compare_report as report

  def rec(algo, seed, traj, secs, toks, **kw):
    return dict(algorithm=algo, seed=seed, trajectories=traj, rollout_s=secs, decode_tokens=toks, **kw)

  records = [
    rec("sync", 0, [16] * 4, [20.0] * 4, [800] * 4),
    rec("sync", 1, [16] * 4, [40.0] * 4, [800] * 4),
    rec("partial", 0, [8, 16, 32, 16], [10.0, 10.0, 20.0, 5.0], [400, 800, 1600, 800], staleness_mean=[0, 1, 2, 3.0]),
  ]
  assert report.trajectories_per_rollout_s(records[2], from_step=2, to_step=3) == 48 / 30
  rows = report.window_table(records, report.parse_windows("2-3, 4-4")).splitlines()
  assert rows[0].startswith("| algorithm | steps | trajectories per rollout second vs sync (seed 0 / seed 1) |")
  assert rows[1].count("---") == rows[0].count("|") - 1
  # seed 0, steps 2-3: 48 / 30 s against 32 / 40 s = 2.00x; tokens 2400 / 30 against 1600 / 40 = 2.00x; staleness 1.5
  assert rows[4] == "| partial | 2-3 | 2.00 / n/a | 2.00 | 2.00 / n/a | 2.00 | 1.50 / n/a |"
  assert rows[5] == "| partial | 4-4 | 4.00 / n/a | 4.00 | 4.00 / n/a | 4.00 | 3.00 / n/a |"  # 16 / 5 s vs 16 / 20 s
  for bad in ("5", "3-2", "0-4", "a-b"):
    with pytest.raises(SystemExit, match="--windows"):
      report.parse_windows(bad)
  assert report.parse_windows("") == []
  out = subprocess.run([sys.executable, SCRIPT, "--windows=5-12"], capture_output=True, text=True)
  assert out.returncode != 0 and "give --records=results.json with it" in out.stderr


def test_a_runs_record_and_table_carry_pass_at_k_and_the_per_token_entropy_split(tmp_path):
  """read_run on a hand-written metrics.jsonl: the greedy and sampled evaluations of one step are one evaluation,
  pass@k lands in before_pass / after_pass, a step without tool results has no after-tool entropy, and the table
  gets the pass@k and per-token entropy columns."""
  import types

  import _compare_report as report

  lines = [
    {"step": 0, "eval/accuracy": 0.1, "eval/s/tool_calls": 0.0, "eval/pass@1": 0.15, "eval/pass@4": 0.4},
    {"step": 1, "reward/mean": 0.2, "rollout/tokens_after_tool": 0, "rollout/token_entropy_elsewhere": 0.5},
    {
      "step": 2,
      "reward/mean": 0.4,
      "rollout/tool_calls_per_traj": 1.0,
      "rollout/tokens_after_tool": 40,
      "rollout/token_entropy_after_tool": 0.9,
      "rollout/token_entropy_elsewhere": 0.3,
    },
    {"step": 2, "eval/accuracy": 0.5, "eval/s/tool_calls": 1.0, "eval/pass@1": 0.45, "eval/pass@4": 0.8},
  ]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
  (tmp_path / "summary.json").write_text(json.dumps({"wall_s": 60.0}))
  run = dict(
    algorithm="aepo", seed=0, dir=str(tmp_path), reverted=[], config=types.SimpleNamespace(workdir=str(tmp_path))
  )
  rec = report.read_run(run)
  assert rec["before_pass"] == {"pass@1": 0.15, "pass@4": 0.4} and rec["after_pass"] == {"pass@1": 0.45, "pass@4": 0.8}
  assert (rec["before_accuracy"], rec["after_accuracy"]) == (0.1, 0.5)
  assert rec["token_entropy_after_tool"] == [None, 0.9] and rec["token_entropy_elsewhere"] == [0.5, 0.3]
  table = report.table([rec])
  assert "| pass@1 before RL | pass@1 after RL | pass@4 before RL | pass@4 after RL |" in table
  assert "| 0.400 [0.400, 0.400] | 0.800 [0.800, 0.800] |" in table
  assert "| 0.900 / 0.400 |" in table  # per token: after tool results / elsewhere, means over steps


def test_the_occupancy_profile_of_a_sweep_is_read_tabled_and_drawn(tmp_path):
  """rollout/occupancy_t00..t90 per step -> the run's mean profile over the steps after the first (which compiles),
  the wall-time occupancy column of the throughput table, and the profile panel of the plot."""
  import types

  import _compare_report as report

  def line(step, profile, slots):
    occ = {f"rollout/occupancy_t{10 * i:02d}": v for i, v in enumerate(profile)}
    return {"step": step, "reward/mean": 0.1, "rollout/trajectories": 16, "perf/rollout_s": 8.0, **occ,
            "rollout/occupancy_wall": float(np.mean(profile)), "rollout/slot_occupancy": 0.5,
            "rollout/engine_slots": slots, "rollout/decode_tokens": 25 * slots + 400,
            "rollout/response_len_mean": slots / 4}  # fmt: skip

  records = []
  for algo, tail, slots in (("sync", 0.1, 16), ("partial", 0.6, 32)):
    d = tmp_path / algo
    d.mkdir()
    lines = [line(1, [0.9] * 10, slots), line(2, [0.5] * 8 + [tail] * 2, slots)]
    lines.append(line(3, [0.5] * 8 + [tail + 0.2] * 2, slots))
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (d / "summary.json").write_text(json.dumps({"wall_s": 60.0}))
    run = dict(algorithm=algo, seed=0, dir=str(d), reverted=[], config=types.SimpleNamespace(workdir=str(d)))
    records.append(report.read_run(run))
  np.testing.assert_allclose(report.occupancy_profile(records[0]), [0.5] * 8 + [0.2] * 2)  # step 1 left out
  np.testing.assert_allclose(report.occupancy_profile(records[1]), [0.5] * 8 + [0.7] * 2)
  np.testing.assert_allclose(report.occupancy_profile(records[1], slots=True), [16.0] * 8 + [22.4] * 2)  # x 32
  table = report.throughput_table(records)  # occupancy columns: means over all steps, per decode step and wall time
  assert "| 0.50 [0.50, 0.50] | 0.59 [0.59, 0.59] |" in table  # sync: (0.9 + 0.42 + 0.46) / 3
  assert "| 0.50 [0.50, 0.50] | 0.66 [0.66, 0.66] |" in table  # partial: (0.9 + 0.52 + 0.56) / 3
  # Tokens sampled per rollout second (steps 2..): 800 / 8 and 1200 / 8, ratio 1.5; response tokens 4 and 8.
  assert "| 100.0 [100.0, 100.0] | 1.00 [1.00, 1.00] | 4.0 [4.0, 4.0] |" in table
  assert "| 150.0 [150.0, 150.0] | 1.50 [1.50, 1.50] | 8.0 [8.0, 8.0] |" in table
  report.plot(records, str(tmp_path / "algorithms.png"))
  assert (tmp_path / "algorithms.png").stat().st_size > 10_000


def test_plot_labels_number_long_variant_names():
  import _compare_report as report

  assert report.plot_labels(["grpo", "aepo"]) == ({"grpo": "grpo", "aepo": "aepo"},) * 2
  names = ["config+train.max_staleness=0", "config+train.max_staleness=1+train.hand_back=admission"]
  labels, ticks = report.plot_labels(names)
  assert ticks == {names[0]: "(1)", names[1]: "(2)"}
  assert labels[names[1]] == "(2) train.max_staleness=1\n+train.hand_back=admission"


def _sweep(out, tok_dir):
  return [
    sys.executable,
    SCRIPT,
    f"--config={os.path.join(ROOT, 'configs', 'testing', 'tiny_rl.py')}",
    f"--set=model.tokenizer={tok_dir}",
    "--set=sft.steps=1",
    "--set=data.suite.n_heldout=2",
    "--algorithms=grpo",
    "--seeds=0",
    "--steps=1",
    f"--out={out}",
  ]


@pytest.mark.slow
def test_a_killed_sweep_continues_without_redoing_finished_runs(tmp_path):
  from aepo_jax.testing import tiny_tokenizer

  tok_dir = str(tmp_path / "tok")
  tiny_tokenizer(tok_dir)
  out = tmp_path / "sweep"
  sft_done = out / "sft" / "seed0" / "summary.json"
  proc = subprocess.Popen(
    _sweep(out, tok_dir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
  )
  deadline = time.time() + 240
  while not sft_done.exists():  # killed once the first run (the seed's SFT) has finished
    assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
    assert time.time() < deadline, "the SFT run did not finish in 240 s"
    time.sleep(0.5)
  os.killpg(proc.pid, signal.SIGKILL)
  proc.wait()
  stamp = sft_done.stat().st_mtime_ns
  assert not (out / "rl" / "grpo" / "seed0" / "summary.json").exists()

  done = subprocess.run(_sweep(out, tok_dir), capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "2 runs (1 done already)" in done.stdout
  assert sft_done.stat().st_mtime_ns == stamp  # not redone
  results = json.loads((out / "results.json").read_text())
  (rec,) = results["records"]
  assert (rec["algorithm"], rec["seed"], rec["steps"]) == ("grpo", 0, [1])
  for key in ("before_accuracy", "after_accuracy", "reward", "top3_branch_share", "consecutive_branch_share"):
    assert key in rec
  assert (out / "plots" / "algorithms.png").stat().st_size > 10_000
  assert "| grpo | 1 |" in (out / "results.md").read_text()
  assert not (out / "rl" / "grpo" / "seed0" / "work" / "checkpoints").exists()  # removed once the run is done
