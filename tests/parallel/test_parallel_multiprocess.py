"""Two JAX processes (4 fake CPU devices each, gloo collectives) load one checkpoint sharded over an 8-device
mesh: each process fills only its own shards, and the sharded forward equals the single-process one."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from aepo_jax import testing

_WORKER = textwrap.dedent("""
    import json, sys
    import numpy as np
    import jax
    jax.config.update("jax_default_matmul_precision", "highest")
    from jax.sharding import NamedSharding, PartitionSpec as P
    from aepo_jax import model, parallel

    port, pid, path, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    assert parallel.initialize_distributed(f"127.0.0.1:{port}", 2, pid) == (pid, 2)
    assert len(jax.devices()) == 8 and len(jax.local_devices()) == 4
    mesh = parallel.make_mesh(dict(fsdp=2, tensor=4))
    config, params = model.load_hf(path, mesh=mesh)
    _, local = model.load_hf(path)  # unsharded, on this process only
    checked = 0
    for x, ref in zip(jax.tree.leaves(params), jax.tree.leaves(local)):
      assert not x.is_fully_addressable
      for shard in x.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(ref)[shard.index])
        checked += 1
    tokens = np.arange(64, dtype=np.int32).reshape(4, 16) % config.vocab_size
    replicated = NamedSharding(mesh, P())
    x = jax.make_array_from_callback(tokens.shape, replicated, lambda idx: tokens[idx])
    logits = jax.jit(lambda p, t: model.forward(config, p, t), out_shardings=replicated)(params, x)
    np.save(out, np.asarray(logits.addressable_shards[0].data))
    print(json.dumps({"shards_checked": checked}))
""")


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_process_sharded_load_and_forward(tmp_path):
  import jax
  from aepo_jax import model

  path = testing.tiny_hf_checkpoint("llama_rope", tmp_path / "ckpt")
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
  port = _free_port()
  procs = [
    subprocess.Popen(
      [sys.executable, "-c", _WORKER, str(port), str(i), path, str(tmp_path / f"out{i}.npy")],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(2)
  ]
  try:
    results = [p.communicate(timeout=300) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, (out, err) in zip(procs, results):
    assert p.returncode == 0, err[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["shards_checked"] > 0
  config, params = model.load_hf(path)
  tokens = np.arange(64, dtype=np.int32).reshape(4, 16) % config.vocab_size
  expected = np.asarray(jax.jit(lambda p, t: model.forward(config, p, t))(params, tokens))
  for i in range(2):
    assert np.abs(np.load(tmp_path / f"out{i}.npy") - expected).max() <= 1e-5
