"""Sampling transforms shared by autoregressive decoding and speculative verification.

The target's distribution p is always `softmax(process_logits(logits, settings))`: the same
temperature, top-k and top-p are applied in AR and in verification, so a speculative sampler
can be exactly as lossless as the AR one it replaces.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
  temperature: float = 0.0  # 0 = greedy
  top_k: int = 0  # 0 = off
  top_p: float = 1.0  # 1 = off

  def __post_init__(self):
    if not self.temperature >= 0:
      raise ValueError(f'temperature={self.temperature} must be >= 0 (0 = greedy)')
    if self.top_k < 0:
      raise ValueError(f'top_k={self.top_k} must be >= 0 (0 = no top-k filter)')
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f'top_p={self.top_p} must be in (0, 1] (1 = no nucleus filter)')

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


def process_logits(logits_Nx: jax.Array, settings: SamplingSettings) -> jax.Array:
  """Temperature, then top-k, then top-p; removed tokens get -inf. Works on [..., V]."""
  logits_Nx = logits_Nx.astype(jnp.float32)
  if settings.greedy:
    return logits_Nx
  logits_Nx = logits_Nx / settings.temperature
  V = logits_Nx.shape[-1]
  if 0 < settings.top_k < V:
    kth = jax.lax.top_k(logits_Nx, settings.top_k)[0][..., -1:]
    logits_Nx = jnp.where(logits_Nx < kth, NEG_INF, logits_Nx)
  if settings.top_p < 1.0:
    sorted_desc = jnp.sort(logits_Nx, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    # Keep the smallest set whose mass reaches top_p: a token stays if the mass before it < top_p.
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = mass_before < settings.top_p
    threshold = jnp.min(jnp.where(keep_sorted, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    logits_Nx = jnp.where(logits_Nx < threshold, NEG_INF, logits_Nx)
  return logits_Nx


def probs(logits_Nx: jax.Array, settings: SamplingSettings) -> jax.Array:
  """The distribution a sampler with these settings draws from (one-hot argmax when greedy)."""
  if settings.greedy:
    return jax.nn.one_hot(jnp.argmax(logits_Nx, axis=-1), logits_Nx.shape[-1], dtype=jnp.float32)
  return jax.nn.softmax(process_logits(logits_Nx, settings), axis=-1)


def sample(rng: jax.Array, logits_Nx: jax.Array, settings: SamplingSettings) -> jax.Array:
  """One token per row: argmax when greedy, else a draw from `probs`."""
  if settings.greedy:
    return jnp.argmax(logits_Nx, axis=-1).astype(jnp.int32)
  return jax.random.categorical(rng, process_logits(logits_Nx, settings), axis=-1).astype(jnp.int32)
