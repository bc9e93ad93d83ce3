"""Confidence calibration of a drafter (DESIGN §3): reliability bins, ECE, a fitted temperature.

D²SD picks its branch points from r(i) = c_1 ⋯ c_i (1 - c_{i+1}), so the confidences c_k must
mean what they say: P(draft k is the target's token | the earlier ones were). Here c is the
maximum of softmax(logits / T); the temperature T is fitted on held-out blocks to minimise the
expected calibration error and stored with the drafter (`DrafterConfig.confidence_temperature`).
Correctness is agreement with the target's own tokens at masked positions whose earlier block
positions are all correct, i.e. exactly the acceptance event of a chain.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from d2sd_jax.spec_decode.replay import lookup_proposal

TEMPERATURES = (0.5, 0.7, 0.85, 1.0, 1.2, 1.5, 2.0, 3.0)
N_BINS = 10


def bin_stats(logits_NxV, correct_N, weight_N, temperatures=TEMPERATURES, n_bins: int = N_BINS):
  """[len(T), 3, n_bins]: per temperature and confidence bin: count, sum of confidence, correct."""
  lmax = jnp.max(logits_NxV, -1, keepdims=True)
  out = []
  for t in temperatures:
    conf = 1.0 / jnp.sum(jnp.exp((logits_NxV - lmax) / t), -1)  # max of softmax(logits / t)
    b = jnp.clip((conf * n_bins).astype(jnp.int32), 0, n_bins - 1)
    onehot = jax.nn.one_hot(b, n_bins) * weight_N[:, None]
    out.append(jnp.stack([onehot.sum(0), (onehot * conf[:, None]).sum(0),
                          (onehot * correct_N[:, None]).sum(0)]))
  return jnp.stack(out)


def ece(stats_3xK) -> float:
  """Expected calibration error: sum over bins of (count / N) |accuracy - mean confidence|."""
  count, conf, correct = np.asarray(stats_3xK, np.float64)
  n = max(count.sum(), 1.0)
  ok = count > 0
  return float(np.sum(np.abs(correct[ok] - conf[ok])) / n)


def reliability(stats_3xK) -> list[dict]:
  """One row per non-empty bin: its range, count, mean confidence, accuracy."""
  count, conf, correct = np.asarray(stats_3xK, np.float64)
  K = len(count)
  return [{'bin': f'{i / K:.1f}-{(i + 1) / K:.1f}', 'count': int(count[i]),
           'confidence': round(conf[i] / count[i], 4), 'accuracy': round(correct[i] / count[i], 4)}
          for i in range(K) if count[i] > 0]


def fit_temperature(stats_Tx3xK, temperatures=TEMPERATURES) -> tuple[float, float, float]:
  """(best temperature, its ECE, the ECE at T = 1)."""
  eces = [ece(s) for s in np.asarray(stats_Tx3xK)]
  best = int(np.argmin(eces))
  return float(temperatures[best]), eces[best], eces[list(temperatures).index(1.0)]


def reliability_plot(curves: dict, path: str, title: str = '') -> str:
  """A reliability diagram (matplotlib, written to `path`): for each label -> bin stats [3, K],
  accuracy against mean confidence per non-empty bin, sized by count, with the diagonal and the
  ECE in the legend."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, ax = plt.subplots(figsize=(4.5, 4.5))
  ax.plot([0, 1], [0, 1], color='gray', lw=1, ls='--', label='perfect calibration')
  for label, stats in curves.items():
    rows = reliability(stats)
    conf = [r['confidence'] for r in rows]
    acc = [r['accuracy'] for r in rows]
    total = sum(r['count'] for r in rows)
    ax.plot(conf, acc, marker='o', label=f'{label} (ECE {ece(stats):.3f})')
    ax.scatter(conf, acc, s=[400 * r['count'] / total for r in rows], alpha=0.25)
  ax.set_xlabel('confidence c_k (max softmax)')
  ax.set_ylabel('P(draft k correct | drafts < k correct)')
  ax.set_xlim(0, 1)
  ax.set_ylim(0, 1)
  ax.set_title(title)
  ax.legend(loc='upper left', fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def lookup_accept_rates(sequences, prompt_lens, gamma: int, ngram_max: int, stride: int = 1):
  """Prompt lookup's per-token acceptance rate after a match of n = 1..ngram_max tokens, as
  d2sd_tree scores its nodes (settings.lookup_accept): greedy verification accepts a proposal's
  tokens while they equal the target's own continuation, so on the target's greedy responses
  (distillation records) each proposal's accepted length is its agreement with what followed.
  The rate is accepted / (accepted + proposals stopped by a mismatch), the maximum-likelihood
  per-token rate of a geometric run. Returns ([rate per n], [proposals per n])."""
  acc, stops = np.zeros(ngram_max), np.zeros(ngram_max)
  for seq, p in zip(sequences, prompt_lens):
    for t in range(max(p, 1), len(seq) - 1, stride):
      proposal, n = lookup_proposal(seq[:t], gamma, ngram_max)
      if not n:
        continue
      k = 0
      while k < len(proposal) and t + k < len(seq) and proposal[k] == seq[t + k]:
        k += 1
      acc[n - 1] += k
      stops[n - 1] += k < len(proposal) and t + k < len(seq)
  rates = [float(a / (a + s)) if a + s else float('nan') for a, s in zip(acc, stops)]
  return rates, stops.astype(int).tolist()
