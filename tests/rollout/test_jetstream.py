"""Serving through JetStream 0.2.2's orchestrator (Driver + LLMOrchestrator) on CPU with the adapter."""

import asyncio
import importlib.util
import logging
import sys

import jax
import numpy as np
import pytest

from aepo_jax.model import init_params
from aepo_jax.rollout import SamplingParams, generate
from aepo_jax.testing import tiny_model_config

pytestmark = pytest.mark.skipif(
  importlib.util.find_spec("jetstream") is None,
  reason="google-jetstream not installed (optional extra): pip install grpcio tiktoken blobfile shortuuid "
  "portpicker prometheus-client && pip install --no-deps google-jetstream==0.2.2",
)

CFG = tiny_model_config(vocab_size=320, eos_token_ids=(2,), pad_token_id=0)


def test_importing_jetstream_leaves_jax_seqio_and_logging_as_they_were():
  from aepo_jax.rollout._jetstream import jetstream_engine_class

  had_seqio, had_tree_map = "seqio" in sys.modules, hasattr(jax, "tree_map")
  root = logging.getLogger()
  level, handlers = root.level, list(root.handlers)
  jetstream_engine_class()
  from jetstream.core import orchestrator  # already imported inside the adapter, patched there

  assert ("seqio" in sys.modules) == had_seqio
  assert hasattr(jax, "tree_map") == had_tree_map
  assert (root.level, root.handlers) == (level, handlers)
  x = {"a": np.ones(2)}
  assert orchestrator.jax.tree_map(lambda v: v + 1, x)["a"].tolist() == [2.0, 2.0]
  assert orchestrator.jax.Array is jax.Array


@pytest.mark.slow
def test_orchestrator_serves_concurrent_requests_like_generate(tmp_path):
  from aepo_jax.rollout._jetstream import JetStreamEngine
  from aepo_jax.testing import tiny_tokenizer
  from transformers import AutoTokenizer

  tok = AutoTokenizer.from_pretrained(tiny_tokenizer(tmp_path / "tok"))
  params = jax.tree.map(lambda x: 4.0 * x if x.ndim >= 2 else x, init_params(CFG, jax.random.PRNGKey(1)))
  eng = JetStreamEngine(CFG, params, max_slots=2, max_len=64, tokenizer=tok, sampling=SamplingParams(0.0))
  from jetstream.core import orchestrator  # imported by the adapter, with its global changes undone
  from jetstream.core.proto import jetstream_pb2

  driver = orchestrator.Driver(
    prefill_engines=[eng],
    generate_engines=[eng],
    prefill_params=[params],
    generate_params=[params],
    interleaved_mode=True,
  )
  server = orchestrator.LLMOrchestrator(driver=driver)
  prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18]]  # more requests than slots

  async def one(p):
    req = jetstream_pb2.DecodeRequest(max_tokens=6, token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=p))
    ids = []
    async for resp in server.Decode(req):
      ids.extend(resp.stream_content.samples[0].token_ids)
    return ids

  async def all_requests():
    text_req = jetstream_pb2.DecodeRequest(
      max_tokens=4, text_content=jetstream_pb2.DecodeRequest.TextContent(text="The quick brown fox")
    )
    text_out = [r.stream_content.samples[0].text async for r in server.Decode(text_req)]
    return await asyncio.gather(*(one(p) for p in prompts)), "".join(text_out)

  async def serve():
    try:
      return await asyncio.wait_for(all_requests(), timeout=240)
    finally:
      # Stop JetStream's threads while the event loop still runs: its detokenize thread can signal a request's
      # channel after the last token was read, and an error in its threads kills the process (seen under load).
      await asyncio.to_thread(driver.stop)

  served, text = asyncio.run(serve())
  want = generate(CFG, params, prompts, max_new_tokens=6, temperature=0.0)
  for got, ref in zip(served, want):
    cut = ref["tokens"].tolist()
    if ref["stop_reason"] == "eos":
      cut = cut[:-1]  # JetStream does not return the stop token itself
    assert got == cut
  assert isinstance(text, str) and len(text) > 0
