"""Shared test fixtures (the HF ones need `transformers` + CPU `torch`, i.e. the `[test]` extra; imported lazily).

tiny_model_config(family='llama', **overrides)       the tests' tiny aepo_jax ModelConfig (hidden 32, 2 layers,
                                                        4 heads of 8, 2 KV heads, MLP 64, vocab 97; TINY_MODEL)
tiny_hf_config(family, **overrides) -> dict           config.json dict of a tiny Llama / Qwen2 / Qwen3
tiny_hf_model(family, seed=0, **overrides)             a randomly initialised transformers model (float32)
tiny_hf_checkpoint(family, path, seed=0, max_shard_size=None, **overrides) -> path
                                                        the same model saved with save_pretrained
tiny_tokenizer(path, vocab_size=300) -> path            a byte-level BPE tokenizer.json + ChatML template
FAMILIES                                               ('llama', 'llama_rope', 'qwen2', 'qwen3')
MOE_FAMILIES                                           ('qwen3_moe',): 3 layers (the middle one dense), 8 experts, top 2
chat_server(reply) -> (base_url, requests)             a fake OpenAI-compatible chat server (context manager)
free_port() / run_processes(cmds, timeout, env, cwd)   several processes at once (hosts of a pod), none left behind
"""

from aepo_jax.testing._chat_server import chat_server
from aepo_jax.testing._hf import FAMILIES, MOE_FAMILIES, tiny_hf_checkpoint, tiny_hf_config, tiny_hf_model
from aepo_jax.testing._model import TINY_MODEL, tiny_model_config
from aepo_jax.testing._processes import free_port, run_processes
from aepo_jax.testing._tokenizer import CHATML_TEMPLATE, tiny_tokenizer
