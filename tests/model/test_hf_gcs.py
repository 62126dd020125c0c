"""A gs:// Hugging Face directory is read in place (`load_hf`: each shard's header, then one ranged read per tensor):
the same parameters as the local directory, on a mesh too, with no local copy of the weights; damaged shards are
named. Runs against `gcp-storage-emulator` on loopback (docs/environment.md)."""

import contextlib
import json
import os
import sys
import tempfile

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from aepo_jax import model, testing
from aepo_jax.model import _hf_io
from aepo_jax.parallel import make_mesh

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train"))
from test_checkpoint_gcs import BUCKET, gcs_emulator  # noqa: E402,F401  (the emulator fixture)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """{dtype: local dir}: a tiny Qwen2 (q/k/v biases) saved by transformers in float32 and bfloat16, each in several
  safetensors shards with an index, and a tokenizer beside the weights."""
  import torch

  out = {}
  for dtype, torch_dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
    path = str(tmp_path_factory.mktemp(f"hf_{dtype}"))
    testing.tiny_hf_model("qwen2", seed=3).to(torch_dtype).save_pretrained(path, max_shard_size="100KB")
    testing.tiny_tokenizer(path)
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) >= 2
    out[dtype] = path
  return out


def _upload(local: str, remote: str, damage=None) -> str:
  """Copies `local`'s files to `remote`; `damage(name, bytes) -> bytes` may change a file on the way."""
  from etils import epath

  for name in sorted(os.listdir(local)):
    with open(os.path.join(local, name), "rb") as f:
      data = f.read()
    (epath.Path(remote) / name).write_bytes(damage(name, data) if damage else data)
  return remote


def _shards(path: str) -> list:
  return sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))


def _assert_identical(a, b):
  flat_a, flat_b = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
  assert [p for p, _ in flat_a] == [p for p, _ in flat_b]
  for (path, x), (_, y) in zip(flat_a, flat_b):
    assert x.dtype == y.dtype, path
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))


@contextlib.contextmanager
def _no_local_copies(monkeypatch):
  """Fails any temporary file or directory made inside, and records the byte ranges read from the bucket."""

  def refuse(*args, **kwargs):
    raise AssertionError("load_hf made a local temporary file or directory for a gs:// checkpoint")

  for name in ("mkdtemp", "mkstemp", "NamedTemporaryFile", "TemporaryDirectory", "TemporaryFile"):
    monkeypatch.setattr(tempfile, name, refuse)
  reads, real = [], _hf_io.RemoteSafetensors._read

  def read(self, start, end):
    reads.append((os.path.basename(self.fname), start, end))
    return real(self, start, end)

  monkeypatch.setattr(_hf_io.RemoteSafetensors, "_read", read)
  yield reads
  monkeypatch.undo()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gs_directory_loads_the_same_parameters_without_a_local_copy(gcs_emulator, checkpoints, monkeypatch, dtype):
  local = checkpoints[dtype]
  remote = _upload(local, f"gs://{BUCKET}/hf-{dtype}")
  want_cfg, want = model.load_hf(local, dtype=dtype)
  with _no_local_copies(monkeypatch) as reads:
    cfg, params = model.load_hf(remote, dtype=dtype)
  assert cfg == want_cfg
  _assert_identical(params, want)
  # Every tensor by its own ranged read: none larger than the largest stored tensor, each shard read but never whole.
  largest = max(t.nbytes for shard in _shards(local) for t in load_file(os.path.join(local, shard)).values())
  assert max(end - start for _, start, end in reads) <= largest
  for shard in _shards(local):
    size = os.path.getsize(os.path.join(local, shard))
    assert any(name == shard for name, _, _ in reads)
    assert all(end - start < size for name, start, end in reads if name == shard)


def test_gs_directory_lands_on_the_mesh_as_the_local_one(gcs_emulator, checkpoints, monkeypatch):
  local = checkpoints["bfloat16"]
  remote = _upload(local, f"gs://{BUCKET}/hf-mesh")
  mesh = make_mesh((2, 2, 2))  # data, fsdp, tensor over the 8 fake CPU devices
  _, want = model.load_hf(local, mesh=mesh)
  with _no_local_copies(monkeypatch):
    _, params = model.load_hf(remote, mesh=mesh)
  for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
    assert x.sharding == y.sharding
  assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(params))
  _assert_identical(jax.device_get(params), jax.device_get(want))
  _assert_identical(jax.device_get(params), model.load_hf(local)[1])  # and the unsharded load


def _truncate(shard):
  return lambda name, data: data[: len(data) // 2] if name == shard else data


def _garbage(shard):
  return lambda name, data: b"\x00garbage" * 64 if name == shard else data


def _huge_header(shard):
  return lambda name, data: (1 << 40).to_bytes(8, "little") + data[8:] if name == shard else data


@pytest.mark.parametrize(
  "damage,message",
  [
    (_truncate, r"not a readable safetensors file \(truncated"),
    (_garbage, r"not a readable safetensors file \(header length"),
    (_huge_header, r"not a readable safetensors file \(header length"),
  ],
  ids=["truncated", "garbage", "header_length"],
)
def test_damaged_remote_shard_names_the_file(gcs_emulator, checkpoints, damage, message):
  local = checkpoints["float32"]
  shard = _shards(local)[-1]
  remote = _upload(local, f"gs://{BUCKET}/damaged-{damage.__name__}", damage(shard))
  with pytest.raises(ValueError, match=f"{remote}/{shard} is {message}"):
    model.load_hf(remote)


def test_missing_tensor_and_shape_mismatch_name_the_tensor(gcs_emulator, checkpoints):
  local = checkpoints["float32"]
  name = "model.layers.1.self_attn.k_proj.bias"

  def drop(fname, data):  # the index still lists the tensor; the shard's header no longer does
    if fname != "model.safetensors.index.json":
      return data
    index = json.loads(data)
    index["weight_map"].pop(name)
    return json.dumps(index).encode()

  remote = _upload(local, f"gs://{BUCKET}/partial", drop)
  with pytest.raises(KeyError, match=rf"{name}.*missing from the checkpoint \({remote}/model\.safetensors\.index"):
    model.load_hf(remote)

  def drop_from_shard(fname, data):  # the index lists it in this shard; its header does not
    if fname != index_of[name]:
      return data
    from safetensors.numpy import load, save

    tensors = load(data)
    del tensors[name]
    return save(tensors, metadata={"format": "pt"})

  with open(os.path.join(local, "model.safetensors.index.json")) as f:
    index_of = json.load(f)["weight_map"]
  remote = _upload(local, f"gs://{BUCKET}/partial-shard", drop_from_shard)
  with pytest.raises(KeyError, match=rf"{name}.*missing from {remote}/{index_of[name]}"):
    model.load_hf(remote)

  def narrower(fname, data):
    if fname != "config.json":
      return data
    return json.dumps({**json.loads(data), "intermediate_size": 96}).encode()

  remote = _upload(local, f"gs://{BUCKET}/mismatch", narrower)
  with pytest.raises(
    ValueError, match=r"down_proj\.weight.* has shape \[64, 128\] but config\.json implies \[64, 96\]"
  ):
    model.load_hf(remote)


def test_missing_gs_directory(gcs_emulator):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    model.load_hf(f"gs://{BUCKET}/nothing-here")


def _spy_local_copies(monkeypatch, module, name) -> list:
  """The listing of every local temporary copy `module.name` (a context manager yielding a local directory) makes."""
  copied, real = [], getattr(module, name)

  @contextlib.contextmanager
  def spy(path):
    with real(path) as tmp:
      copied.append(sorted(os.listdir(tmp)))
      yield tmp

  monkeypatch.setattr(module, name, spy)
  return copied


def test_load_model_reads_a_gs_directory_in_place(gcs_emulator, checkpoints, monkeypatch):
  """model.init='pretrained' with a gs:// model.name: the weights go straight to load_hf on the mesh; only the
  tokenizer files are copied to a local temporary directory."""
  from aepo_jax import train
  from aepo_jax.train import _inputs

  local = checkpoints["float32"]
  remote = _upload(local, f"gs://{BUCKET}/train-model")
  config = train.base_config()
  config.model.init, config.model.name, config.model.tokenizer = "pretrained", remote, ""
  copied = _spy_local_copies(monkeypatch, _inputs, "_local_files")
  mesh = make_mesh((2, 2, 2))
  cfg, params, tok = _inputs.load_model(config, mesh)
  assert tok is not None and tok.vocab_size == model.Tokenizer.from_dir(local).vocab_size
  assert len(copied) == 1 and "tokenizer.json" in copied[0]
  assert not [f for f in copied[0] if f.endswith(".safetensors")]  # no weights on local disk
  want_cfg, want = model.load_hf(local, dtype=config.model.param_dtype)
  assert cfg == want_cfg.replace(dtype=config.model.dtype, remat=config.model.remat)
  _assert_identical(jax.device_get(params), want)


def test_load_policy_reads_a_gs_directory_in_place(gcs_emulator, checkpoints, monkeypatch):
  """Evaluation's loader (`checkpoint.load_policy` of a gs:// HF directory): the weights are read in place, only the
  tokenizer and config files are copied to a local temporary directory."""
  from aepo_jax import checkpoint
  from aepo_jax.checkpoint import _loading

  local = checkpoints["float32"]
  remote = _upload(local, f"gs://{BUCKET}/eval-model")
  copied = _spy_local_copies(monkeypatch, _loading, "_local_dir")
  policy = checkpoint.load_policy(remote)
  assert copied and all("tokenizer.json" in c for c in copied)
  assert not [f for c in copied for f in c if f.endswith(".safetensors")]  # no weights on local disk
  _assert_identical(jax.device_get(policy.params), model.load_hf(local)[1])


# ---------------------------------------------------------------------------------------------------- rows per host
@pytest.mark.parametrize(
  "kind,shape,blocks,want",
  [
    ("same", (8, 4), [(0, 4, 6)], ((4, 6), (2, 4), (4, 0))),  # embedding [V, D]: rows are vocab rows
    ("in_heads", (4, 4, 2), [(1, 2, 3), (1, 3, 4)], ((4, 8), (4, 2, 2), (0, 2, 0))),  # heads 2:4 of [N*hd, D]
    ("transpose", (2, 2, 6), [(2, 2, 4), (2, 4, 6)], ((2, 6), (2, 2, 4), (0, 0, 2))),  # o_proj: D rows of [D, H*hd]
    ("transpose", (4, 6), [(0, 0, 2)], None),  # split along `in`: HF columns, so the whole tensor
    ("reshape", (4, 2), [(0, 1, 3)], ((2, 6), (2, 2), (1, 0))),  # bias [N*hd] -> [N, hd]
    ("in_heads", (4, 4, 2), [(2, 0, 1)], None),  # head_dim split: not a block of rows
    ("same", (8, 4), [(0, 0, 8)], None),  # every row
  ],
)
def test_host_rows_read_only_the_block_of_rows_a_host_needs(kind, shape, blocks, want):
  """`_host_rows` picks the HF rows covering this host's shards; converting just those rows gives exactly the
  shards' values of the whole converted tensor (what `_place` fills with them)."""
  full_shape = (3,) + shape  # a stacked layer leaf
  indices = []
  for axis, lo, hi in blocks:
    index = [slice(None)] * len(full_shape)
    index[1 + axis] = slice(lo, hi)
    indices.append(tuple(index))
  got = _hf_io._host_rows(kind, shape, full_shape, indices)
  assert got == want
  if want is None:
    return
  (r0, r1), part, origin = got
  hf = np.random.default_rng(0).standard_normal(_hf_io._hf_shape(kind, shape)).astype(np.float32)
  block = _hf_io._to_ours(hf[r0:r1], kind, part)
  whole = _hf_io._to_ours(hf, kind, shape)
  np.testing.assert_array_equal(block, whole[tuple(slice(o, o + n) for o, n in zip(origin, part))])


def test_remote_rows_are_the_local_rows(gcs_emulator, checkpoints):
  from safetensors import safe_open

  local = checkpoints["bfloat16"]
  shard = _shards(local)[0]
  remote = _upload(local, f"gs://{BUCKET}/rows")
  with safe_open(os.path.join(local, shard), framework="numpy") as f, _hf_io._open(f"{remote}/{shard}") as g:
    assert sorted(g.keys()) == sorted(f.keys())
    for name in f.keys():
      want = f.get_tensor(name)
      assert g.shape(name) == want.shape
      np.testing.assert_array_equal(g.get_tensor(name), want)
      np.testing.assert_array_equal(g.get_tensor(name, (1, 3)), want[1:3])


_WORKER = """
import json, os, sys
import numpy as np
import jax
from aepo_jax import model, parallel
from aepo_jax.model import _hf_io

port, pid, remote, local = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
assert parallel.initialize_distributed(f"127.0.0.1:{port}", 2, pid) == (pid, 2)
read, real = [0], _hf_io.RemoteSafetensors._read
def counted(self, start, end):
  read[0] += end - start
  return real(self, start, end)
_hf_io.RemoteSafetensors._read = counted
_, params = model.load_hf(remote, mesh=parallel.make_mesh(dict(fsdp=2, tensor=4)))  # fsdp spans the processes
_, want = model.load_hf(local)
for x, ref in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
  for shard in x.addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(ref)[shard.index])
print(json.dumps({"bytes_read": read[0]}))
"""


@pytest.mark.slow
def test_two_hosts_each_read_only_their_rows_from_the_bucket(gcs_emulator, checkpoints, tmp_path):
  """Two JAX processes (4 fake CPU devices each) load one gs:// checkpoint onto a mesh whose fsdp axis spans them:
  each holds the right shards and reads less than the whole checkpoint from the bucket."""
  from aepo_jax.testing import free_port, run_processes

  local = checkpoints["float32"]
  remote = _upload(local, f"gs://{BUCKET}/two-hosts")
  port = free_port()
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
  cmds = [[sys.executable, "-c", _WORKER, str(port), str(i), remote, local] for i in range(2)]
  results = run_processes(cmds, env=env, timeout=300, merge_stderr=False)
  tensors = {k: t for shard in _shards(local) for k, t in load_file(os.path.join(local, shard)).items()}
  data = sum(t.nbytes for t in tensors.values())
  # o_proj [D, H*hd] and down_proj [D, F] have their fsdp axis (D) along HF rows: each process reads half of them.
  split = sum(t.nbytes for k, t in tensors.items() if k.endswith(("o_proj.weight", "down_proj.weight")))
  for _, out, _ in results:
    read = json.loads(out.strip().splitlines()[-1])["bytes_read"]  # tensor bytes plus the shards' headers
    assert read < data - 0.4 * split, (read, data, split)
