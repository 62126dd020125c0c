r"""Export a training checkpoint's parameters to a Hugging Face directory (config.json + safetensors).

  python launch/export_hf.py --checkpoint=/tmp/aepo_cpu/checkpoints/rl/6 --output=/tmp/aepo_cpu/hf
  python launch/export_hf.py --checkpoint=gs://BUCKET/run/checkpoints/rl --output=/tmp/hf   # latest step

The model comes from the config saved in the checkpoint, so no config flag is needed. The tokenizer of a
pretrained model is copied along when the model directory holds one.
"""
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

_CKPT = flags.DEFINE_string("checkpoint", None, "A checkpoint step dir (.../checkpoints/rl/6) or a phase dir "
                            "(.../checkpoints/rl: the latest step).")
_OUT = flags.DEFINE_string("output", None, "Local output directory.")
_DTYPE = flags.DEFINE_string("dtype", None, "Stored dtype (default: the parameters' dtype), e.g. bfloat16.")


def export(checkpoint: str, output: str, dtype=None) -> str:
  import jax
  from etils import epath

  from aepo_jax import model as model_lib
  from aepo_jax.train import _checkpoint, _config

  path = epath.Path(checkpoint)
  step = None
  if path.name.isdigit():
    path, step = path.parent, int(path.name)
  ckpt = _checkpoint.Checkpointer(str(path))
  step = ckpt.latest_step() if step is None else step
  if step is None:
    raise SystemExit(f"error: no committed checkpoint in {checkpoint!r}.")
  meta = ckpt.restore_meta(step)
  if "model_config" not in meta:
    raise SystemExit(f"error: checkpoint {path}/{step} holds no model_config; was it written by aepo_jax.train?")
  model_cfg = _checkpoint.model_config_from_json(meta["model_config"])
  shapes = jax.eval_shape(lambda: model_lib.init_params(model_cfg, jax.random.PRNGKey(0)))
  params = ckpt.restore_params(step, shapes)
  model_lib.save_hf(model_cfg, jax.device_get(params), output, dtype=dtype)
  _copy_tokenizer(_config.from_json(meta["config"]), output)
  ckpt.close()
  return output


def _copy_tokenizer(config, output):
  """A local HF model directory's tokenizer files go along, so the export loads with AutoTokenizer."""
  src = config.model.tokenizer or config.model.name
  if not os.path.isdir(src):
    return
  import shutil
  for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"):
    if os.path.exists(os.path.join(src, name)):
      shutil.copy(os.path.join(src, name), output)


def main(argv):
  del argv
  if not _CKPT.value or not _OUT.value:
    raise app.UsageError("--checkpoint and --output are required")
  print(export(_CKPT.value, _OUT.value, _DTYPE.value))


if __name__ == "__main__":
  app.run(main)
