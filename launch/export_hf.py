r"""Export a training checkpoint to a Hugging Face directory that transformers and vLLM load as is.

  python launch/export_hf.py --checkpoint=/tmp/aepo_cpu --output=/tmp/aepo_cpu/hf           # workdir: latest RL step
  python launch/export_hf.py --checkpoint=/tmp/aepo_cpu/checkpoints/sft/50 --output=/tmp/sft50 --dtype=bfloat16
  python launch/export_hf.py --checkpoint=gs://BUCKET/run/checkpoints/rl --output=gs://BUCKET/export/rl

--checkpoint: a training workdir (its latest RL step, else SFT), a phase dir (.../checkpoints/rl: its latest step)
or a step dir (.../checkpoints/rl/6); local or gs://. The output (local or gs://) gets the weights (safetensors,
sharded with an index past --max_shard_mb), config.json, the tokenizer files and chat template of the tokenizer
the run used (model.tokenizer, else the model's own: a bundled name, a local or a gs:// directory), the base
model's generation_config.json (its sampling defaults kept), and `system_prompt.txt`: the system prompt the run
trained with (its data.template). The chat template adds no system prompt of its own, so a client of the exported
model (transformers, vLLM, launch/serve.py) sends that text as the system message, as training and
launch/evaluate.py do. The model comes from the checkpoint's own config.
"""

import os
import sys

from absl import app, flags

if not __package__:  # run as a script from a checkout (not as `python -m aepo_jax.launch.NAME`)
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CKPT = flags.DEFINE_string("checkpoint", None, "Training workdir, phase dir or step dir (local or gs://).")
_OUT = flags.DEFINE_string("output", None, "Output directory (local or gs://).")
_DTYPE = flags.DEFINE_enum(
  "dtype", None, ["float32", "bfloat16", "float16"], "Stored dtype; unset keeps the parameters' dtype."
)
_TOKENIZER = flags.DEFINE_string(
  "tokenizer", None, "Tokenizer to ship (a directory, local or gs://, or a bundled name); unset: the one the run used."
)
_MAX_SHARD_MB = flags.DEFINE_float("max_shard_mb", 2048.0, "Largest safetensors shard, in MiB.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Write into a non-empty --output (its old weights are removed).")


SYSTEM_PROMPT_FILE = "system_prompt.txt"


class ExportError(ValueError):
  """Bad export input; the message names the flag and the fix."""


def _tokenizer_dir(source: str) -> str:
  """A bundled name's converted directory; a local or gs:// directory as it is."""
  from aepo_jax import model as model_lib

  return model_lib.pretrained_dir(source) if source in model_lib.PRETRAINED else source


def _sources(config, tokenizer=None):
  """(tokenizer directory or None, base model directory or None) of the run that wrote the checkpoint."""
  from aepo_jax import model as model_lib

  mc = config.model
  base = None
  if mc.init == "pretrained":
    base = _tokenizer_dir(mc.name) if mc.name in model_lib.PRETRAINED else mc.name
  tok = tokenizer or mc.tokenizer or base
  return (_tokenizer_dir(tok) if tok else None), base


def _generation_config(base):
  """The base model's generation_config.json (sampling defaults included), or None."""
  import json

  from etils import epath

  if not base or not (epath.Path(base) / "generation_config.json").exists():
    return None
  return json.loads((epath.Path(base) / "generation_config.json").read_text())


def _prepare_output(output: str, overwrite: bool):
  from etils import epath

  out = epath.Path(output)
  if out.exists() and any(out.iterdir()):
    if not overwrite:
      raise ExportError(f"--output={output!r} is not empty; choose a new directory or pass --overwrite.")
    for f in out.iterdir():  # old shards would sit beside the new ones
      if f.name.endswith(".safetensors") or f.name.endswith(".safetensors.index.json"):
        f.unlink()


def export(
  checkpoint: str, output: str, *, dtype=None, tokenizer=None, max_shard_bytes: int = 2 << 30, overwrite: bool = False
) -> dict:
  """Writes the HF directory; returns {'output', 'checkpoint', 'step', 'tokenizer', 'generation_config'}."""
  import jax

  from aepo_jax import model as model_lib
  from aepo_jax.data import system_prompt
  from aepo_jax.eval import CheckpointNotFoundError, resolve_checkpoint
  from aepo_jax.checkpoint import Checkpointer, model_config_from_json
  from aepo_jax.train import from_json

  try:  # checks existence first: a typo never becomes a new directory
    ref = resolve_checkpoint(checkpoint)
  except CheckpointNotFoundError as e:
    raise ExportError(str(e).replace("--checkpoint ", "--checkpoint=")) from None
  if ref.kind != "orbax":
    raise ExportError(
      f"--checkpoint={checkpoint!r} is already a Hugging Face model ({ref.kind}); give a training "
      "workdir, .../checkpoints/rl or .../checkpoints/rl/<step>."
    )
  ckpt = Checkpointer(ref.directory, read_only=True)  # never cleans a writer's save
  try:
    step = ckpt.latest_step() if ref.step is None else ref.step
    if step is None:
      raise ExportError(f"no committed checkpoint in {ref.directory!r} (an interrupted save?).")
    meta = ckpt.restore_meta(step)
    if "model_config" not in meta or "config" not in meta:
      raise ExportError(
        f"checkpoint {ref.directory}/{step} holds no model_config/config in its meta; was it written by aepo_jax.train?"
      )
    model_cfg = model_config_from_json(meta["model_config"])
    run_config = from_json(meta["config"])
    tok_dir, base = _sources(run_config, tokenizer)
    from etils import epath

    if tok_dir and not (epath.Path(tok_dir) / "tokenizer.json").exists():
      raise ExportError(
        f"the run's tokenizer {tok_dir!r} has no tokenizer.json (moved or deleted?); pass "
        "--tokenizer=DIR (local or gs://) or a bundled name."
      )
    _prepare_output(output, overwrite)
    params = jax.device_get(ckpt.restore_params(step, model_lib.param_shapes(model_cfg)))
  finally:
    ckpt.close()
  generation = _generation_config(base)
  model_lib.save_hf(
    model_cfg, params, output, dtype=dtype, max_shard_bytes=max_shard_bytes, generation_config=generation
  )
  if tok_dir:
    model_lib.copy_tokenizer_files(tok_dir, output)
  template = str(run_config.data.template)
  (epath.Path(output) / SYSTEM_PROMPT_FILE).write_text(system_prompt(template))
  return {
    "output": output,
    "checkpoint": f"{ref.directory}/{step}",
    "step": step,
    "tokenizer": tok_dir,
    "generation_config": f"{base}/generation_config.json" if generation else None,
    "template": template,
  }


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}; flags are written --name=value.")
  if not _CKPT.value or not _OUT.value:
    raise app.UsageError("--checkpoint and --output are required.")
  try:
    info = export(
      _CKPT.value,
      _OUT.value,
      dtype=_DTYPE.value,
      tokenizer=_TOKENIZER.value,
      max_shard_bytes=int(_MAX_SHARD_MB.value * (1 << 20)),
      overwrite=_OVERWRITE.value,
    )
  except ExportError as e:
    sys.exit(f"error: {e}")
  print(f"exported {info['checkpoint']} to {info['output']}")
  print(
    f"system prompt: the run trained with template {info['template']!r}; send {info['output']}/{SYSTEM_PROMPT_FILE} "
    "as the system message (the chat template adds none)."
  )
  if not info["tokenizer"]:
    print(
      "warning: the run had no tokenizer (random init without model.tokenizer); AutoTokenizer will not load "
      "this directory until you export again with --tokenizer=DIR.",
      file=sys.stderr,
    )
  if not info["generation_config"]:
    print("note: no base model generation_config.json; wrote one with the token ids only.", file=sys.stderr)


if __name__ == "__main__":
  app.run(main)
