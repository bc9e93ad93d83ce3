"""What an adaptive best-first tree chooses every cycle, inside the one decode program
(SpecSettings.adaptive; speculative.spec_step runs the choice with lax.switch / lax.cond):

  choice        how many of the drafted tree's best-first nodes to verify: the shape of
                SpecSettings.node_costs with the most expected tokens per second;
  lookup_wins   before drafting (SpecSettings.lookup_cycles), whether to verify prompt
                lookup's proposal alone instead, against the rate the drafted cycles have been
                giving (running_rate).

A batch shares one shape, chosen for its live rows' expected tokens together.
"""
from __future__ import annotations

import jax.numpy as jnp

from d2sd_jax.spec_decode import tree as tree_lib


def choice(settings, state, tree: tree_lib.Tree):
  """The index into settings.node_costs of the shape an adaptive cycle verifies: the most
  expected tokens per second, (live rows + their trees' expected drafts at n nodes) / cost(n).
  The tree is best first, so its first n nodes are its best tree of n, and their expected
  drafts are a prefix sum of its scores. Also returns each row's expected tokens per second at
  the chosen shape ([B])."""
  live_B = ~state.done_B
  reach_BxT = jnp.cumsum(jnp.exp(tree.score_BxT[:, 1:]), axis=1)  # [:, n-2]: n nodes
  sizes = jnp.asarray([n for n, _ in settings.node_costs])
  costs = jnp.asarray([c for _, c in settings.node_costs], jnp.float32)
  rate_BxS = (1.0 + reach_BxT[:, sizes - 2]) / costs
  best = jnp.argmax(jnp.sum(jnp.where(live_B[:, None], rate_BxS, 0.0), axis=0))
  return best.astype(jnp.int32), rate_BxS[:, best]


RATE_MEMORY = 0.25  # weight of the newest drafted cycle in SpecState.tree_rate_B


def running_rate(old_B, rate_B):
  """SpecState.tree_rate_B after a cycle whose drafted rate was rate_B (a lookup-only cycle
  passes the old rate, which it leaves as it was): the first drafted cycle's rate, then each
  new one weighing RATE_MEMORY."""
  return jnp.where(jnp.isinf(old_B), rate_B, old_B + RATE_MEMORY * (rate_B - old_B))


def lookup_wins(settings, state, lookup: tree_lib.Tree):
  """Whether this cycle verifies prompt lookup's proposal alone (a scalar: the batch shares the
  shape): the live rows' expected tokens per second from it, (1 + its expected drafts) /
  lookup_cost, summed, against a drafted tree's. Those are not known before drafting, so each
  row's is estimated as the larger of the rate its drafted cycles have been giving
  (tree_rate_B; inf before the first, which is therefore drafted) and the lookup's own expected
  tokens at the cost of the smallest shape that holds its gamma nodes: a drafted tree's pool
  holds the lookup's proposal too."""
  live_B = ~state.done_B
  lookup_B = 1.0 + tree_lib.expected_drafts(lookup)
  held = [c for n, c in settings.node_costs if n >= settings.gamma]
  holding_cost = min(held) if held else max(c for _, c in settings.node_costs)
  tree_B = jnp.maximum(state.tree_rate_B, lookup_B / holding_cost)
  gain = jnp.where(live_B, lookup_B / settings.lookup_cost - tree_B, 0.0)
  return jnp.sum(gain) > 0
