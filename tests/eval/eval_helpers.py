"""Plain helpers of the eval tests (fixtures live in conftest.py; this module has a unique name so that
`from eval_helpers import ...` never picks up another part's conftest)."""

import json
import os
import socket

import jax
import numpy as np

from aepo_jax.data import Example
from aepo_jax.eval import EvalSettings

# One engine shape for all in-process eval tests, so the engine compiles once per session (greedy).
SETTINGS = EvalSettings(
  n=2, temperature=0.0, max_prompt_len=256, max_response_len=200, batch_size=4, chunk_steps=8, template="compact"
)


def bigram_params(config, params, tokenizer, transitions: dict):
  """Params whose greedy next token depends only on the current token: attention and MLP outputs are zeroed
  (the residual stream is the token embedding) and lm_head maps each `a` to its `transitions[a]` with a
  margin far above the cross-talk of random embeddings."""
  p = jax.tree.map(np.array, params)
  p["layers"]["self_attn"]["o_proj"]["kernel"][:] = 0
  p["layers"]["mlp"]["down_proj"]["kernel"][:] = 0
  emb = p["embed_tokens"]["embedding"]
  normed = emb / np.sqrt(np.mean(emb**2, axis=-1, keepdims=True) + config.rms_norm_eps)
  w = np.zeros_like(p["lm_head"]["kernel"])
  for a, b in transitions.items():
    w[:, b] += 10.0 * normed[a] / config.hidden_size
  p["lm_head"]["kernel"] = w
  return p


def _ids(tokenizer, *names):
  return [tokenizer.token_id(n) for n in names]


def short_examples(n=3, family="math", answer="18"):
  return [Example(f"toy:{i}", f"What is {i} plus {18 - i}?", [answer], "toy", family) for i in range(n)]


def save_checkpoint(directory, config, params, tok_dir, step=3, ocdbt=True, training=None):
  """`training`: more of the training config saved in the meta (e.g. {"data": {"template": "compact"}})."""
  from aepo_jax import checkpoint as _checkpoint

  ckpt = _checkpoint.Checkpointer(directory, async_save=False, ocdbt=ocdbt)
  ckpt.save(
    step,
    {"params": params},
    {
      "model_config": _checkpoint.model_config_to_json(config),
      "config": json.dumps({"model": {"name": "tiny", "tokenizer": tok_dir}, **(training or {})}),
    },
    force=True,
  )
  ckpt.close()


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def toy_data_root(root):
  """An ARPO-layout data root whose gsm8k holds short questions (the tiny tokenizer makes long prompts)."""
  d = os.path.join(root, "eval", "gsm8k")
  os.makedirs(d, exist_ok=True)
  with open(os.path.join(d, "test.jsonl"), "w") as f:
    for i in range(6):
      f.write(
        json.dumps({"idx": i, "question": f"What is {i} plus {18 - i}?", "answer": f"{i}+{18 - i}=18\n#### 18"}) + "\n"
      )
  return root
