"""The generated task suite: seeded, split without leaks, demos in the exact rewarded format."""

import json
import re
import subprocess
import sys

import pytest

from aepo_jax.data.prompts import COMPACT
from aepo_jax.data.tasks import TOOL_RESULT, approx_tokens, generate_suite
from aepo_jax.rewards import deep_research


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
  return generate_suite(seed=11, n_train=120, n_heldout=40, corpus_dir=tmp_path_factory.mktemp("c"))


def test_seeded_and_sized(suite):
  again = generate_suite(seed=11, n_train=120, n_heldout=40)
  assert [e.to_dict() for e in again.train] == [e.to_dict() for e in suite.train]
  assert [d.segments for d in again.demos] == [d.segments for d in suite.demos]
  other = generate_suite(seed=12, n_train=120, n_heldout=40)
  assert [e.question for e in other.train] != [e.question for e in suite.train]
  assert len(suite.train) == 120 and len(suite.heldout) == 40 and len(suite.demos) == 120
  kinds = {e.metadata["kind"] for e in suite.train}
  assert kinds == {"arith", "kb", "both"}


def _entities(question):
  return set(re.findall(r"[A-Z][a-z]{3,}(?: [A-Z][a-z]+)?", question)) - {"What", "Which", "Who"}


def test_heldout_asks_nothing_train_asks(suite):
  train_q = {e.question for e in suite.train}
  assert not train_q & {e.question for e in suite.heldout}
  train_ents = set().union(*(_entities(e.question) for e in suite.train if e.metadata["kind"] != "arith"))
  for e in suite.heldout:
    if e.metadata["kind"] != "arith":
      assert not _entities(e.question) & train_ents, e.question


def test_kb_answers_only_in_the_corpus(suite):
  text = "\n".join(d["contents"] for d in suite.corpus)
  for e in suite.train + suite.heldout:
    if e.metadata["kind"] == "kb":
      assert e.answers[0] in text and e.answers[0] not in e.question


def test_every_demo_earns_full_reward(suite):
  for d in suite.demos:
    r = deep_research(d.response, d.example.answers)
    both = "</search>" in d.response and "</python>" in d.response
    assert r == pytest.approx(1.1 if both else 1.0), d.response
    assert both == (d.example.metadata["kind"] == "both")
  assert any(deep_research(d.response, d.example.answers) > 1.0 for d in suite.demos)


def test_demo_segments_follow_the_training_format(suite):
  for d in suite.demos:
    assert [m["role"] for m in d.messages] == ["system", "user", "assistant"]
    assert d.messages[0]["content"] == COMPACT and d.messages[1]["content"] == d.example.question
    assert d.messages[2]["content"] == "".join(t for _, t in d.segments)
    kinds = [k for k, _ in d.segments]
    assert kinds[0] == "model" and kinds[-1] == "model"
    assert all(a != b for a, b in zip(kinds, kinds[1:]))  # model/tool alternate
    for i, (kind, text) in enumerate(d.segments):
      if kind == "tool":
        assert re.fullmatch(r" <result>\n(.+)\n</result>", text, re.S)
        assert d.segments[i - 1][1].endswith(("</python>", "</search>"))  # the stop string
    assert d.segments[-1][1].endswith("</answer>")
    model_text = "".join(t for k, t in d.segments if k == "model")
    assert approx_tokens(model_text) <= 120, model_text


def test_python_results_are_the_real_output(suite):
  calls = [
    (text.split("<python>\n")[1].split("\n</python>")[0], d.segments[i + 1][1])
    for d in suite.demos
    for i, (kind, text) in enumerate(d.segments)
    if kind == "model" and text.endswith("</python>")
  ]
  assert len(calls) > 20
  # Run every demo's code in a separate interpreter, one process for all, outputs separated.
  script = "\n".join(f"{code}\nprint('<<END>>')" for code, _ in calls)
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60).stdout
  outputs = [o.strip() for o in out.split("<<END>>")[:-1]]
  assert [TOOL_RESULT.format(o) for o in outputs] == [result for _, result in calls]


def test_search_results_match_bm25_over_the_written_corpus(suite):
  import bm25s

  docs = [json.loads(line) for line in open(suite.corpus_path)]
  assert docs == suite.corpus and all(d["contents"].startswith('"') and "\n" in d["contents"] for d in docs)
  retriever = bm25s.BM25()
  retriever.index(
    bm25s.tokenize([d["contents"] for d in docs], stopwords="en", show_progress=False), show_progress=False
  )
  # Reference: bm25s scores of every document, best first, equal scores in corpus order.
  checked = 0
  for d in suite.demos:
    for i, (kind, text) in enumerate(d.segments):
      if kind == "model" and text.endswith("</search>"):
        query = text.split("<search> ")[1].split(" </search>")[0]
        scores = retriever.get_scores(
          bm25s.tokenize([query], stopwords="en", show_progress=False, return_ids=False)[0]
        ).tolist()
        pages = d.segments[i + 1][1][len(" <result>\n") : -len("\n</result>")].split("\n")
        assert 1 <= len(pages) <= 3
        hits = sorted(zip(scores, range(len(scores))), key=lambda h: (-h[0], h[1]))
        expect = [
          f"Page {n}: " + docs[j]["contents"].partition("\n")[2].strip()[:1000]
          for n, (s, j) in enumerate(hits[:3], start=1)
          if s > 0
        ]
        assert pages == expect
        assert d.example.answers[0] in pages[0] or d.example.metadata["kind"] == "both"
        checked += 1
  assert checked > 20


def test_difficulty_knob():
  easy = generate_suite(seed=1, n_train=60, n_heldout=5, mix=(1, 0, 0), difficulty=1)
  hard = generate_suite(seed=1, n_train=60, n_heldout=5, mix=(1, 0, 0), difficulty=3)
  digits = lambda s: max(len(n) for n in re.findall(r"\d+", s.example.question))  # noqa: E731
  assert max(map(digits, hard.demos)) > max(map(digits, easy.demos)) or sum(
    len(d.example.answers[0]) for d in hard.demos
  ) > sum(len(d.example.answers[0]) for d in easy.demos)
  with pytest.raises(ValueError, match="difficulty"):
    generate_suite(seed=1, n_train=2, n_heldout=1, difficulty=4)
  with pytest.raises(ValueError, match="mix"):
    generate_suite(seed=1, n_train=2, n_heldout=1, mix=(0, 0, 0))


def test_demo_search_text_equals_the_search_tool(suite, tmp_path):
  """Cross-check with aepo_jax.tools (RetrievalIndex + format_hits): the text a live rollout would see.
  Queries with tied BM25 scores in the top k+1 are skipped: the server leaves tie order open."""
  from aepo_jax.data._bm25 import Bm25Index
  from aepo_jax.tools._retrieval import RetrievalIndex
  from aepo_jax.tools._search import SearchHit, format_hits

  server_index = RetrievalIndex(str(suite.corpus_path), str(tmp_path / "index"))
  ours = Bm25Index(suite.corpus)
  compared = 0
  for d in suite.demos:
    for i, (kind, text) in enumerate(d.segments):
      if kind == "model" and text.endswith("</search>"):
        query = text.split("<search> ")[1].split(" </search>")[0]
        scores = [s for _, s in ours.search(query, 4)]
        if len(set(scores)) != len(scores):
          continue
        hits = [SearchHit(doc["title"], doc["text"]) for doc, _ in server_index.search([query], 3)[0]]
        assert TOOL_RESULT.format(format_hits(hits)) == d.segments[i + 1][1]
        compared += 1
  assert compared > 10


def _smollm2_tokenizer_json():
  import glob
  import os

  roots = [os.environ.get("AEPO_JAX_CACHE", ""), os.path.expanduser("~/.cache/aepo_jax"), "/tmp/aepo_cache"]
  found = [p for r in roots if r for p in glob.glob(os.path.join(r, "*smollm2*", "tokenizer.json"))]
  return found[0] if found else None


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_model_text_fits_the_cpu_budget(difficulty):
  """<= 120 tokens of model text per trace: by the upper estimate always, and by SmolLM2's own
  tokenizer when a converted copy is cached (aepo_jax.model.pretrained_dir)."""
  s = generate_suite(seed=difficulty, n_train=200, n_heldout=5, difficulty=difficulty)
  texts = ["".join(t for k, t in d.segments if k == "model") for d in s.demos]
  assert max(map(approx_tokens, texts)) <= 120
  path = _smollm2_tokenizer_json()
  if path is None:
    pytest.skip("no converted SmolLM2 tokenizer cached; the estimate alone was checked")
  from tokenizers import Tokenizer

  tok = Tokenizer.from_file(path)
  real = [len(tok.encode(t).ids) for t in texts]
  assert max(real) <= 120
