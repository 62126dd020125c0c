"""Token ids -> text for one choice: incremental text equals a full decode, stop strings (held back while they
may complete, with and without the stop), stop token ids and EOS."""

import numpy as np
import pytest

from aepo_jax.serve._text import ChoiceText


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  from aepo_jax.model import Tokenizer
  from aepo_jax.testing import tiny_tokenizer

  return Tokenizer.from_dir(tiny_tokenizer(tmp_path_factory.mktemp("tok")))


def stream(ct, ids, chunk=3, final="length"):
  """Pushes ids in chunks like the scheduler does; returns the concatenated deltas."""
  out = []
  for k in range(0, len(ids), chunk):
    last = k + chunk >= len(ids)
    ct.push(ids[k : k + chunk], final=final if last else None)
    out.append(ct.take(done=last or ct.stopped)[0])
    if ct.stopped:
      break
  return "".join(out)


def test_incremental_text_equals_a_full_decode(tok):
  rng = np.random.default_rng(0)
  for _ in range(20):
    ids = rng.integers(3, tok.vocab_size, size=int(rng.integers(1, 40))).tolist()  # any bytes, partial UTF-8 too
    ct = ChoiceText(tok)
    assert stream(ct, ids, chunk=int(rng.integers(1, 6))) == tok.decode(ids, skip_special_tokens=True) == ct.text
    assert ct.num_tokens == len(ids) and [p.token_id for p in ct.pieces] == ids


def test_stop_string_across_tokens_is_cut_and_never_streamed(tok):
  ids = tok.encode("print(6 * 7)</python><result>42</result>")
  full = tok.decode(ids)
  for include in (False, True):
    ct = ChoiceText(tok, stop=["</python>", "never"], include_stop=include)
    got = stream(ct, ids, chunk=1)
    want = full[: full.index("</python>") + (len("</python>") if include else 0)]
    assert got == ct.text == want and ct.stopped and ct.stop_reason == "</python>"
    assert ct.num_tokens < len(ids)  # counted up to the token completing the stop
  ct = ChoiceText(tok, stop=["</python>"])
  ct.push(ids[: len(tok.encode("print(6 * 7)</py"))])
  assert "</" not in ct.take(done=False)[0]  # a possible stop start is held back


def test_stop_token_ids_and_eos(tok):
  ids = tok.encode("The quick brown fox")
  ct = ChoiceText(tok, stop_token_ids=[ids[2]])
  stream(ct, ids)
  assert ct.token_ids == ids[:3] and ct.stop_reason == ids[2] and ct.text == tok.decode(ids[:2])
  ct = ChoiceText(tok, stop_token_ids=[ids[2]], include_stop=True)
  stream(ct, ids)
  assert ct.text == tok.decode(ids[:3])
  ct = ChoiceText(tok, eos_ids=[2], skip_special_tokens=False)
  stream(ct, ids + [2], final="eos")
  assert ct.text == tok.decode(ids) and ct.num_tokens == len(ids) + 1 and not ct.stopped


def test_skip_special_tokens(tok):
  ids = tok.encode("hi") + [1] + tok.encode("there")  # 1 = <|im_start|>
  assert stream(ChoiceText(tok), ids) == "hithere"
  assert stream(ChoiceText(tok, skip_special_tokens=False), ids) == "hi<|im_start|>there"
