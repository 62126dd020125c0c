"""The command-line programs: from a checkout `python launch/NAME.py ...`; from an installed package (setup.py ships
this folder as `aepo_jax.launch`, and configs/ as `aepo_jax/configs`) `python -m aepo_jax.launch.NAME ...` from any
directory, e.g. `python -m aepo_jax.launch.tpu_pod --config=configs/cpu_default.py`.

tpu_pod (train: SFT and RL), compile (does the RL step fit a TPU slice?), evaluate, serve, export_hf, plot,
retrieval_server; each one's docstring gives its commands.
"""
