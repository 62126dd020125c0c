"""NumPy transcriptions of the official code the objectives are checked against (float64).

verl `core_algos.py` / `torch_functional.py` (agg_loss, compute_policy_loss, GSPO, CISPO, the GRPO /
RLOO / REINFORCE++ estimators, kl_penalty, masked_whiten) and the AEPO fork's
`compute_policy_loss_entropy_balanced_clipping` (spec §2.2-2.3). Loops are kept as in the originals.
"""

from collections import defaultdict

import numpy as np


def masked_mean(x, m):
  return (x * m).sum() / m.sum()


def agg_loss(loss, m, mode):
  if mode == "token-mean":
    return (loss * m).sum() / (m.sum() + 1e-8)
  if mode == "seq-mean-token-sum":
    return np.mean((loss * m).sum(-1))
  if mode == "seq-mean-token-mean":
    return np.mean((loss * m).sum(-1) / m.sum(-1))
  if mode == "seq-mean-token-sum-norm":
    return (loss * m).sum() / m.shape[-1]
  raise ValueError(mode)


def ppo_dual_clip(old, new, adv, m, clip_low, clip_high, clip_c=3.0, mode="token-mean", entropy=None, entropy_coef=0.0):
  """verl compute_policy_loss with the AEPO fork's entropy-aware advantage (value only)."""
  if entropy is not None and entropy_coef:
    valid = entropy[m.astype(bool)]
    mean, std = valid.mean(), valid.std(ddof=1)
    if std == 0:
      std = 1.0
    adv = adv * (1 + entropy_coef * (entropy - mean) / std)
  neg_kl = new - old
  ratio = np.exp(neg_kl)
  l1 = -adv * ratio
  l2 = -adv * np.clip(ratio, 1 - clip_low, 1 + clip_high)
  c1 = np.maximum(l1, l2)
  out = {"pg_clipfrac": masked_mean((l2 > l1).astype(float), m), "ppo_kl": masked_mean(-neg_kl, m)}
  if clip_c is not None:
    l3 = -adv * clip_c
    c2 = np.minimum(l3, c1)
    out["dual_clipfrac"] = masked_mean(((c1 > l3) & (adv < 0)).astype(float), m)
    c1 = np.where(adv < 0, c2, c1)
  return agg_loss(c1, m, mode), out


def gspo(old, new, adv, m, clip_low, clip_high):
  neg_kl = new - old
  seq = (neg_kl * m).sum(-1) / np.maximum(m.sum(-1), 1)
  s = np.exp(np.minimum(seq[:, None] + 0 * new, 10.0))
  l1 = -adv * s
  l2 = -adv * np.clip(s, 1 - clip_low, 1 + clip_high)
  return agg_loss(np.maximum(l1, l2), m, "seq-mean-token-mean")


def cispo(old, new, adv, m, clip_low, clip_high, mode="token-mean"):
  ratio = np.exp(np.clip(new - old, -20, 20))
  return agg_loss(-np.clip(ratio, 1 - clip_low, 1 + clip_high) * adv * new, m, mode)


def grpo_outcome_advantage(scores, index, m, epsilon=1e-6, norm_adv_by_std_in_grpo=True):
  scores = np.array(scores, np.float64)
  id2score = defaultdict(list)
  id2mean, id2std = {}, {}
  for i in range(len(scores)):
    id2score[index[i]].append(scores[i])
  for idx, vals in id2score.items():
    if len(vals) == 1:
      id2mean[idx], id2std[idx] = 0.0, 1.0
    else:
      id2mean[idx], id2std[idx] = np.mean(vals), np.std(vals, ddof=1)  # torch.std: unbiased
  for i in range(len(scores)):
    if norm_adv_by_std_in_grpo:
      scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
    else:
      scores[i] = scores[i] - id2mean[index[i]]
  return scores[:, None] * m


def rloo_outcome_advantage(scores, index, m):
  scores = np.array(scores, np.float64)
  id2score = defaultdict(list)
  for i in range(len(scores)):
    id2score[index[i]].append(scores[i])
  id2mean = {k: (0.0 if len(v) == 1 else np.mean(v)) for k, v in id2score.items()}
  for i in range(len(scores)):
    n = len(id2score[index[i]])
    if n > 1:
      scores[i] = scores[i] * n / (n - 1) - id2mean[index[i]] * n / (n - 1)
  return scores[:, None] * m


def masked_whiten(values, m):
  mean = masked_mean(values, m)
  var = masked_mean((values - mean) ** 2, m)
  n = m.sum()
  var = var * n / (n - 1)
  return (values - mean) / np.sqrt(var + 1e-8)


def reinforce_pp(token_level_rewards, m, gamma):
  returns = np.zeros_like(token_level_rewards)
  running = np.zeros(token_level_rewards.shape[0])
  for t in reversed(range(token_level_rewards.shape[1])):
    running = token_level_rewards[:, t] + gamma * running
    returns[:, t] = running
    running = running * m[:, t]  # reset after EOS (and at every masked position)
  return masked_whiten(returns, m) * m


def reinforce_pp_baseline(scores, index, m):
  scores = np.array(scores, np.float64)
  id2score = defaultdict(list)
  for i in range(len(scores)):
    id2score[index[i]].append(scores[i])
  id2mean = {k: (0.0 if len(v) == 1 else np.mean(v)) for k, v in id2score.items()}
  for i in range(len(scores)):
    scores[i] -= id2mean[index[i]]
  tiled = np.tile(scores[:, None], (1, m.shape[1])) * m
  return masked_whiten(tiled, m) * m


def kl_penalty(logprob, ref_logprob, kind):
  if kind in ("kl", "k1"):
    return logprob - ref_logprob
  if kind == "abs":
    return np.abs(logprob - ref_logprob)
  if kind in ("mse", "k2"):
    return 0.5 * (logprob - ref_logprob) ** 2
  if kind in ("low_var_kl", "k3"):
    kl = np.clip(ref_logprob - logprob, -20, 20)
    return np.clip(np.exp(kl) - kl - 1, -10, 10)
  raise ValueError(kind)
