"""Prompt lookup: what followed the latest earlier occurrence of the last committed n-gram. Its
proposal (`lookup`) is the pld method's chain (drafting.pld), a proposer of d2sd_tree's pool and
d2sd_pld's extra branch (`lookup_scores`: each node scored by its depth and the match length),
and what an adaptive cycle verifies alone (`lookup_tree`, adaptive.lookup_wins)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from d2sd_jax.spec_decode import tree as tree_lib


def lookup(settings, state):
  """Prompt lookup's proposal: (tokens [B, G-1], valid [B, G-1], matched n-gram length [B],
  0 where nothing matched)."""
  B, L = state.seq_BxL.shape
  N = settings.gamma - 1
  seq, seq_len = state.seq_BxL, state.seq_len_B
  pos = jnp.arange(L)
  best_start = jnp.full((B,), -1, jnp.int32)  # where the proposal starts in seq
  matched_B = jnp.zeros((B,), jnp.int32)
  for n in range(1, settings.ngram_max + 1):  # longer n overrides shorter ones
    tail = jnp.stack([jnp.take_along_axis(seq, (seq_len - n + k)[:, None], 1)[:, 0]
                      for k in range(n)], 1)  # [B, n]
    ok = jnp.ones((B, L), bool)
    for k in range(n):
      ok &= jnp.roll(seq, -k, axis=1) == tail[:, k:k + 1]  # seq[j + k] == tail[k]
    # The match must end before the tail starts (a following token exists).
    ok &= (pos[None] + n <= (seq_len - 1)[:, None]) & (seq_len[:, None] > n)
    # Among matches, the latest one whose continuation is longest (up to gamma-1 tokens): the
    # very latest match of a repetition often has almost nothing after it yet.
    follow = jnp.clip(seq_len[:, None] - (pos[None] + n), 0, N)
    score = jnp.where(ok, follow * L + pos[None], -1)
    found = jnp.max(score, axis=1) >= 0
    best_start = jnp.where(found, jnp.argmax(score, axis=1) + n, best_start)
    matched_B = jnp.where(found, n, matched_B)
  idx = best_start[:, None] + jnp.arange(N)[None]
  draft = jnp.take_along_axis(seq, jnp.clip(idx, 0, L - 1), 1)
  valid = (best_start[:, None] >= 0) & (idx < seq_len[:, None])
  return draft, valid, matched_B


def lookup_scores(settings, state):
  """Prompt lookup's proposal with its nodes' log estimated probabilities of being reached and
  accepted, d * log a at depth d, a = settings.lookup_accept[n - 1] after a match of n tokens
  (-inf where nothing was proposed): (tokens [B, G-1], valid [B, G-1], scores [B, G-1])."""
  draft, valid, matched_B = lookup(settings, state)
  accept = jnp.asarray(settings.lookup_accept, jnp.float32)
  log_a_B = jnp.log(accept[jnp.clip(matched_B - 1, 0, len(settings.lookup_accept) - 1)])
  depth_N = jnp.arange(1, settings.gamma, dtype=jnp.int32)
  score = jnp.where(valid & (matched_B[:, None] > 0), depth_N[None] * log_a_B[:, None], -jnp.inf)
  return draft, valid, score


def lookup_tree(settings, state) -> tree_lib.Tree:
  """Prompt lookup's proposal alone, as a best-first tree of gamma nodes: its nodes scored as in
  d2sd_tree's pool (`lookup_scores` through lookup's reliability curve, never rising along the
  chain) and sourced 'lookup'. What an adaptive cycle verifies when the lookup's expected
  tokens per second beat the drafted tree's (adaptive.lookup_wins)."""
  draft, valid, score = lookup_scores(settings, state)
  B, N = score.shape
  depth = jnp.broadcast_to(jnp.arange(1, N + 1, dtype=jnp.int32), (B, N))
  source = jnp.full((B, N), tree_lib.SOURCES.index('lookup'), jnp.int32)
  score = jax.lax.cummin(tree_lib.calibrate(score, source, depth, settings.node_calibration),
                         axis=1)
  tree = tree_lib.chain(state.anchor_B, draft, valid)
  score = jnp.where(tree.valid_BxT[:, 1:], score, -jnp.inf)
  return tree.replace(
      score_BxT=jnp.concatenate([jnp.zeros((B, 1), jnp.float32), score], 1),
      source_BxT=jnp.concatenate([jnp.full((B, 1), -1, jnp.int32), source], 1))
