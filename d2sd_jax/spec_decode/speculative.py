"""Speculative decoding as one XLA program: draft -> verify (one tree-masked target pass) ->
accept -> commit (cache compaction), repeated inside one `lax.while_loop`.

Shape letters (one meaning each, here and in drafting.py, tree.py and models/target.py):
  B  rows of the batch                  V  vocabulary
  L  committed-sequence buffer          D  target width
  S  KV-cache slots                     T  tree nodes verified per cycle (node 0 = the anchor)
  G  gamma: block length (the anchor + G-1 drafts)
  K  branches re-drafted per cycle      C  commit slots per cycle (= G: G-1 drafts + bonus)
  N  a count named where used (drafts of a chain, generated tokens)
  Hkv  KV heads; Hg query heads per KV head; hd head width; Lf feature layers

The state keeps, per row, the committed sequence (prompt + generated), the target KV cache
holding all committed tokens but the newest (the anchor of the next cycle), and counters.
Drafting methods (drafting.py) turn the state into a candidate tree. `params` is a bundle
{'target': ..., 'drafter1': ..., 'drafter2': ...} (drafters only where the method needs them);
the drafters' context caches hold the target features of exactly the committed tokens, updated
with the accepted path's features from the verification pass. The invariants the tests check:
after every cycle the caches equal a fresh prefill of the committed tokens, and the output
equals AR decoding.
"""
from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from d2sd_jax.models import drafter as drafter_lib
from d2sd_jax.spec_decode import drafting
from d2sd_jax.spec_decode import lookup as lookup_lib
from d2sd_jax.spec_decode import adaptive
from d2sd_jax.spec_decode import ar
from d2sd_jax.models import target as model_lib
from d2sd_jax.spec_decode import tree as tree_lib
from d2sd_jax.spec_decode.settings import SpecSettings  # (re-exported: SP.SpecSettings)


@flax.struct.dataclass
class SpecState:
  """Everything a cycle reads and writes; per row b, the committed tokens are
  seq[b, :seq_len[b]] and every cache holds exactly the first seq_len[b] - 1 of them."""
  cache: model_lib.Cache  # target K/V per layer, [B, Hkv, S, hd]; slots >= cache_len are junk
  cache_len_B: jax.Array  # int32: committed tokens in the caches (= seq_len - 1)
  seq_BxL: jax.Array  # int32: prompt, then generated tokens; pad_id after seq_len
  seq_len_B: jax.Array  # int32: committed tokens; the last one is the next cycle's anchor
  prompt_len_B: jax.Array  # int32
  num_out_B: jax.Array  # int32: generated tokens so far (EOS included)
  done_B: jax.Array  # bool: EOS committed or the row's limit of new tokens reached
  max_new_B: jax.Array  # int32: each row's limit of new tokens (ar.new_token_limits)
  row_key_B: jax.Array  # PRNG key per row (fold_in(seed, prompt index): batch-independent)
  cycles_B: jax.Array  # int32: verification cycles run while the row was live
  accepted_hist_BxC: jax.Array  # int32 [B, C]: cycles that accepted c draft tokens, c < C
  # float32: the draft tokens the live cycles' trees expected to commit, summed (best-first
  # trees: tree.expected_drafts; 0 for the others)
  expected_B: jax.Array
  steps: jax.Array  # int32 scalar: loop iterations (cycles of the slowest row)
  verified_nodes_B: jax.Array  # int32: tree nodes verified in the row's live cycles, summed
  draft_caches: dict  # drafter name -> context K/V (target features of the committed tokens)
  # settings.tally_nodes: [B, sources, gamma-1 depths, bins, 3] tree.node_tally summed over the
  # row's live cycles (None otherwise)
  node_tally: jax.Array | None = None
  # settings.adaptive: [B, 2] float32, running means of the expected tokens and the seconds of
  # the row's drafted (not lookup-only) cycles (adaptive.running), zeros before the first
  # (else None); tree_rate_B is their ratio
  drafted_Bx2: jax.Array | None = None
  lookup_only_B: jax.Array | None = None  # int32 [B]: its live cycles that verified lookup alone

  @property
  def tree_rate_B(self):
    """settings.adaptive: the expected tokens per second the row's drafted cycles have been
    giving, inf before the first."""
    tokens_B, seconds_B = self.drafted_Bx2[:, 0], self.drafted_Bx2[:, 1]
    return jnp.where(seconds_B > 0, tokens_B / jnp.where(seconds_B > 0, seconds_B, 1.0),
                     jnp.inf)

  @property
  def anchor_B(self):
    """The last committed token: node 0 of the next tree (not yet in any cache)."""
    return jnp.take_along_axis(self.seq_BxL, (self.seq_len_B - 1)[:, None], 1)[:, 0]

  @property
  def cycle_keys(self):
    """(draft_key_B, accept_key_B): the two random streams of this cycle.

    Each row's cycle key is fold_in(row key, committed length), so a row's draws depend on
    neither its batch nor the cycles before. It is split once into a drafting stream (methods
    that sample, e.g. dflash_resample, draw only from it) and an acceptance stream
    (tree.node_keys: one key per node plus the bonus draw's). No key is in both streams."""
    cycle_B = jax.vmap(jax.random.fold_in)(self.row_key_B, self.seq_len_B)
    both_Bx2 = jax.vmap(lambda k: jax.random.split(k, 2))(cycle_B)
    return both_Bx2[:, 0], both_Bx2[:, 1]


def seq_buffer_len(prompt_len: int, settings: SpecSettings) -> int:
  return prompt_len + settings.generation.max_new_tokens + settings.max_commit


CACHE_MULTIPLE = 16  # cache slots are a multiple of this (see cache_size_needed)


def cache_size_needed(prompt_len: int, settings: SpecSettings) -> int:
  """Cache slots: every committed token + one cycle's commit slots written after the last
  (verification only reads the cache; `write_path` writes the accepted path's C slots),
  rounded up to a multiple of CACHE_MULTIPLE. The TPU compiler tiles a cache [B, Hkv, S, hd]
  by (8 or 16, 128) over its two minor dimensions: with S a multiple of the tile it keeps that
  layout, else it stored the cache slots-major (S = 1,356, not a multiple of 16) and converted
  every layer's whole cache to the attention's layout in every cycle
  (benchmarks/tpu_compile.py; docs/scale-out.md)."""
  need = prompt_len + settings.generation.max_new_tokens + settings.max_commit
  return -(-need // CACHE_MULTIPLE) * CACHE_MULTIPLE


def _select_features(features_BxTxNxD, settings: SpecSettings, name: str):
  """The drafter's own feature layers, out of the union computed by the target pass."""
  idx = [settings.feature_layers.index(i) for i in getattr(settings, name).feature_layers]
  return drafter_lib.features_of(features_BxTxNxD[:, :, jnp.asarray(idx)])


def _write_drafter_context(params, settings, caches, features_BxTxNxD, positions_BxT, start_B):
  return {name: drafter_lib.write_context(
      caches[name], params[name], getattr(settings, name),
      _select_features(features_BxTxNxD, settings, name), positions_BxT, start_B)
          for name in settings.drafters}


def init_state(params, cfg: model_lib.ModelConfig, settings: SpecSettings, prompt_BxP,
               prompt_len_B, row_key_B, cache_size: int, max_new=None) -> SpecState:
  """Prefill the prompts (target cache and drafter contexts) and commit each row's first token.
  max_new: this run's limit of new tokens (traced; None: the settings' max_new_tokens)."""
  gen = settings.generation
  B, P = prompt_BxP.shape
  max_new_B = ar.new_token_limits(gen, max_new, B)
  first_B, cache, feats = ar.prefill_prompts(
      params['target'], cfg, gen, prompt_BxP, prompt_len_B, row_key_B, cache_size,
      settings.feature_layers)
  positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
  caches = {name: drafter_lib.init_context_cache(getattr(settings, name), B, cache_size)
            for name in settings.drafters}
  caches = _write_drafter_context(params, settings, caches, feats, positions,
                                  jnp.zeros((B,), jnp.int32))
  L = seq_buffer_len(P, settings)
  seq = jnp.full((B, L), gen.pad_id, jnp.int32).at[:, :P].set(prompt_BxP)
  seq = jnp.where(jnp.arange(L)[None] < prompt_len_B[:, None], seq, gen.pad_id)
  seq = seq.at[jnp.arange(B), prompt_len_B].set(first_B)
  done = ar.is_eos(first_B, gen.eos_ids) | (max_new_B <= 1)
  return SpecState(cache=cache, cache_len_B=prompt_len_B, seq_BxL=seq,
                   seq_len_B=prompt_len_B + 1, prompt_len_B=prompt_len_B,
                   num_out_B=jnp.ones((B,), jnp.int32), done_B=done, max_new_B=max_new_B,
                   row_key_B=row_key_B,
                   cycles_B=jnp.zeros((B,), jnp.int32),
                   accepted_hist_BxC=jnp.zeros((B, settings.max_commit), jnp.int32),
                   expected_B=jnp.zeros((B,), jnp.float32),
                   steps=jnp.zeros((), jnp.int32),
                   verified_nodes_B=jnp.zeros((B,), jnp.int32), draft_caches=caches,
                   node_tally=jnp.zeros((B, len(tree_lib.SOURCES), settings.gamma - 1,
                                         len(tree_lib.TALLY_EDGES) - 1, 3), jnp.float32)
                   if settings.tally_nodes else None,
                   drafted_Bx2=jnp.zeros((B, 2), jnp.float32) if settings.adaptive else None,
                   lookup_only_B=jnp.zeros((B,), jnp.int32)
                   if settings.takes_lookup_cycles else None)


def prepare(params, cfg: model_lib.ModelConfig) -> dict:
  """The bundle as the decode programs want it, with what they derive from the weights
  computed once rather than in every cycle: each drafter's head rows and key/value rows
  (`drafter.for_decoding`). Outputs differ from the plain bundle's only by float32 summation
  order; `spec_loop` accepts either."""
  out = dict(params)
  for name in ('drafter1', 'drafter2'):
    if name in params:
      out[name] = drafter_lib.for_decoding(params[name], params['target'], cfg)
  return out


# ----------------------------------------------------------------------------------------------
# The cycle: keys -> draft -> verify -> accept -> commit


def draft(params, cfg, settings: SpecSettings, state: SpecState) -> tree_lib.Tree:
  """Drafter 1, boundaries, drafter 2 (or prompt lookup, ...): the method's registry entry."""
  return drafting.get(settings.method).draft(params, cfg, settings, state)


@flax.struct.dataclass
class Verified:
  anc_BxTxT: jax.Array  # ancestor-or-self mask of the tree
  depth_BxT: jax.Array
  positions_BxT: jax.Array
  logits_BxTxV: jax.Array  # target logits at every node (its children's distribution)
  # every node's K/V per layer (`forward`'s write_cache=False), not cached; [B, T', ...] with
  # T' >= T nodes (`verified_nodes`: the padding's are never read)
  new_kv: model_lib.Cache
  features: jax.Array | None  # [B, T', Lf, D] target features of every node (drafter context)


NODE_MULTIPLE = 8  # with several rows, the target verifies a multiple of this many nodes


def verified_nodes(batch: int, nodes: int) -> int:
  """Nodes the target pass runs for a tree of `nodes` nodes: with several rows, a multiple of
  NODE_MULTIPLE. The TPU tiles a [B, T, D] activation by (8, 128) over its last two
  dimensions, so with T not a multiple of 8 (D²SD's 76 nodes) every [B·T, D] view of it, as the
  layer kernels and matmuls take it, was a relayout copy of the rows: on a v5p at batch 8 a
  layer read 231 MB beyond its weights and KV at 76 nodes, 145 MB at 80
  (benchmarks/tpu_compile.py; docs/scale-out.md). One row has no such views."""
  if batch == 1:
    return nodes
  return -(-nodes // NODE_MULTIPLE) * NODE_MULTIPLE


def verify(params, cfg, settings: SpecSettings, state: SpecState, tree: tree_lib.Tree):
  """Every node in one target pass after the committed context (shared prefixes once). The
  cache is only read: `commit` writes the accepted path's K/V (`write_path`). The pass runs
  `verified_nodes` nodes: the tree, then invalid leaves under the anchor (`tree.pad`), whose
  logits are not computed."""
  B, T = tree.tokens_BxT.shape
  padded = tree_lib.pad(tree, verified_nodes(B, T))
  anc_BxTxT, depth_BxT = tree_lib.structure(padded)
  positions = state.cache_len_B[:, None] + depth_BxT
  hidden, new_kv, feats = model_lib.forward(params['target'], cfg, padded.tokens_BxT, positions,
                                            state.cache, state.cache_len_B, anc_BxTxT,
                                            feature_layers=settings.feature_layers,
                                            write_cache=False)
  return Verified(anc_BxTxT[:, :T, :T], depth_BxT[:, :T], positions[:, :T],
                  model_lib.logits(params['target'], cfg, hidden[:, :T]), new_kv, feats)


@flax.struct.dataclass
class Accepted:
  accept_len_B: jax.Array  # draft tokens accepted (depth of the deepest accepted node)
  bonus_B: jax.Array  # the target's own token after them
  path_BxC: jax.Array  # node indices from the anchor down the accepted path, padded


def accept(settings: SpecSettings, tree: tree_lib.Tree, v: Verified, accept_key_B) -> Accepted:
  """The longest accepted path and the bonus token (tree.py has the rules)."""
  sampling = settings.generation.sampling
  if settings.leniency > 0 or (tree.q_BxTxV is not None and not sampling.greedy):
    # Recursive rejection over siblings: drafts with their laws (point masses when none),
    # accepted with min(1, t(x)/q(x)), t = (1-λ) r + λ q.
    _, n_acc_B, bonus_B, path_BxT = tree_lib.accept_recursive(
        tree, v.anc_BxTxT, v.depth_BxT, v.logits_BxTxV, sampling, accept_key_B,
        leniency=settings.leniency, q_BxTxV=tree.q_BxTxV)
  else:  # exact: sample-and-match (greedy matching at T = 0)
    _, n_acc_B, bonus_B, path_BxT = tree_lib.accept_point_mass(
        tree, v.anc_BxTxT, v.depth_BxT, v.logits_BxTxV, sampling, accept_key_B)
  return Accepted(n_acc_B, bonus_B, path_BxT[:, :settings.max_commit])


def committed_tokens(gen: ar.GenerationSettings, state: SpecState, path_tokens_BxC,
                     acc: Accepted):
  """What this cycle commits: the accepted drafts then the bonus, cut exactly where AR stops
  (after an EOS, or at the row's limit of new tokens). Returns (tokens [B, C], count [B], hit_eos [B])."""
  C = path_tokens_BxC.shape[1]
  j = jnp.arange(C)[None]
  n_acc = acc.accept_len_B[:, None]
  drafted_BxC = jnp.pad(path_tokens_BxC[:, 1:], ((0, 0), (0, 1)))  # path[0] is the anchor
  new_BxC = jnp.where(j < n_acc, drafted_BxC, jnp.where(j == n_acc, acc.bonus_B[:, None],
                                                           gen.pad_id))
  is_eos_BxC = ar.is_eos(new_BxC, gen.eos_ids) & (j <= n_acc)
  first_eos_B = jnp.min(jnp.where(is_eos_BxC, j, C), axis=1)
  room_B = state.max_new_B - state.num_out_B
  n_commit_B = jnp.minimum(jnp.minimum(acc.accept_len_B + 1, first_eos_B + 1), room_B)
  n_commit_B = jnp.where(state.done_B, 0, n_commit_B)
  return new_BxC, n_commit_B, first_eos_B < n_commit_B


def path_rows(new_kv: model_lib.Cache, path_BxC, hd: int) -> model_lib.Cache:
  """The accepted path's K/V per layer, [B, Hkv, C, hd] (node indices path_BxC into the
  verified tree's new K/V, whose layout may be [B, T, Hkv * hd]): only the path's C nodes
  are read, not the tree's T."""
  B, C = path_BxC.shape

  def moved(new_BxTx_):  # the path's rows (token-major), then heads-major
    if B == 1:  # C row slices: XLA's cost model charges a gather its whole operand
      rows = jnp.concatenate([jax.lax.dynamic_slice_in_dim(new_BxTx_, path_BxC[0, c], 1, 1)
                              for c in range(C)], axis=1)
    else:
      at = path_BxC.reshape(B, C, *(1,) * (new_BxTx_.ndim - 2))
      rows = jnp.take_along_axis(new_BxTx_, at, axis=1, mode='clip')
    return rows.reshape(B, C, -1, hd).transpose(0, 2, 1, 3)
  return [{'k': moved(new['k']), 'v': moved(new['v'])} for new in new_kv]


def write_path(cache: model_lib.Cache, rows: model_lib.Cache, cache_len_B) -> model_lib.Cache:
  """The cache with the path's K/V (`path_rows`) at consecutive slots cache_len + depth. The
  write depends on acceptance, so it follows every read of the old cache and XLA updates the
  cache in place."""
  return [{'k': model_lib.write_rows(kv['k'], new['k'], cache_len_B),
           'v': model_lib.write_rows(kv['v'], new['v'], cache_len_B)}
          for kv, new in zip(cache, rows)]


@flax.struct.dataclass
class Outcome:
  """What a verified cycle commits, in shapes that do not depend on the tree's size (the path
  padded to max_commit nodes), so that an adaptive cycle's branches all return one and the
  caches are written once, outside them."""
  acc: Accepted  # path_BxC: [B, max_commit]
  path_tokens_BxC: jax.Array
  path_kv: model_lib.Cache  # the path's target K/V per layer, [B, Hkv, max_commit, hd]
  path_features: jax.Array | None  # [B, max_commit, Lf, D]: the drafters' new context
  path_positions_BxC: jax.Array
  tree_size: jax.Array  # nodes verified (a scalar)
  expected_B: jax.Array  # the tree's expected drafts (tree.expected_drafts)
  tally: jax.Array | None  # node_tally, when settings.tally_nodes


def outcome(settings: SpecSettings, state: SpecState, tree: tree_lib.Tree, v: Verified,
            acc: Accepted) -> Outcome:
  """Everything `commit` needs from the verified tree: the accepted path's tokens, K/V,
  features and positions, gathered here so that the tree's own shapes stop at this point."""
  C = settings.max_commit
  pad = C - acc.path_BxC.shape[1]  # a tree of fewer nodes than a path can hold (adaptive)
  path_BxC = jnp.pad(acc.path_BxC, ((0, 0), (0, pad)))  # padding: past the accepted length
  acc = acc.replace(path_BxC=path_BxC)
  take = lambda x_BxT: jnp.take_along_axis(x_BxT, path_BxC, 1)
  features = None
  if settings.drafters:
    features = jnp.take_along_axis(v.features, path_BxC[:, :, None, None], axis=1)
  tally = None
  if settings.tally_nodes:
    tally = tree_lib.node_tally(tree, v.depth_BxT, path_BxC, acc.accept_len_B, settings.gamma)
  return Outcome(acc=acc, path_tokens_BxC=take(tree.tokens_BxT),
                 path_kv=path_rows(v.new_kv, path_BxC, state.cache[0]['k'].shape[-1]),
                 path_features=features,
                 path_positions_BxC=take(v.positions_BxT),
                 tree_size=jnp.asarray(tree.size, jnp.int32),
                 expected_B=tree_lib.expected_drafts(tree), tally=tally)


def commit_outcome(params, settings: SpecSettings, state: SpecState, out: Outcome) -> SpecState:
  """Appends the committed tokens and brings every cache to exactly the committed tokens: the
  target's by writing the accepted path's K/V, the drafters' by writing its target features."""
  gen = settings.generation
  acc = out.acc
  rows = jnp.arange(state.seq_BxL.shape[0])
  live_B = ~state.done_B
  new_BxC, n_commit_B, hit_eos_B = committed_tokens(gen, state, out.path_tokens_BxC, acc)
  j = jnp.arange(new_BxC.shape[1])[None]
  seq = state.seq_BxL.at[rows[:, None], state.seq_len_B[:, None] + j].set(
      jnp.where(j < n_commit_B[:, None], new_BxC, gen.pad_id), mode='drop')
  # Slots past the committed ones may keep stale K/V: attention never reads beyond cache_len.
  cache = write_path(state.cache, out.path_kv, state.cache_len_B)
  draft_caches = state.draft_caches
  if settings.drafters:
    draft_caches = _write_drafter_context(params, settings, draft_caches, out.path_features,
                                          out.path_positions_BxC, state.cache_len_B)
  num_out = state.num_out_B + n_commit_B
  done = state.done_B | (live_B & (hit_eos_B | (num_out >= state.max_new_B)))
  hist = state.accepted_hist_BxC.at[rows, acc.accept_len_B].add(live_B)
  tally = state.node_tally
  if tally is not None:
    tally = tally + jnp.where(live_B[:, None, None, None, None], out.tally, 0.0)
  return state.replace(node_tally=tally, cache=cache, cache_len_B=state.cache_len_B + n_commit_B,
                       seq_BxL=seq, seq_len_B=state.seq_len_B + n_commit_B, num_out_B=num_out,
                       done_B=done, cycles_B=state.cycles_B + live_B,
                       accepted_hist_BxC=hist, steps=state.steps + 1,
                       verified_nodes_B=state.verified_nodes_B + live_B * out.tree_size,
                       expected_B=state.expected_B + jnp.where(live_B, out.expected_B, 0.0),
                       draft_caches=draft_caches)


def commit(params, settings: SpecSettings, state: SpecState, tree: tree_lib.Tree, v: Verified,
           acc: Accepted) -> SpecState:
  """The cycle's commit from its verified tree and accepted path (`outcome`, then
  `commit_outcome`)."""
  return commit_outcome(params, settings, state, outcome(settings, state, tree, v, acc))


def accept_and_commit(params, settings: SpecSettings, state: SpecState, tree: tree_lib.Tree,
                      v: Verified) -> SpecState:
  """accept -> commit as one stage (what the per-stage benchmarks time)."""
  return commit(params, settings, state, tree, v, accept(settings, tree, v, state.cycle_keys[1]))


def spec_step(params, cfg: model_lib.ModelConfig, settings: SpecSettings,
              state: SpecState) -> SpecState:
  """One cycle, top to bottom (adaptive: verify and accept the first n nodes, n chosen by
  adaptive.choice, in the one branch of a lax.switch that runs; then commit. With
  lookup_cycles, a lax.cond first chooses between that and verifying prompt lookup's proposal
  alone, without drafting)."""
  _, accept_key_B = state.cycle_keys  # drafting methods that sample take the other stream

  def decided(tree):  # verify and accept: what to commit, in shapes shared by every size
    verified = verify(params, cfg, settings, state, tree)
    return outcome(settings, state, tree, verified,
                   accept(settings, tree, verified, accept_key_B))

  def drafted():  # the method's tree; adaptive: at the size adaptive.choice picks
    tree = draft(params, cfg, settings, state)
    if not settings.adaptive:
      return decided(tree), state.drafted_Bx2
    # Only the verification differs between sizes; the caches are written once, after the
    # switch, so that no branch carries (and XLA need not copy) the decoding state.
    choice, tokens_B, seconds = adaptive.choice(settings, state, tree)
    return jax.lax.switch(choice, [functools.partial(lambda n: decided(tree_lib.prefix(tree, n)),
                                                     n) for n, _ in settings.node_costs]), (
        adaptive.running(state.drafted_Bx2, tokens_B, seconds, ~state.done_B))
  if not settings.adaptive:
    return commit_outcome(params, settings, state, drafted()[0])
  if not settings.takes_lookup_cycles:
    out, moved = drafted()
    return commit_outcome(params, settings, state.replace(drafted_Bx2=moved), out)
  lookup = lookup_lib.lookup_tree(settings, state)
  alone = adaptive.lookup_wins(settings, state, lookup)
  out, moved = jax.lax.cond(alone, lambda: (decided(lookup), state.drafted_Bx2), drafted)
  return commit_outcome(params, settings, state.replace(
      drafted_Bx2=moved, lookup_only_B=state.lookup_only_B + (alone & ~state.done_B)), out)


def spec_loop(params, cfg: model_lib.ModelConfig, settings: SpecSettings,
              state: SpecState) -> SpecState:
  return jax.lax.while_loop(lambda s: ~jnp.all(s.done_B),
                            lambda s: spec_step(params, cfg, settings, s), state)


def generated(state: SpecState, max_new_tokens: int):
  """[B, max_new_tokens] generated tokens (pad after each row's end); max_new_tokens: the
  settings' bound (or less)."""
  idx = state.prompt_len_B[:, None] + jnp.arange(max_new_tokens)[None]
  return jnp.take_along_axis(state.seq_BxL, idx, 1)
