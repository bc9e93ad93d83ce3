"""What an adaptive best-first tree chooses every cycle, inside the one decode program
(SpecSettings.adaptive; speculative.spec_step runs the choice with lax.switch / lax.cond):

  choice        how many of the drafted tree's best-first nodes to verify: the shape of
                SpecSettings.node_costs whose expected tokens gain most over what its cost in
                seconds would give at the rate the row's drafted cycles have been giving;
  running       that rate's running means (SpecState.drafted_Bx2, tree_rate_B);
  lookup_wins   before drafting (SpecSettings.lookup_cycles), whether to verify prompt
                lookup's proposal alone instead, against that rate.

A batch shares one shape, chosen for its live rows' expected tokens together.
"""
from __future__ import annotations

import jax.numpy as jnp

from d2sd_jax.spec_decode import tree as tree_lib


def choice(settings, state, tree: tree_lib.Tree):
  """The index into settings.node_costs of the shape an adaptive cycle verifies, each row's
  expected tokens at that shape ([B]) and the shape's cost (seconds, a scalar).

  A row's expected tokens at n nodes are 1 + its tree's expected drafts there; the tree is best
  first, so its first n nodes are its best tree of n, and their expected drafts are a prefix
  sum of its scores. Decoding is a renewal process: its tokens per second are E[tokens] /
  E[seconds] over cycles, and that is highest when every cycle maximises its gain
  tokens(n) - r * cost(n) at the best long-run rate r (Dinkelbach), not its own ratio
  tokens(n) / cost(n). A cycle's own ratio stops growing a sure tree at its own (high) rate
  and grows an unsure one up to its own (low) rate; the gain grows a tree while each extra
  node's tokens per second beat the rate the row has been getting (SpecState.tree_rate_B,
  which stands in for r). Before a row's first drafted cycle, r is this cycle's best ratio,
  at which the gain chooses what the ratio would. The batch's live rows' gains are summed."""
  live_B = ~state.done_B
  reach_BxT = jnp.cumsum(jnp.exp(tree.score_BxT[:, 1:]), axis=1)  # [:, n-2]: n nodes
  sizes = jnp.asarray([n for n, _ in settings.node_costs])
  costs = jnp.asarray([c for _, c in settings.node_costs], jnp.float32)
  tokens_BxS = 1.0 + reach_BxT[:, sizes - 2]
  own_B = jnp.max(tokens_BxS / costs, axis=1)
  r_B = jnp.where(jnp.isinf(state.tree_rate_B), own_B, state.tree_rate_B)
  gain_BxS = tokens_BxS - r_B[:, None] * costs
  best = jnp.argmax(jnp.sum(jnp.where(live_B[:, None], gain_BxS, 0.0), axis=0))
  return best.astype(jnp.int32), tokens_BxS[:, best], costs[best]


RATE_MEMORY = 0.25  # weight of the newest drafted cycle in SpecState.drafted_Bx2


def running(old_Bx2, tokens_B, seconds, live_B=None):
  """SpecState.drafted_Bx2 after a drafted cycle that expected tokens_B at `seconds`: the first
  drafted cycle's (tokens, seconds), then running means weighing the newest RATE_MEMORY (rows
  not in live_B, when given, keep theirs). Their ratio, SpecState.tree_rate_B, is the rate the
  drafted cycles have been giving: expected tokens over seconds, not a mean of the cycles' own
  ratios, which would undercount the long sure cycles."""
  new_Bx2 = jnp.stack([tokens_B, jnp.broadcast_to(seconds, tokens_B.shape)], axis=1)
  first_B = old_Bx2[:, 1] <= 0
  out = jnp.where(first_B[:, None], new_Bx2, old_Bx2 + RATE_MEMORY * (new_Bx2 - old_Bx2))
  return out if live_B is None else jnp.where(live_B[:, None], out, old_Bx2)


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
