"""Pre-flight checks of the model and tokenizer a config names (`aepo_jax.train._preflight` runs them): a local,
gs:// or bundled checkpoint that this project can load without a download, and the tokenizer that comes with it or
`model.tokenizer`. Each problem names the key and the fix; the checks add them to `p`, the pre-flight's problem
list (`p.add(message)`, `p.remote(key, path, check)` for a gs:// path checked under the shared deadline)."""

from __future__ import annotations

import json
import os
import re
from typing import Optional

from aepo_jax.train._config import did_you_mean

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _gs_fs():
  import fsspec

  return fsspec.filesystem("gs")


def _is_gs(path) -> bool:
  return str(path).startswith("gs://")


def _hub_message(key: str, name: str) -> str:
  base = name.rstrip("/").split("/")[-1]
  return (
    f"{key}={name!r} looks like a Hugging Face Hub id, and nothing is downloaded at run time. On a machine "
    f"with network, run `hf download {name} --local-dir {base}` (pip install huggingface_hub), "
    f"copy that directory to every host or to gs://BUCKET/models/{base}, and pass "
    f"--config.{key}=<that directory>."
  )


def _hf_config_problem(key: str, where: str, text: str) -> Optional[str]:
  from aepo_jax.model import from_hf_config

  try:
    from_hf_config(json.loads(text), source=where)
  except (ValueError, KeyError, NotImplementedError) as e:
    return f"{key}: {where} is not a config.json this project loads ({e})."
  return None


def _bundled_problem(key: str, name: str) -> Optional[str]:
  """A bundled name needs its converted cache directory or the pip package holding its GGUF."""
  from aepo_jax.model import _pretrained

  root = os.environ.get("AEPO_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "aepo_jax")
  if os.path.isfile(os.path.join(root, name, _pretrained._DONE)):
    return None
  try:
    _pretrained._gguf_path(name)
  except FileNotFoundError as e:
    return f"{key}={name!r}: {e}"
  return None


def _model(config, p):
  """model.name (and, when model.tokenizer is empty, the tokenizer that comes with it)."""
  from aepo_jax import model as model_lib

  mc = config.model
  name = str(mc.name)
  own_tokenizer = not mc.tokenizer and _needs_tokenizer(config)
  if mc.init == "random":
    if name not in model_lib.PRESETS:
      p.add(
        f"model.name={name!r} is not a preset (model.init='random' builds a preset's shape)"
        + did_you_mean(name, model_lib.PRESETS, otherwise=".")
        + f" Presets: {', '.join(sorted(model_lib.PRESETS))}"
        "; or set model.init='pretrained' to load weights."
      )
    if own_tokenizer:
      p.add(
        f"model.tokenizer is empty and model.init='random' brings no tokenizer, which mode={config.mode!r} "
        "needs; set --config.model.tokenizer=<directory with tokenizer.json>."
      )
    return
  if mc.init == "checkpoint":
    _checkpoint_source(name, p)
    return
  no_tokenizer = (
    f"model.name={name!r} has no tokenizer.json; set model.tokenizer to a directory (local or gs://) "
    "that holds the model's tokenizer."
  )
  if name in model_lib.PRETRAINED:
    problem = _bundled_problem("model.name", name)
    if problem:
      p.add(problem)
  elif _is_gs(name):

    def remote():
      fs, root = _gs_fs(), name.rstrip("/")
      if not fs.exists(root + "/config.json"):
        return (
          f"model.name={name!r}: {root}/config.json does not exist; give a gs:// directory holding a Hugging "
          "Face checkpoint (config.json, *.safetensors, tokenizer files)."
        )
      problem = _hf_config_problem("model.name", root + "/config.json", fs.cat(root + "/config.json").decode("utf-8"))
      if not problem and own_tokenizer and not fs.exists(root + "/tokenizer.json"):
        problem = no_tokenizer
      return problem

    p.remote("model.name", name, remote)
  elif os.path.isdir(name):
    cfg = os.path.join(name, "config.json")
    if not os.path.isfile(cfg):
      p.add(
        f"model.name={name!r} is a directory without config.json; give a Hugging Face checkpoint directory "
        "(config.json, *.safetensors, tokenizer files)."
      )
      return
    with open(cfg) as f:
      problem = _hf_config_problem("model.name", cfg, f.read())
    if problem:
      p.add(problem)
    elif not any(n.endswith(".safetensors") for n in os.listdir(name)):
      p.add(f"model.name={name!r} holds no *.safetensors weights; convert or re-download the checkpoint.")
    if own_tokenizer and not os.path.isfile(os.path.join(name, "tokenizer.json")):
      p.add(no_tokenizer)
  elif _HUB_ID.match(name) and not os.path.exists(name):
    p.add(_hub_message("model.name", name))
  else:
    p.add(
      f"model.name={name!r} is neither a bundled model ({', '.join(sorted(model_lib.PRETRAINED))}), a local "
      "Hugging Face directory with config.json, nor a gs:// one"
      + ("" if os.path.isabs(name) else f" (relative paths resolve against {os.getcwd()})")
      + "; fix the name or the path."
    )


def _checkpoint_source(name: str, p) -> None:
  """model.init='checkpoint': `name` resolves to committed Orbax steps of a run that saved its model config."""
  from aepo_jax import checkpoint

  try:
    ref = checkpoint.resolve_checkpoint(name)
  except checkpoint.CheckpointNotFoundError as e:
    p.add(f"model.name (model.init='checkpoint'): {str(e).replace('--checkpoint ', '')}")
    return
  if ref.kind != "orbax":
    p.add(
      f"model.name={name!r} is a {ref.kind} model, not an Orbax checkpoint of a training run; use "
      "model.init='pretrained' for it."
    )
  elif checkpoint.training_config(ref) is None:
    p.add(
      f"model.name={name!r}: no committed checkpoint with a saved training config there (an interrupted save, or "
      "not written by aepo_jax.train); give a step directory such as .../checkpoints/sft/16."
    )


def _needs_tokenizer(config) -> bool:
  sft = config.sft.enabled or config.mode == "sft"
  return config.mode != "sft" or (sft and config.sft.source != "synthetic")


def _tokenizer(config, p):
  """model.tokenizer, when set: a directory (local or gs://) with tokenizer.json."""
  from aepo_jax import model as model_lib

  tok = str(config.model.tokenizer)
  if not tok:
    return
  key = "model.tokenizer"
  if tok in model_lib.PRETRAINED:
    p.add(
      f"{key}={tok!r}: give a directory, or '' for the model's own; a bundled model's tokenizer is its "
      f"directory, printed by `python -c \"from aepo_jax.model import pretrained_dir; "
      f"print(pretrained_dir('{tok}'))\"`."
    )
  elif _is_gs(tok):

    def remote():
      f = tok.rstrip("/") + "/tokenizer.json"
      return None if _gs_fs().exists(f) else f"{key}: {f} does not exist; the tokenizer directory needs tokenizer.json."

    p.remote(key, tok, remote)
  elif os.path.isdir(tok):
    if not os.path.isfile(os.path.join(tok, "tokenizer.json")):
      p.add(
        f"{key}: {os.path.join(tok, 'tokenizer.json')} does not exist; point {key} at a directory holding "
        "tokenizer.json (and tokenizer_config.json with the chat template)."
      )
  elif _HUB_ID.match(tok):
    p.add(_hub_message(key, tok))
  else:
    p.add(
      f"{key}={tok!r} does not exist; give a directory (local or gs://) holding tokenizer.json, or '' for the "
      "model's own."
    )
