"""Candidate token trees in fixed shapes, and the acceptance rules over them.

A tree for one row has node 0 = the anchor (the last committed token, not yet in the cache) and
nodes 1..N = draft tokens, each with a parent of lower index. Invalid nodes (padding, or a
duplicate of an earlier sibling's token) are never accepted. Everything is batched over rows
and fixed-shape, so acceptance compiles into the speculative step with no host round-trip.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from d2sd_jax.models import sampling as sampling_lib


@flax.struct.dataclass
class Tree:
  tokens_BxT: jax.Array  # int32, node 0 = anchor
  parents_BxT: jax.Array  # int32, parent index (node 0: 0)
  valid_BxT: jax.Array  # bool, node 0 always True
  # The law each node's token was drawn from, for recursive rejection ([B, T, V]); None: every
  # draft is a point mass (deterministic), verified by sample-and-match.
  q_BxTxV: jax.Array | None = None
  # Best-first trees: the log of each node's estimated probability of being reached and
  # accepted (node 0: 0; an invalid node: -inf), from which a cycle expects 1 + sum(exp(score))
  # committed tokens. None for the other trees.
  score_BxT: jax.Array | None = None
  # Best-first trees: which proposer scored each node (SOURCES; -1: the anchor). What the
  # node tally (SpecSettings.tally_nodes) counts acceptance by, and node_calibration maps by.
  source_BxT: jax.Array | None = None

  @property
  def size(self) -> int:
    return self.tokens_BxT.shape[1]


def chain(anchor_B: jax.Array, draft_BxN: jax.Array, valid_BxN: jax.Array) -> Tree:
  """A single path: anchor -> draft[0] -> draft[1] -> ...; a node after an invalid one is invalid."""
  B, N = draft_BxN.shape
  parents = jnp.broadcast_to(jnp.maximum(jnp.arange(N + 1) - 1, 0), (B, N + 1)).astype(jnp.int32)
  valid = jnp.cumprod(valid_BxN.astype(jnp.int32), axis=1).astype(bool)
  return Tree(tokens_BxT=jnp.concatenate([anchor_B[:, None], draft_BxN], 1).astype(jnp.int32),
              parents_BxT=parents,
              valid_BxT=jnp.concatenate([jnp.ones((B, 1), bool), valid], 1))


def structure(tree: Tree):
  """(ancestor-or-self mask [B, T, T], depth [B, T]) from the parent links.

  The relation {self, parent} is squared until it spans the deepest path (log2 T batched
  [T, T] products): a loop over the nodes costs a while-loop iteration per node."""
  B, T = tree.tokens_BxT.shape
  eye = jnp.eye(T, dtype=bool)
  reach_BxTxT = eye | (tree.parents_BxT[:, :, None] == jnp.arange(T)[None, None, :])
  for _ in range(max(T - 2, 0).bit_length()):  # 2^s levels after s squarings; depth <= T-1
    hops = reach_BxTxT.astype(jnp.float32)
    reach_BxTxT = jnp.einsum('bij,bjk->bik', hops, hops) > 0
  return reach_BxTxT, jnp.sum(reach_BxTxT, axis=-1, dtype=jnp.int32) - 1


def reachable(tree: Tree) -> jax.Array:
  """Valid nodes that are not a repeat of an earlier sibling's token (which would be unreachable:
  a walk descends into the first child carrying the drawn token)."""
  same_parent = tree.parents_BxT[:, :, None] == tree.parents_BxT[:, None, :]
  same_token = tree.tokens_BxT[:, :, None] == tree.tokens_BxT[:, None, :]
  T = tree.size
  earlier = jnp.arange(T)[None, :] < jnp.arange(T)[:, None]  # [i, j]: j < i
  not_root = jnp.arange(T) > 0  # the root is nobody's sibling (its parent entry is itself)
  sibling = same_parent & earlier[None] & (not_root[:, None] & not_root[None, :])[None]
  dup = jnp.any(sibling & same_token & tree.valid_BxT[:, None, :], axis=-1)
  return tree.valid_BxT & ~dup


def node_keys(accept_key_B: jax.Array, T: int) -> jax.Array:
  """[B, T + 1] keys of the acceptance stream: one per node (the target's draw there), then the
  bonus draw's."""
  return jax.vmap(lambda k: jax.random.split(k, T + 1))(accept_key_B)


def accept_point_mass(tree: Tree, anc_BxTxT: jax.Array, depth_BxT: jax.Array,
                      target_logits_BxTxV: jax.Array, settings: sampling_lib.SamplingSettings,
                      rng_B: jax.Array):
  """Sample-and-match over a tree of point-mass (deterministic) drafts; greedy when T = 0.

  At every node a target token y is drawn from p (argmax when greedy) with its own key; the walk
  from the anchor descends into the child whose token equals y, else stops and emits y. Drawing
  y at nodes the walk never reaches changes nothing, so drawing them all at once is exact.

  Returns (best node [B], its depth = accepted draft tokens [B], the bonus token [B],
  path node indices [B, T] by depth, padded with the best node).
  """
  B, T = tree.tokens_BxT.shape
  keys = node_keys(rng_B, T)[:, :T]  # one per node
  y_BxT = jax.vmap(jax.vmap(lambda k, lg: sampling_lib.sample(k, lg, settings)))(
      keys, target_logits_BxTxV)
  y_at_parent = jnp.take_along_axis(y_BxT, tree.parents_BxT, axis=1)
  match = reachable(tree) & (tree.tokens_BxT == y_at_parent)
  match = match.at[:, 0].set(True)
  # A node is accepted when every node on its root path matched.
  accepted = ~jnp.any(anc_BxTxT & ~match[:, None, :], axis=-1)
  best = jnp.argmax(jnp.where(accepted, depth_BxT, -1), axis=1)  # deepest; ties -> lowest index
  bonus = jnp.take_along_axis(y_BxT, best[:, None], 1)[:, 0]
  return (best, jnp.take_along_axis(depth_BxT, best[:, None], 1)[:, 0], bonus,
          path_to(best, anc_BxTxT, depth_BxT))


def path_to(node_B, anc_BxTxT, depth_BxT):
  """[B, T] node indices from the anchor down to `node` by depth, padded with `node`."""
  B, T = depth_BxT.shape
  on_path = jnp.take_along_axis(anc_BxTxT, node_B[:, None, None], 1)[:, 0]  # [B, T]
  slot = jnp.where(on_path, depth_BxT, T)  # node of depth d goes to slot d
  return jnp.broadcast_to(node_B[:, None], (B, T + 1)).at[jnp.arange(B)[:, None], slot].set(
      jnp.broadcast_to(jnp.arange(T), (B, T)), mode='drop')[:, :T]


def accept_recursive(tree: Tree, anc_BxTxT: jax.Array, depth_BxT: jax.Array,
                     target_logits_BxTxV: jax.Array, settings: sampling_lib.SamplingSettings,
                     rng_B: jax.Array, leniency: float = 0.0, q_BxTxV: jax.Array | None = None):
  """Recursive rejection over siblings, walking down from the anchor, with leniency λ.

  At the current node with residual r (at first the target's p there), its children are tried in
  index order. A child x drawn from law q (a point mass when `q_BxTxV` is None) is accepted with
  probability min(1, t(x) / q(x)), t = (1-λ) r + λ q; on rejection r <- norm(max(t - q, 0)) and
  the next sibling is tried; on acceptance the walk moves to x with r = p there. When no child
  is accepted the bonus token is drawn from r. For a point mass this is: accept with
  λ + (1-λ) r(x), else remove x from r. Sibling laws must be the exact laws each sibling was
  drawn from, renormalised after excluding earlier siblings.

  λ = 0 is exact: every emitted token follows the target's law given the tokens before it.
  λ > 0 trades fidelity for acceptance; λ is applied again at every sibling tried, so the drift
  of a token grows with m, the number of children its node has in the tree:
    one child with law q:       the token's law is (1-λ) p + λ q, TV to p = λ·TV(p, q);
    m children with any laws:   TV to p <= 1 - (1-λ)^m  (<= m·λ), and no better in general:
    m point-mass children x_i:  every token outside them keeps exactly (1-λ)^m of its mass
                                (all m are rejected with probability (1-λ)^m p(outside)), so
                                TV >= (1 - (1-λ)^m)·(1 - p({x_1..x_m})); p = [.01, .01, .98],
                                λ = .5, children 0 and 1: TV = 0.735 (single-draft claim: 0.495).
  (Each sibling emits exactly its own lenient target t_i = (1-λ) r + λ q_i against the
  residual, so the error recurses as D_i <= λ·TV(r, q_i) + (1-λ)·TV(r, q_i)·D_{i+1}.) A chain
  (m = 1 at every node) keeps the single-draft bound; tests/spec_decode/test_acceptance.py
  enumerates them.

  Returns the same tuple as `accept_point_mass`.
  """
  B, T = tree.tokens_BxT.shape
  keys = node_keys(rng_B, T)  # per node, + the bonus draw
  u_BxT = jax.vmap(jax.vmap(jax.random.uniform))(keys[:, :T])
  u_bonus_B = jax.vmap(jax.random.uniform)(keys[:, T])
  if q_BxTxV is None:
    node = _walk_point_masses(tree, target_logits_BxTxV, settings, u_BxT, leniency)
    # The residual at the last node: p there without its children's tokens (all were tried
    # and rejected: a child of a node has a higher index, and the walk tries every one).
    tried_BxT = reachable(tree) & (tree.parents_BxT == node[:, None]) & (jnp.arange(T) > 0)
    logits_node_BxV = jnp.take_along_axis(target_logits_BxTxV, node[:, None, None], 1)[:, 0]
    bonus = sampling_lib.sample_uniform(u_bonus_B, logits_node_BxV, settings,
                                        jnp.where(tried_BxT, tree.tokens_BxT, -1))
    return (node, jnp.take_along_axis(depth_BxT, node[:, None], 1)[:, 0], bonus,
            path_to(node, anc_BxTxT, depth_BxT))
  p_BxTxV = sampling_lib.probs(target_logits_BxTxV, settings)
  candidate = tree.valid_BxT & (jnp.arange(T) > 0)
  rows = jnp.arange(B)

  def visit(j, carry):
    node, r_BxV = carry
    x = tree.tokens_BxT[:, j]
    try_it = candidate[:, j] & (tree.parents_BxT[:, j] == node)
    q_BxV = q_BxTxV[:, j]
    t_BxV = (1.0 - leniency) * r_BxV + leniency * q_BxV
    ratio = t_BxV[rows, x] / jnp.maximum(q_BxV[rows, x], 1e-30)
    accept = try_it & (u_BxT[:, j] < jnp.minimum(1.0, ratio))
    rest = jnp.maximum(t_BxV - q_BxV, 0.0)
    rest_mass = jnp.sum(rest, -1, keepdims=True)
    # The rejection probability is exactly rest_mass; when it is 0 (t = q up to rounding) a
    # rejection can only be a rounding artefact, and would leave an empty residual (whose
    # "draw" would be token 0): accept instead.
    accept = accept | (try_it & (rest_mass[:, 0] <= 0.0))
    rest = rest / jnp.maximum(rest_mass, 1e-30)
    r_BxV = jnp.where(accept[:, None], p_BxTxV[:, j], jnp.where(try_it[:, None], rest, r_BxV))
    return jnp.where(accept, j, node), r_BxV

  node, r_BxV = jax.lax.fori_loop(1, T, visit, (jnp.zeros((B,), jnp.int32), p_BxTxV[:, 0]))
  bonus = sampling_lib.draw(u_bonus_B, jnp.log(r_BxV))
  if settings.greedy and leniency == 0.0:
    bonus = sampling_lib.argmax(r_BxV)
  return (node, jnp.take_along_axis(depth_BxT, node[:, None], 1)[:, 0], bonus.astype(jnp.int32),
          path_to(node, anc_BxTxT, depth_BxT))


def _walk_point_masses(tree: Tree, target_logits_BxTxV, settings, u_BxT, leniency: float):
  """accept_recursive's walk when every draft is a point mass: the residual at a node is p
  there without the tokens of its rejected children, so the walk keeps, per row, only the mass
  those took (`gone`) and each child's p(x) at its parent ([B, T] scalars, no [B, T, V] law):
  child x is accepted with λ + (1-λ) p(x) / (1 - gone). Returns the last node reached [B]."""
  B, T = tree.tokens_BxT.shape
  # p_i(x_j) for every node i and node token x_j, then each node's own parent's.
  p_BxTxT = sampling_lib.token_probs(
      target_logits_BxTxV, jnp.broadcast_to(tree.tokens_BxT[:, None, :], (B, T, T)), settings)
  p_at_parent_BxT = jnp.take_along_axis(p_BxTxT, tree.parents_BxT[:, None, :], 1)[:, 0]
  # Point-mass siblings repeating an earlier token could never be accepted; skip them.
  candidate = reachable(tree) & (jnp.arange(T) > 0)

  def visit(j, carry):
    node, gone = carry
    try_it = candidate[:, j] & (tree.parents_BxT[:, j] == node)
    left, p_x = 1.0 - gone, p_at_parent_BxT[:, j]
    r_x = p_x / jnp.maximum(left, 1e-30)  # the residual's probability of x
    accept = try_it & (u_BxT[:, j] < leniency + (1.0 - leniency) * r_x)
    # Rejecting x would leave no mass (a rounding artefact: then p(x) = left): accept instead.
    accept = accept | (try_it & (left - p_x <= 0.0))
    gone = jnp.where(accept, 0.0, jnp.where(try_it, gone + p_x, gone))
    return jnp.where(accept, j, node), gone

  node, _ = jax.lax.fori_loop(1, T, visit, (jnp.zeros((B,), jnp.int32), jnp.zeros((B,))))
  return node


# ----------------------------------------------------------------------------------------------
# Best-first trees: the likeliest nodes of a pool of scored candidates, under a node budget


def best_of_pool(anchor_B, token_BxP, parent_BxP, score_BxP, depth_BxP, size: int,
                 max_depth: int, source_BxP=None) -> Tree:
  """The `size` - 1 best-scored nodes of a pool as a Tree (node 0 = the anchor).

  Pool node p carries a token, a parent (a pool index, -1 for the anchor), a score (log of its
  estimated probability of being reached and accepted; -inf: never) and a depth. When scores
  never rise from parent to child, the best nodes are closed under taking parents, so they
  form a tree. The chosen nodes are ordered best first (by score, then depth, then pool
  index), so every parent precedes its children and the first n nodes are the best tree of n
  (`prefix`: what an adaptive cycle verifies); a node whose parent was not chosen (possible only
  on score ties) or whose score is -inf is invalid, and so is everything under it. source_BxP:
  each candidate's proposer (SOURCES), kept with the chosen nodes."""
  B, P = token_BxP.shape
  M = size - 1
  if M > P:
    raise ValueError(f'a tree of {size} nodes needs a pool of at least {M} candidates, not {P}')
  rows = jnp.arange(B)[:, None]
  _, chosen = jax.lax.top_k(score_BxP, M)  # [B, M]
  order = jax.vmap(lambda score, depth, index: jnp.lexsort((index, depth, -score)))(
      jnp.take_along_axis(score_BxP, chosen, 1), jnp.take_along_axis(depth_BxP, chosen, 1),
      chosen)
  chosen = jnp.take_along_axis(chosen, order, 1)
  node_of_BxP = jnp.full((B, P), -1, jnp.int32).at[rows, chosen].set(
      jnp.broadcast_to(jnp.arange(1, M + 1, dtype=jnp.int32), (B, M)))
  parent_pool = jnp.take_along_axis(parent_BxP, chosen, 1)
  parent_node = jnp.where(parent_pool < 0, 0, jnp.take_along_axis(
      node_of_BxP, jnp.maximum(parent_pool, 0), 1))
  ok = jnp.isfinite(jnp.take_along_axis(score_BxP, chosen, 1)) & (parent_node >= 0)
  parents = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), jnp.maximum(parent_node, 0)], 1)
  valid = jnp.concatenate([jnp.ones((B, 1), bool), ok], 1)
  for _ in range(max_depth - 1):  # an invalid node invalidates its subtree
    valid = valid & jnp.take_along_axis(valid, parents, 1)
  tokens = jnp.concatenate([anchor_B[:, None], jnp.take_along_axis(token_BxP, chosen, 1)], 1)
  score = jnp.concatenate([jnp.zeros((B, 1)), jnp.take_along_axis(score_BxP, chosen, 1)], 1)
  source = None if source_BxP is None else jnp.concatenate(
      [jnp.full((B, 1), -1, jnp.int32), jnp.take_along_axis(source_BxP, chosen, 1)], 1)
  return Tree(tokens_BxT=tokens.astype(jnp.int32), parents_BxT=parents, valid_BxT=valid,
              score_BxT=jnp.where(valid, score, -jnp.inf).astype(jnp.float32), source_BxT=source)


def prefix(tree: Tree, n: int) -> Tree:
  """The first n nodes of a tree whose parents precede their children (best_of_pool's: its
  best tree of n nodes)."""
  cut = lambda x: None if x is None else x[:, :n]
  return Tree(tokens_BxT=tree.tokens_BxT[:, :n], parents_BxT=tree.parents_BxT[:, :n],
              valid_BxT=tree.valid_BxT[:, :n], q_BxTxV=cut(tree.q_BxTxV),
              score_BxT=cut(tree.score_BxT), source_BxT=cut(tree.source_BxT))


# The proposers of a best-first tree's nodes (Tree.source_BxT indexes this).
SOURCES = ('drafter1', 'drafter2', 'lookup')
# The node tally's bins of estimated probability exp(score): their edges.
TALLY_EDGES = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def node_tally(tree: Tree, depth_BxT, path_BxC, accept_len_B, max_depth: int) -> jax.Array:
  """[B, len(SOURCES), max_depth - 1, len(TALLY_EDGES) - 1, 3] what one cycle's verified nodes
  say about their scores: for each proposer, depth and bin of estimated probability, the valid
  nodes (count), their estimated probabilities summed, and how many were accepted (on the
  accepted path). Summed over cycles, accepted / count against estimated / count is the
  reliability of each proposer's scores (scripts/calibrate_nodes.py)."""
  B, T = tree.tokens_BxT.shape
  C = path_BxC.shape[1]
  on_path_BxCxT = (path_BxC[:, :, None] == jnp.arange(T)[None, None]) & (
      jnp.arange(C)[None, :, None] >= 1) & (jnp.arange(C)[None, :, None] <= accept_len_B[:, None, None])
  accepted_BxT = jnp.any(on_path_BxCxT, axis=1)
  p_BxT = jnp.exp(tree.score_BxT)
  edges = jnp.asarray(TALLY_EDGES[1:-1], jnp.float32)
  bin_BxT = jnp.sum(p_BxT[..., None] >= edges, axis=-1)
  nb, S, D = len(TALLY_EDGES) - 1, len(SOURCES), max_depth - 1
  live = tree.valid_BxT & (tree.source_BxT >= 0) & (depth_BxT >= 1)
  cell_BxT = (jnp.clip(tree.source_BxT, 0, S - 1) * D + jnp.clip(depth_BxT - 1, 0, D - 1)) * nb + bin_BxT
  values_BxTx3 = jnp.stack([jnp.ones_like(p_BxT), p_BxT, accepted_BxT.astype(jnp.float32)], -1)
  values_BxTx3 = jnp.where(live[..., None], values_BxTx3, 0.0)
  out = jnp.zeros((B, S * D * nb, 3), jnp.float32)
  out = out.at[jnp.arange(B)[:, None], cell_BxT].add(values_BxTx3)
  return out.reshape(B, S, D, nb, 3)


# Node calibration maps a proposer's estimate by the depth of the node: 1, 2, and 3 or deeper.
CALIBRATION_DEPTHS = 3
# The kinds of request curves may be fitted on (SpecSettings.calibration_kind)
CALIBRATION_KINDS = ('plain', 'chat')


def curve_label(source: str, temperature: float = 0.0, kind: str = '') -> str:
  """A reliability curve's name in a drafter's node_calibration: the proposer, '@T' when fitted
  at a sampling temperature T > 0, ':kind' when fitted on one kind of request only
  ('lookup', 'drafter1@0.7', 'drafter2:chat')."""
  return source + (f'@{temperature:g}' if temperature else '') + (f':{kind}' if kind else '')


def parse_curve_label(label: str) -> tuple[str, float, str]:
  """(proposer, temperature, kind) of a curve_label."""
  head, _, kind = label.partition(':')
  source, _, temperature = head.partition('@')
  return source, float(temperature or 0.0), kind


def calibrate(score_BxP, source_BxP, depth_BxP, table) -> jax.Array:
  """Scores (log estimated probabilities) through each proposer's reliability curve: `table`
  maps a SOURCES name to one curve per depth group (CALIBRATION_DEPTHS), a curve being
  (estimates, accepted rates) at increasing estimates, measured on held-out prompts
  (scripts/calibrate_nodes.py) and interpolated linearly between them (flat past the last; 0
  at 0). A proposer the table does not name keeps its scores."""
  if not table:
    return score_BxP
  p = jnp.exp(score_BxP)
  out = score_BxP
  group = jnp.clip(depth_BxP, 1, CALIBRATION_DEPTHS) - 1
  for s, name in enumerate(SOURCES):
    for g, (xs, ys) in enumerate(dict(table).get(name, ())):
      mapped = jnp.interp(p, jnp.asarray((0.0,) + tuple(xs), jnp.float32),
                          jnp.asarray((0.0,) + tuple(ys), jnp.float32))
      out = jnp.where((source_BxP == s) & (group == g), jnp.log(jnp.maximum(mapped, 1e-30)), out)
  return jnp.where(jnp.isfinite(score_BxP), out, score_BxP)


def fall_along_paths(score_BxP, parent_BxP, max_depth: int) -> jax.Array:
  """Each score capped by its parent's (parent -1: the anchor), down the whole path, so that
  scores never rise from parent to child, as best_of_pool needs (calibrated scores of two
  proposers, or of two depth groups, may)."""
  for _ in range(max_depth - 2):
    above = jnp.take_along_axis(score_BxP, jnp.maximum(parent_BxP, 0), 1)
    score_BxP = jnp.where(parent_BxP >= 0, jnp.minimum(score_BxP, above), score_BxP)
  return score_BxP


def pad(tree: Tree, n: int) -> Tree:
  """The tree with invalid leaves under the anchor appended up to n nodes (never accepted)."""
  extra = n - tree.size
  if extra <= 0:
    return tree
  B = tree.tokens_BxT.shape[0]
  more = lambda x, value: None if x is None else jnp.concatenate(
      [x, jnp.full((B, extra) + x.shape[2:], value, x.dtype)], 1)
  return Tree(tokens_BxT=more(tree.tokens_BxT, 0), parents_BxT=more(tree.parents_BxT, 0),
              valid_BxT=more(tree.valid_BxT, False), q_BxTxV=more(tree.q_BxTxV, 0.0),
              score_BxT=more(tree.score_BxT, -jnp.inf), source_BxT=more(tree.source_BxT, -1))


def expected_drafts(tree: Tree) -> jax.Array:
  """[B] the draft tokens a best-first tree expects to commit: the sum of its valid nodes'
  estimated probabilities of being reached and accepted (the accepted nodes form one path, so
  the accepted length is the number of accepted nodes; an invalid node scores -inf, adding 0);
  0 for a tree without scores."""
  if tree.score_BxT is None:
    return jnp.zeros(tree.tokens_BxT.shape[:1], jnp.float32)
  return jnp.sum(jnp.exp(tree.score_BxT[:, 1:]), axis=1)


def beam_pool(top_logp_BxGxW, top_ids_BxGxW):
  """DDTree's candidates in fixed shapes, from independent per-position marginals: for each
  depth d = 1..G-1, the W likeliest prefixes of length d (a prefix's log-probability is the sum
  of its tokens' at their positions), found by a beam of width W over depth, each kept prefix
  expanded by the W likeliest tokens of the next position.

  This finds the W likeliest nodes of every depth, hence the best M <= W nodes overall: such a
  node's parent is among the best M (scores fall along a path), hence in the beam of its depth,
  and its token is among its position's best M (every likelier sibling is among the best M too).

  Input: each position's W best tokens, best first, position 0 (the anchor) ignored. Returns the
  pool (token, parent, score, depth), each [B, (G-1) * W], depth-major."""
  B, G, W = top_logp_BxGxW.shape
  rows = jnp.arange(B)[:, None]
  score, token = top_logp_BxGxW[:, 1], top_ids_BxGxW[:, 1]
  scores, tokens, parents = [score], [token], [jnp.full((B, W), -1, jnp.int32)]
  for d in range(2, G):
    cand_BxWW = (score[:, :, None] + top_logp_BxGxW[:, d, None, :]).reshape(B, W * W)
    score, idx = jax.lax.top_k(cand_BxWW, W)
    token = top_ids_BxGxW[:, d][rows, idx % W]
    scores.append(score)
    tokens.append(token)
    parents.append((d - 2) * W + (idx // W).astype(jnp.int32))
  depth = jnp.repeat(jnp.arange(1, G, dtype=jnp.int32), W)
  return (jnp.concatenate(tokens, 1).astype(jnp.int32), jnp.concatenate(parents, 1),
          jnp.concatenate(scores, 1), jnp.broadcast_to(depth, (B, (G - 1) * W)))


def merge_paths(path_BxPxN, depth_BxP, score_BxP, source_BxP):
  """A pool given by paths: node p is the path path[p, :depth[p]] below the anchor. Nodes with
  the same path are one node, kept at its lowest pool index with the highest of their scores
  and that score's proposer (the others get -inf); each node's parent is the kept node of its
  path minus the last token. Returns (token, parent, score, source) [B, P] for `best_of_pool`.
  Every proposer must propose whole paths (each node's prefixes too), so every parent exists."""
  B, P, N = path_BxPxN.shape
  n = jnp.arange(N)

  def agree(upto_BxQ):  # [B, P, Q]: paths of p and q agree on q's first upto[q] tokens
    eq = (path_BxPxN[:, :, None, :] == path_BxPxN[:, None, :, :]) | (
        n[None, None, None] >= upto_BxQ[:, None, :, None])
    return jnp.all(eq, axis=-1)
  same = agree(depth_BxP) & (depth_BxP[:, :, None] == depth_BxP[:, None, :])
  first = jnp.argmax(same, axis=2)  # the lowest index with the same path (p itself at worst)
  kept = first == jnp.arange(P)[None]
  alike = jnp.where(same, score_BxP[:, None, :], -jnp.inf)
  merged = jnp.max(alike, axis=2)
  source = jnp.take_along_axis(source_BxP, jnp.argmax(alike, axis=2), 1)
  is_parent = agree(depth_BxP) & (depth_BxP[:, None, :] == depth_BxP[:, :, None] - 1) & kept[:, None]
  parent = jnp.where(depth_BxP <= 1, -1, jnp.argmax(is_parent, axis=2)).astype(jnp.int32)
  orphan = (depth_BxP > 1) & ~jnp.any(is_parent, axis=2)
  token = jnp.take_along_axis(path_BxPxN, jnp.clip(depth_BxP - 1, 0, N - 1)[..., None], 2)[..., 0]
  return token, parent, jnp.where(kept & ~orphan, merged, -jnp.inf), source
