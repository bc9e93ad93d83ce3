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
  (m = 1 at every node) keeps the single-draft bound; tests/test_acceptance.py enumerates them.

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
