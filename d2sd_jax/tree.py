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

from d2sd_jax import sampling as sampling_lib


@flax.struct.dataclass
class Tree:
  tokens_BxT: jax.Array  # int32, node 0 = anchor
  parents_BxT: jax.Array  # int32, parent index (node 0: 0)
  valid_BxT: jax.Array  # bool, node 0 always True

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
  """(ancestor-or-self mask [B, T, T], depth [B, T]); invalid nodes keep only themselves."""
  B, T = tree.tokens_BxT.shape
  rows = jnp.arange(B)

  def add_node(i, carry):
    anc, depth = carry
    p = tree.parents_BxT[:, i]
    anc = anc.at[:, i].set(anc[rows, p] | (jnp.arange(T) == i)[None])
    depth = depth.at[:, i].set(depth[rows, p] + 1)
    return anc, depth

  anc0 = jnp.broadcast_to(jnp.eye(T, dtype=bool), (B, T, T))
  anc, depth = jax.lax.fori_loop(1, T, add_node, (anc0, jnp.zeros((B, T), jnp.int32)))
  return anc, depth


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
  keys = jax.vmap(lambda k: jax.random.split(k, T))(rng_B)  # [B, T] keys, one per node
  y_BxT = jax.vmap(jax.vmap(lambda k, lg: sampling_lib.sample(k, lg, settings)))(
      keys, target_logits_BxTxV)
  y_at_parent = jnp.take_along_axis(y_BxT, tree.parents_BxT, axis=1)
  match = reachable(tree) & (tree.tokens_BxT == y_at_parent)
  match = match.at[:, 0].set(True)
  # A node is accepted when every node on its root path matched.
  accepted = ~jnp.any(anc_BxTxT & ~match[:, None, :], axis=-1)
  best = jnp.argmax(jnp.where(accepted, depth_BxT, -1), axis=1)  # deepest; ties -> lowest index
  best_depth = jnp.take_along_axis(depth_BxT, best[:, None], 1)[:, 0]
  bonus = jnp.take_along_axis(y_BxT, best[:, None], 1)[:, 0]
  on_path = jnp.take_along_axis(anc_BxTxT, best[:, None, None], 1)[:, 0]  # [B, T]
  # Path nodes ordered by depth: node with depth d goes to slot d; slots past the end -> best.
  slot = jnp.where(on_path, depth_BxT, T)
  path = jnp.broadcast_to(best[:, None], (B, T + 1)).at[jnp.arange(B)[:, None], slot].set(
      jnp.broadcast_to(jnp.arange(T), (B, T)), mode='drop')[:, :T]
  return best, best_depth, bonus, path
