"""aepo_jax: AEPO, ARPO and RL baselines for tool-using LLM agents, in JAX/Flax.

Parts (one subpackage each): model, parallel, rollout, tools, rewards, objectives, data, train, eval.
Import the part you need, e.g. `from aepo_jax import model`; nothing heavy is imported here.
"""

__version__ = "0.1.0"
