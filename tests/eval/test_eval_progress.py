"""The evaluation bar moves per answer as trajectories finish inside a batch's rollout, not once per batch."""

from aepo_jax.eval import Evaluator, Policy, Scorer
from aepo_jax.tools import ToolSet

from eval_helpers import SETTINGS, short_examples


class Bar:
  def __init__(self, ev):
    self.n, self.ev, self.live = 0, ev, 0

  def update(self, k):
    self.n += k
    self.live += k if self.ev.in_rollout else 0

  def set_postfix(self, **kw):
    pass

  def close(self):
    pass


def test_the_bar_advances_as_answers_finish_inside_the_rollout(tiny_config, tiny_params, tokenizer, tmp_path):
  tools = ToolSet({"python": lambda code: "42"}, mode="eval", retry_count=1)
  ev = Evaluator(Policy(tiny_config, tiny_params, tokenizer, "t"), tools, Scorer(), SETTINGS, show_progress=True)
  ev.in_rollout, rollouts = False, ev.rollouts

  def watched(*a, **k):
    ev.in_rollout = True
    try:
      return rollouts(*a, **k)
    finally:
      ev.in_rollout = False

  ev.rollouts = watched
  bars = []
  ev._bar = lambda *a: bars.append(Bar(ev)) or bars[-1]
  exs = short_examples(5)  # 10 answers (n=2) in batches of 4
  records = ev.run("toy", exs, str(tmp_path / "toy.jsonl"))
  (bar,) = bars
  assert bar.n == len(records) == 10
  assert bar.live == 10  # every answer counted when its trajectory ended, inside the rollout call
