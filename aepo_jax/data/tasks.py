"""A generated tool-use task suite for CPU runs and tests, with cold-start demonstration traces.

Three kinds, each unsolvable for a 135M model without its tools:
  arith : multi-digit products, sums and modular arithmetic -> the Python tool;
  kb    : facts about an invented world, found only in the generated corpus -> the search tool;
  both  : a number looked up by search, then computed with Python (the tool bonus of §1.6 applies).
Held-out questions ask about entities (and operand tuples) the train split never asks about.
Demos follow the exact training format (spec §4): model text ending at the closing tool tag, the
environment's " <result>\\n{text}\\n</result>", more model text, then `<answer> \\boxed{X} </answer>`.
Python results are the real output of the demo code; search results are BM25 over the corpus with
the search tool's `Page i: <snippet>` text (see `_bm25`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import random
import re
from pathlib import Path

from aepo_jax.data._bm25 import Bm25Index
from aepo_jax.data._kb import generate_kb
from aepo_jax.data._records import Example
from aepo_jax.data.prompts import build_messages

TOOL_RESULT = " <result>\n{}\n</result>"  # what the training environment appends (spec §4)


@dataclasses.dataclass
class Demo:
  """One SFT trace. segments: [("model"|"tool", text)], concatenated = the assistant message;
  train on "model" segments only (the tool text is masked, as in RL)."""

  example: Example
  messages: list[dict[str, str]]
  segments: list[tuple[str, str]]

  @property
  def response(self) -> str:
    return "".join(t for _, t in self.segments)


@dataclasses.dataclass
class TaskSuite:
  train: list[Example]
  heldout: list[Example]
  corpus: list[dict]
  corpus_path: Path | None
  demos: list[Demo]


def approx_tokens(text: str) -> int:
  """A tokenizer-free estimate of BPE tokens: one per digit and symbol, one per started 4 letters
  of a word (invented names split into pieces). On the suite: 0.98x to 1.31x SmolLM2's count."""
  pieces = re.findall(r"[A-Za-z]+|\d|[^\sA-Za-z\d]", text)
  return sum(-(-len(p) // 4) if p[0].isalpha() else 1 for p in pieces)


def run_code(code: str) -> str:
  """Run a demo's (generated, trusted) code and return its stdout as the tool would show it."""
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    exec(code, {})  # noqa: S102 - our own arithmetic one-liners, never model output
  return buf.getvalue().strip()


# ----------------------------------------------------------------- arithmetic (python tool)
def _arith(rng: random.Random, d: int) -> tuple[str, str, tuple]:
  """(question, code, key) at difficulty d (1..3)."""
  kind = rng.choice(["mul", "sum", "mod"])
  if kind == "mul":
    a, b = rng.randint(100, 999 if d < 3 else 9999), rng.randint(10 if d == 1 else 100, 99 if d == 1 else 999)
    return f"What is {a} * {b}?", f"print({a} * {b})", ("mul", a, b)
  if kind == "sum":
    nums = [rng.randint(100, 999 if d == 1 else 9999) for _ in range(2 + d)]
    return f"What is {' + '.join(map(str, nums))}?", f"print({' + '.join(map(str, nums))})", ("sum", *nums)
  m = rng.randint(11, 99)
  if d == 3:
    a, e = rng.randint(100, 999), rng.randint(10, 99)
    return f"What is {a}^{e} mod {m}?", f"print(pow({a}, {e}, {m}))", ("pow", a, e, m)
  a = rng.randint(10_000, 999_999) if d == 1 else rng.randint(100, 999) * rng.randint(100, 999)
  return f"What is {a} mod {m}?", f"print({a} % {m})", ("mod", a, m)


# ----------------------------------------------------------------- knowledge base (search tool)
def _kb_fact(rng: random.Random, people, cities, companies) -> tuple:
  """(question, answer, candidate queries, entity name) for one fact about an entity of the split."""
  kind = rng.choice(["person", "person", "city", "company"])
  if kind == "person":
    p = rng.choice(people)
    q, a, kw = rng.choice(
      [
        (f"In which city was {p.name} born?", p.city, "born"),
        (f"In what year was {p.name} born?", str(p.born), "born"),
        (f"Which company does {p.name} work for?", p.employer, "works"),
        (f"What is the profession of {p.name}?", p.profession, ""),
      ]
    )
    return q, a, [f"{p.name} {kw}".strip(), p.name], p.name
  if kind == "city":
    c = rng.choice(cities)
    q, a, kw = rng.choice(
      [
        (f"In which country is the city of {c.name}?", c.country, "country"),
        (f"In what year was the city of {c.name} founded?", str(c.founded), "founded"),
      ]
    )
    return q, a, [f"{c.name} {kw}", c.name], c.name
  co = rng.choice(companies)
  q, a, kw = rng.choice(
    [
      (f"Who founded {co.name}?", co.founder, "founded"),
      (f"In which city are the headquarters of {co.name}?", co.city, "headquarters"),
    ]
  )
  return q, a, [f"{co.name} {kw}", co.name], co.name


def _search_ok(index: Bm25Index, queries: list[str], must_contain: str, entity: str, k: int):
  """(query, result text) for the first query whose top page is the entity's own page holding the
  answer, preferring queries without score ties in the top k+1 (then any BM25 returns the same
  pages in the same order); ties that remain are broken by corpus order (Bm25Index.search), an
  order a server may not reproduce."""
  fallback = None
  for query in queries:
    hits = index.search(query, k + 1)
    if not hits or (len(hits) > 1 and hits[0][1] == hits[1][1]):
      continue
    top = index.docs[hits[0][0]]["contents"]
    if not top.startswith(f'"{entity}"') or must_contain not in top:
      continue
    scores = [s for _, s in hits]
    if len(set(scores)) == len(scores):
      return query, index.result_text(query, k)
    fallback = fallback or (query, index.result_text(query, k))
  return fallback


def _model(think: str, call: str) -> str:
  return f"<think> {think} </think> {call}"


def _answer(think: str, answer: str) -> str:
  return f" <think> {think} </think> <answer> \\boxed{{{answer}}} </answer>"


def generate_suite(
  seed: int,
  n_train: int,
  n_heldout: int,
  corpus_dir: str | Path | None = None,
  *,
  difficulty: int = 1,
  mix: tuple[float, float, float] = (0.4, 0.4, 0.2),
  top_k: int = 3,
  template: str = "compact",
  heldout_fraction: float = 0.25,
  tool_demo_fraction: float = 1.0,
) -> TaskSuite:
  """Seeded suite: `n_train` + `n_heldout` Examples, the corpus (written to
  `corpus_dir/corpus.jsonl` when given) and one demo per train example.

  difficulty 1..3 grows the operands (3-digit x 2-digit ... 4-digit x 3-digit, 3..5 summands,
  modular powers) and the multiplier of the combined tasks. mix = shares of (arith, kb, both).
  tool_demo_fraction: the share of demos that call their tools; the others state the answer at once
  (`<think> I know this. </think> <answer> ... </answer>`), as a model that has memorised its training
  answers would: a cold start that has not learnt *when* tools are needed. On held-out questions that
  habit is wrong, so RL has something to teach. The questions, answers and corpus do not depend on it.
  """
  if not 0.0 <= tool_demo_fraction <= 1.0:
    raise ValueError(f"tool_demo_fraction must be in [0, 1], got {tool_demo_fraction}")
  demo_rng = random.Random(f"{seed}/demos")  # separate stream: the tasks are the same for every fraction
  if difficulty not in (1, 2, 3):
    raise ValueError(f"difficulty must be 1, 2 or 3, got {difficulty}")
  if len(mix) != 3 or min(mix) < 0 or sum(mix) <= 0:
    raise ValueError(f"mix must be three non-negative shares (arith, kb, both), got {mix}")
  rng = random.Random(seed)
  kb = generate_kb(rng, n_people=max(8, (n_train + n_heldout)))
  corpus = kb.documents()
  index = Bm25Index(corpus)

  def split(xs):  # disjoint entities per split: held-out facts are never asked in train
    xs = list(xs)
    rng.shuffle(xs)
    cut = max(1, int(len(xs) * heldout_fraction))
    return xs[cut:], xs[:cut]

  ents = {}
  for name, xs in (("people", kb.people), ("cities", kb.cities), ("companies", kb.companies)):
    ents["train", name], ents["heldout", name] = split(xs)

  seen_keys: set = set()
  splits: dict[str, list[Example]] = {"train": [], "heldout": []}
  demos: list[Demo] = []
  for split_name, n in (("train", n_train), ("heldout", n_heldout)):
    people, cities, companies = (ents[split_name, k] for k in ("people", "cities", "companies"))
    attempts = 0
    while len(splits[split_name]) < n:
      attempts += 1
      if attempts > 50 * n + 100:
        raise RuntimeError(f"could not generate {n} distinct {split_name} tasks; lower n or raise difficulty")
      kind = rng.choices(["arith", "kb", "both"], weights=mix)[0]
      if kind == "arith":
        question, code, key = _arith(rng, difficulty)
        answer = run_code(code)
        segs = [
          ("model", _model("I compute this exactly with Python.", f"<python>\n{code}\n</python>")),
          ("tool", TOOL_RESULT.format(answer)),
          ("model", _answer(f"The result is {answer}.", answer)),
        ]
      elif kind == "kb":
        question, answer, queries, entity = _kb_fact(rng, people, cities, companies)
        key = ("kb", question)
        found = _search_ok(index, queries, answer, entity, top_k)
        if found is None:
          continue
        query, result = found
        segs = [
          ("model", _model(f"I need to look up {entity}.", f"<search> {query} </search>")),
          ("tool", TOOL_RESULT.format(result)),
          ("model", _answer(f"The page says {answer}.", answer)),
        ]
      else:
        c = rng.choice(cities)
        k = rng.randint(11, 99) if difficulty < 3 else rng.randint(101, 999)
        question = f"What is the population of the city of {c.name} multiplied by {k}?"
        key = ("both", c.name, k)
        found = _search_ok(index, [f"{c.name} population", c.name], str(c.population), c.name, top_k)
        if found is None:
          continue
        query, result = found
        code = f"print({c.population} * {k})"
        answer = run_code(code)
        segs = [
          ("model", _model(f"Look up {c.name}.", f"<search> {query} </search>")),
          ("tool", TOOL_RESULT.format(result)),
          ("model", " " + _model("Now multiply.", f"<python>\n{code}\n</python>")),
          ("tool", TOOL_RESULT.format(answer)),
          ("model", _answer("I have the result.", answer)),
        ]
      if key in seen_keys:
        continue
      seen_keys.add(key)
      i = len(splits[split_name])
      ex = Example(
        f"tasks-{split_name}:{i}",
        question,
        [answer],
        f"tasks_{split_name}",
        "math" if kind == "arith" else "qa",
        {"kind": kind, "difficulty": difficulty, "seed": seed},
      )
      splits[split_name].append(ex)
      if split_name == "train":
        if demo_rng.random() >= tool_demo_fraction:
          segs = [("model", _answer("I know this.", answer)[1:])]
        msgs = build_messages(ex, template)
        response = "".join(t for _, t in segs)
        demos.append(Demo(ex, msgs + [{"role": "assistant", "content": response}], segs))

  corpus_path = None
  if corpus_dir is not None:
    corpus_path = Path(corpus_dir) / "corpus.jsonl"
    corpus_path.parent.mkdir(parents=True, exist_ok=True)
    with open(corpus_path, "w", encoding="utf-8") as f:
      for doc in corpus:
        f.write(json.dumps(doc, ensure_ascii=False) + "\n")
  return TaskSuite(splits["train"], splits["heldout"], corpus, corpus_path, demos)
