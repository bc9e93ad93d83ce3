"""Throughput model: tokens per second of a decoding configuration, from the tokens a cycle is
expected to commit and the cost model's cycle time (d2sd_jax/perf/costmodel.py).

  tokens/s = B · E[τ] / t_cycle,  t_cycle = t_draft + t_verify(T nodes) + t_accept(T nodes);
  AR: E[τ] = 1, t_cycle = one AR step.

Expected tokens per cycle (bonus included), from the conditional acceptance of the k-th draft
a_k = P(draft k accepted | drafts 1..k-1 accepted):
  a chain of G-1 drafts:      E[τ] = 1 + Σ_{k=1}^{G-1} Π_{j<=k} a_j
  from a measured histogram   h[n] = cycles that accepted n drafts:
                              E[τ] = 1 + Σ_n n·h[n] / Σ_n h[n],  a_k = Σ_{n>=k} h / Σ_{n>=k-1} h
  from drafter 1's calibrated confidences c_k (the r(i) model D²SD's branch points use):
                              a_k ≈ c_k
  D²SD's branches: the chain stops after exactly i drafts with r(i) = c_1⋯c_i (1 - c_{i+1});
  a branch at cut i re-drafts from there, its first token accepted with b_1 (given the chain's
  was rejected) and its later ones with b_2.. :
                              E[τ] = E[τ_chain] + Σ_{i in cuts} r(i) · Σ_m Π_{j<=m} b_j

The two knobs of "speculative diffusion" (paper 2), seeded from the single-draft rules:
  leniency λ with point-mass drafts accepts x with λ + (1-λ) p(x), so   a_k(λ) = λ + (1-λ) a_k;
  diffusion effort s (denoising passes) costs s drafter passes and moves each a_k toward 1 by a
  per-drafter gain ρ per extra pass:      a_k(s) = 1 - (1 - a_k) · ρ^(s-1)   (ρ = 1: no gain,
  which is what drafters trained only on fully masked blocks measured).
"""
from __future__ import annotations

import numpy as np


def chain_tau(accept_k) -> float:
  """E[τ] of a chain whose k-th draft is accepted with conditional probability a_k."""
  a = np.clip(np.asarray(accept_k, np.float64), 0.0, 1.0)
  return 1.0 + float(np.sum(np.cumprod(a)))


def tau_from_histogram(hist) -> float:
  """E[τ] = 1 + mean accepted drafts per cycle (hist[n]: cycles that accepted n drafts)."""
  h = np.asarray(hist, np.float64)
  if h.sum() <= 0:
    raise ValueError('an empty acceptance histogram: decode at least one cycle first')
  return 1.0 + float(np.dot(np.arange(len(h)), h) / h.sum())


def acceptance_from_histogram(hist) -> np.ndarray:
  """a_k = P(accepted >= k) / P(accepted >= k-1), k = 1 .. len(hist)-1 (nan where unseen)."""
  h = np.asarray(hist, np.float64)
  at_least = np.cumsum(h[::-1])[::-1]  # at_least[n] = cycles accepting >= n drafts
  with np.errstate(invalid='ignore', divide='ignore'):
    return at_least[1:] / at_least[:-1]


def branched_tau(conf_k, cuts, branch_accept_k) -> float:
  """E[τ] of D²SD's tree: drafter 1's chain (a_k ≈ c_k) plus a branch at each cut i whose
  drafts are accepted with conditional probabilities branch_accept_k (module docstring)."""
  c = np.clip(np.asarray(conf_k, np.float64), 0.0, 1.0)
  prefix = np.concatenate([[1.0], np.cumprod(c)])  # P(first i drafts accepted), i = 0..G-1
  tau = chain_tau(c)
  b = np.cumprod(np.clip(np.asarray(branch_accept_k, np.float64), 0.0, 1.0))
  for i in cuts:
    if i < len(c):
      r = prefix[i] * (1.0 - c[i])
      tau += r * float(np.sum(b[:len(c) - i]))
  return tau


def lenient(accept_k, leniency: float) -> np.ndarray:
  return leniency + (1.0 - leniency) * np.asarray(accept_k, np.float64)


def with_effort(accept_k, steps: int, gain: float = 1.0) -> np.ndarray:
  return 1.0 - (1.0 - np.asarray(accept_k, np.float64)) * gain ** (steps - 1)


def tokens_per_s(tau: float, cycle_s: float, batch: int = 1) -> float:
  return batch * tau / cycle_s
