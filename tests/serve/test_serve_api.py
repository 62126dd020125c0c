"""The OpenAI-compatible server through the `openai` client: greedy output equal to `rollout.generate`, chat,
streaming, n, stop strings, log-probs, vLLM's extra fields and the error schema."""

import concurrent.futures

import jax
import numpy as np
import pytest

from aepo_jax.rollout import generate
from serve_helpers import MAX_LEN, MAX_SLOTS, http_request, metric

openai = pytest.importorskip("openai")
PROMPT_IDS = [1, 40, 41, 42, 43]


def reference(tiny, prompt, max_tokens, **kw):
  """rollout.generate's record for one prompt, with the server's EOS ids."""
  cfg, params, tok = tiny
  return generate(
    cfg, params, [prompt], max_new_tokens=max_tokens, temperature=kw.pop("temperature", 0.0), eos_ids=tok.eos_ids, **kw
  )[0]


def completion(client, prompt, max_tokens=24, **extra):
  body = {
    k: extra.pop(k)
    for k in list(extra)
    if k in ("temperature", "n", "stop", "logprobs", "echo", "seed", "top_p", "stream")
  }
  return client.completions.create(
    model="tiny",
    prompt=prompt,
    max_tokens=max_tokens,
    **{"temperature": 0.0, **body},
    extra_body={"return_token_ids": True, **extra},
  )


def test_models_health_and_metrics(server):
  status, _, body = http_request(server.url, "GET", "/v1/models")
  assert status == 200 and body["data"][0]["id"] == "tiny" and body["data"][0]["max_model_len"] == MAX_LEN
  assert http_request(server.url, "GET", "/health")[:1] == (200,)
  assert metric(server.url, "slots") == MAX_SLOTS
  for name in ("generated_tokens_total", "tokens_per_second", "queue_length", "slots_in_use"):
    metric(server.url, name)


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_greedy_completion_equals_rollout_generate(tiny, client, penalty):
  _, _, tok = tiny
  ref = reference(tiny, PROMPT_IDS, 40, repetition_penalty=penalty)
  r = completion(client, PROMPT_IDS, 40, repetition_penalty=penalty)
  c = r.choices[0]
  np.testing.assert_array_equal(c.token_ids, ref["tokens"])
  body = [t for t in ref["tokens"] if t not in tok.eos_ids]
  assert c.text == tok.decode(body, skip_special_tokens=True)
  assert c.finish_reason == ("stop" if ref["stop_reason"] == "eos" else "length")
  assert r.usage.prompt_tokens == len(PROMPT_IDS) and r.usage.completion_tokens == len(ref["tokens"])
  if penalty == 1.3:
    assert list(c.token_ids) != list(reference(tiny, PROMPT_IDS, 40)["tokens"])  # the penalty reached the engine


def test_string_prompt_and_several_prompts(tiny, client):
  _, _, tok = tiny
  prompts = ["The quick brown fox", "What is 12 times"]
  r = completion(client, prompts, 12, n=2)
  assert [c.index for c in r.choices] == [0, 1, 2, 3]  # prompt i, choice j -> i * n + j
  for i, p in enumerate(prompts):
    ref = reference(tiny, tok.encode(p), 12)["tokens"]
    for j in range(2):
      np.testing.assert_array_equal(r.choices[2 * i + j].token_ids, ref)
  assert r.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)


def test_greedy_output_is_the_same_alone_and_among_other_requests(tiny, client):
  alone = completion(client, PROMPT_IDS, 60).choices[0].token_ids
  others = [
    dict(temperature=1.0, top_k=5),
    dict(temperature=0.7, top_p=0.8),
    dict(temperature=1.2, min_p=0.1),
    dict(temperature=1.0, repetition_penalty=1.2),
    dict(temperature=0.9),
    dict(temperature=1.0, seed=3),
  ]
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    noise = [
      pool.submit(completion, client, [7, 8, 9, 10][: 1 + i % 4], 30 + 7 * i, **kw) for i, kw in enumerate(others)
    ]
    mixed = [pool.submit(completion, client, PROMPT_IDS, 60) for _ in range(2)]
    for f in noise + mixed:
      f.result()
  for f in mixed:
    assert f.result().choices[0].token_ids == alone


def test_chat_completion_uses_the_chat_template(tiny, client):
  _, _, tok = tiny
  messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 6 * 7?"}]
  ids = tok.apply_chat_template(messages)
  ref = reference(tiny, ids, 20)
  r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0.0)
  body = [t for t in ref["tokens"] if t not in tok.eos_ids]
  assert r.choices[0].message.role == "assistant"
  assert r.choices[0].message.content == tok.decode(body, skip_special_tokens=True)
  assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref["tokens"])
  parts = [{"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "6 * 7?"}]}]
  a = client.chat.completions.create(model="tiny", messages=parts, max_tokens=8, temperature=0.0)
  b = client.chat.completions.create(
    model="tiny", messages=[{"role": "user", "content": "What is 6 * 7?"}], max_tokens=8, temperature=0.0
  )
  assert a.choices[0].message.content == b.choices[0].message.content


def test_streaming_equals_non_streaming(client):
  full = client.completions.create(model="tiny", prompt="The quick", max_tokens=30, temperature=0.0)
  chunks = list(
    client.completions.create(model="tiny", prompt="The quick", max_tokens=30, temperature=0.0, stream=True)
  )
  assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
  assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
  assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
  assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens  # usage on the last chunk
  msgs = [{"role": "user", "content": "Say something."}]
  full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=25, temperature=0.0, n=2)
  chunks = list(
    client.chat.completions.create(
      model="tiny",
      messages=msgs,
      max_tokens=25,
      temperature=0.0,
      n=2,
      stream=True,
      stream_options={"include_usage": True},
    )
  )
  assert chunks[0].choices[0].delta.role == "assistant"
  for i in range(2):
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
    assert text == full.choices[i].message.content
  assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_n_choices_sample_independently_and_reproduce_with_a_seed(server, client):
  kw = dict(model="tiny", prompt="Search the web", max_tokens=16, temperature=1.0, n=3, seed=11)
  before = metric(server.url, "prompt_tokens_total")
  a = client.completions.create(**kw)
  assert metric(server.url, "prompt_tokens_total") - before == a.usage.prompt_tokens  # prefilled once, forked
  b = client.completions.create(**kw)
  texts = [c.text for c in a.choices]
  assert texts == [c.text for c in b.choices]
  assert len(set(texts)) > 1
  assert a.usage.prompt_tokens == b.usage.prompt_tokens < a.usage.completion_tokens  # the prompt counted once
  with pytest.raises(openai.BadRequestError, match="n"):
    client.completions.create(model="tiny", prompt="x", max_tokens=4, n=MAX_SLOTS + 1)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_cut_the_text_with_and_without_the_stop(client, stream):
  full = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=60, temperature=0.0).choices[0]
  text = full.text
  stop = text[20:23]
  assert len(stop) == 3 and stop in text

  def ask(**extra):
    kw = dict(
      model="tiny", prompt="def f(x):", max_tokens=60, temperature=0.0, stop=[stop, "@@never@@"], extra_body=extra
    )
    if not stream:
      return client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(stream=True, **kw))
    return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason

  cut = text.index(stop)
  got = ask()
  text_a, reason_a = (got.text, got.finish_reason) if not stream else got
  assert text_a == text[:cut] and reason_a == "stop"
  got = ask(include_stop_str_in_output=True)
  text_b, reason_b = (got.text, got.finish_reason) if not stream else got
  assert text_b == text[: cut + len(stop)] and reason_b == "stop"
  if not stream:
    assert got.stop_reason == stop


def test_stop_token_ids(tiny, client):
  ids = completion(client, PROMPT_IDS, 30).choices[0].token_ids
  r = completion(client, PROMPT_IDS, 30, stop_token_ids=[ids[5]]).choices[0]
  first = ids.index(ids[5])
  assert r.token_ids == ids[: first + 1] and r.finish_reason == "stop" and r.stop_reason == ids[5]


def test_logprobs_match_the_engine_and_echo_gives_prompt_logprobs(tiny, client):
  cfg, params, tok = tiny
  ref = reference(tiny, PROMPT_IDS, 12)
  r = completion(client, PROMPT_IDS, 12, logprobs=3, return_tokens_as_token_ids=True).choices[0]
  lp = r.logprobs
  np.testing.assert_allclose(lp.token_logprobs, ref["logprobs"][: len(lp.token_logprobs)], atol=1e-5)
  assert [int(t.split(":")[1]) for t in lp.tokens] == list(ref["tokens"][: len(lp.tokens)])
  for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
    assert 3 <= len(top) <= 4 and max(top.values()) == pytest.approx(chosen)  # greedy: the chosen is the top
  assert lp.text_offset == sorted(lp.text_offset)
  # echo: the prompt's text and log-probs (teacher-forced, T = 1) come first
  from aepo_jax.model import forward

  logp = np.asarray(jax.nn.log_softmax(forward(cfg, params, np.asarray([PROMPT_IDS]))[0], -1))
  e = completion(client, PROMPT_IDS, 5, logprobs=1, echo=True, return_tokens_as_token_ids=True).choices[0]
  assert e.text.startswith(tok.decode(PROMPT_IDS))
  assert e.logprobs.token_logprobs[0] is None and e.logprobs.top_logprobs[0] is None
  np.testing.assert_allclose(
    e.logprobs.token_logprobs[1 : len(PROMPT_IDS)], logp[np.arange(len(PROMPT_IDS) - 1), PROMPT_IDS[1:]], atol=1e-4
  )
  assert len(e.logprobs.tokens) == len(PROMPT_IDS) + 5
  chat = client.chat.completions.create(
    model="tiny",
    messages=[{"role": "user", "content": "hi"}],
    max_tokens=6,
    temperature=0.0,
    logprobs=True,
    top_logprobs=2,
  )
  content = chat.choices[0].logprobs.content
  assert len(content) >= 1 and all(len(c.top_logprobs) == 2 for c in content)
  assert all(c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
  eos = chat.choices[0].finish_reason == "stop"
  assert len(content) == chat.usage.completion_tokens - eos  # every token but a final EOS


def test_vllm_sampling_fields_reach_the_sampler(client):
  greedy = completion(client, PROMPT_IDS, 30).choices[0].token_ids
  # top_k=1 or min_p=1 at temperature 1 keep only the most likely token: the greedy path
  assert completion(client, PROMPT_IDS, 30, temperature=1.0, top_k=1).choices[0].token_ids == greedy
  assert completion(client, PROMPT_IDS, 30, temperature=1.0, min_p=1.0).choices[0].token_ids == greedy
  sampled = completion(client, PROMPT_IDS, 30, temperature=1.0, seed=5).choices[0].token_ids
  assert sampled != greedy


@pytest.mark.parametrize(
  "body,param",
  [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "logprobs": 50}, "logprobs"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "min_p": 2}, "min_p"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": [1, 2, 100000]}, "prompt"),
    ({"prompt": {"a": 1}}, "prompt"),
    ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ({}, "prompt"),
  ],
)
def test_bad_requests_get_400_with_openai_error_schema(server, body, param):
  status, _, resp = http_request(server.url, "POST", "/v1/completions", body)
  assert status == 400
  assert set(resp["error"]) == {"message", "type", "param", "code"} and resp["error"]["param"] == param
  assert resp["error"]["type"] == "invalid_request_error"


def test_other_errors(server, client):
  status, _, resp = http_request(server.url, "POST", "/v1/completions", raw=b"{not json")
  assert status == 400 and "JSON" in resp["error"]["message"]
  status, _, resp = http_request(server.url, "POST", "/v1/chat/completions", {"messages": []})
  assert status == 400 and resp["error"]["param"] == "messages"
  with pytest.raises(openai.BadRequestError, match=f"maximum context length is {MAX_LEN} tokens"):
    client.completions.create(model="tiny", prompt=[5] * MAX_LEN, max_tokens=1)
  with pytest.raises(openai.BadRequestError, match=f"maximum context length is {MAX_LEN}"):
    client.completions.create(model="tiny", prompt=[5] * 100, max_tokens=MAX_LEN)
  with pytest.raises(openai.NotFoundError, match="does not exist"):
    client.completions.create(model="other", prompt="x", max_tokens=2)
  assert http_request(server.url, "GET", "/v1/nothing")[0] == 404
  # the server still answers normally afterwards
  assert completion(client, PROMPT_IDS, 3).choices[0].finish_reason == "length"
