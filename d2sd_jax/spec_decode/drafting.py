"""Drafting methods: each turns the speculative state into a candidate token tree.

  pld              prompt lookup: what followed the last n-gram's earlier occurrence
  dflash           drafter 1 alone: one chain of gamma-1 tokens from one block
  dflash_resample  + K branches resampled from drafter 1's own per-position distributions
  dflash_dflash    + K branches re-drafted by drafter 1 from its likely rejection points
  d2sd             + K branches re-drafted by drafter 2 (the VP drafter): the method

Branch points (D²SD step 2): with c_k drafter 1's confidence at position k, the probability that
exactly i tokens are accepted is r(i) = c_1 ⋯ c_i (1 - c_{i+1}); the K largest r(i) choose the
branches, each keeping the anchor + the first i tokens and re-drafting the rest.

Deterministic drafts are verified as point masses by sample-and-match, exact for any candidate
tree built without the target's random draws; resampled branches carry their exact proposal
laws and are verified by recursive rejection (see tree.py).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from d2sd_jax.models import drafter as drafter_lib
from d2sd_jax.models import sampling as sampling_lib
from d2sd_jax.spec_decode import lookup as lookup_lib
from d2sd_jax.spec_decode import tree as tree_lib


@dataclasses.dataclass(frozen=True)
class Method:
  """A drafting method: one registry entry says everything the speculative step needs of it."""
  draft: Callable[..., tree_lib.Tree]  # (params, cfg, settings, state) -> candidate Tree
  drafters: tuple[str, ...] = ()  # parameter bundles it reads ('drafter1', 'drafter2')
  # Candidate nodes it produces (the anchor included), before settings.tree_budget cuts them.
  nodes: Callable[..., int] = lambda settings: settings.gamma
  branched: bool = False  # re-drafts settings.n_branches branches (n_branches is checked)
  # The drafter passes of one draft, in order (a drafter's branches go through it together);
  # None: one pass of each drafter it reads. The cost model prices a draft by them.
  passes: tuple[str, ...] | None = None
  # The drafter that re-drafts its branches from the chain's cuts ('' for none): each of
  # settings.branch_passes beyond the first is one more pass of it.
  redrafter: str = ''
  # Its tree is the best tree_budget nodes of a scored pool (any budget >= 2 is meaningful).
  budgeted: bool = False
  # Its pool holds prompt lookup's proposal, scored as `lookup.lookup_scores` scores it: an
  # adaptive cycle may then verify that proposal alone (`lookup.lookup_tree`,
  # SpecSettings.lookup_cycles).
  lookup: bool = False
  # The configurations method='auto' weighs: (registered name, gamma) -> [(label, knobs)], the
  # knobs beyond gamma (which every candidate gets); None: auto leaves the method out (the
  # paper's ablations). A method added with `register` is weighed at its defaults.
  auto: Callable[[str, int], list[tuple[str, dict]]] | None = lambda name, gamma: [(name, {})]

  @property
  def drafter_passes(self) -> tuple[str, ...]:
    return self.drafters if self.passes is None else self.passes


def drafter_passes(settings) -> tuple[str, ...]:
  """The drafter passes of one of `settings`' drafts: its method's, and one more of its
  re-drafter for each of settings.branch_passes beyond the first."""
  method = get(settings.method)
  extra = (method.redrafter,) * (settings.branch_passes - 1) if method.redrafter else ()
  return method.drafter_passes + extra


def _chain_and_branches(settings) -> int:
  return settings.gamma + settings.n_branches * (settings.gamma - 1)


def _budget(settings) -> int:
  """A best-first tree's nodes: the budget, else as many as D2SD's full tree."""
  return settings.tree_budget or _chain_and_branches(settings)


REGISTRY: dict[str, Method] = {}  # filled at the bottom of this module


def register(name: str, method: Method) -> None:
  """Adds a drafting method (e.g. from a notebook or a test); decode.py's `method=` names it."""
  if not isinstance(method, Method):
    raise TypeError(f'{name}: register a drafting.Method, not {type(method).__name__}')
  REGISTRY[name] = method


def get(name: str) -> Method:
  if name not in REGISTRY:
    raise ValueError(f'method {name!r} is not one of {tuple(REGISTRY)}')
  return REGISTRY[name]


def pld(params, cfg, settings, state) -> tree_lib.Tree:
  """Prompt lookup: find an earlier occurrence of the last n committed tokens (the longest n up to
  ngram_max that occurs) and propose the gamma-1 tokens that followed it."""
  del params, cfg
  draft, valid, _ = lookup_lib.lookup(settings, state)
  return tree_lib.chain(state.anchor_B, draft, valid)


def _context(settings, state, name):
  """What drafter `name` attends to of the committed context: every slot ([B] lengths), or with
  spec.drafter_window = W only the last W ([B, S] mask): drafters are trained on windows of a
  few hundred tokens, and a longer context is one they never saw."""
  n_B = state.cache_len_B
  if not settings.drafter_window:
    return n_B
  slots = jnp.arange(state.draft_caches[name][0]['k'].shape[2])[None]
  return (slots < n_B[:, None]) & (slots >= n_B[:, None] - settings.drafter_window)


def _denoise(params, cfg, settings, state, name, tokens_BxKxG, is_mask_BxKxG,
             forbid_BxKxG=None, topk: int = 0):
  """K blocks per row through drafter `name` in one pass, after the committed context
  (forbid: a token each position may not draft, -1 for none); with topk, also each position's
  topk likeliest tokens and their calibrated log-probs ([B, K, G, topk] each)."""
  B, K, G = tokens_BxKxG.shape
  positions = jnp.broadcast_to(state.cache_len_B[:, None, None] + jnp.arange(G), (B, K, G))
  out = drafter_lib.denoise(
      params[name], getattr(settings, name), params['target'], cfg,
      tokens_BxKxG.reshape(B, K * G), is_mask_BxKxG.reshape(B, K * G),
      positions.reshape(B, K * G), state.draft_caches[name], _context(settings, state, name),
      settings.steps,
      settings.order, None if forbid_BxKxG is None else forbid_BxKxG.reshape(B, K * G),
      topk=topk)
  tokens, conf, probs = out[:3]
  shaped = (tokens.reshape(B, K, G), conf.reshape(B, K, G), probs.reshape(B, K, G, -1))
  if topk:
    return shaped + (tuple(x.reshape(B, K, G, topk) for x in out[3]),)
  return shaped


def first_draft(params, cfg, settings, state, topk: int = 0):
  """Drafter 1's block [anchor, MASK ...]: tokens, confidences, distributions ([B, G, ...]);
  with topk, also the per-position top tokens ((log-probs, ids) [B, G, topk])."""
  B, G = state.seq_len_B.shape[0], settings.gamma
  block = jnp.zeros((B, 1, G), jnp.int32).at[:, 0, 0].set(state.anchor_B)
  is_mask = jnp.broadcast_to(jnp.arange(G) > 0, (B, 1, G))
  out = _denoise(params, cfg, settings, state, 'drafter1', block, is_mask, topk=topk)
  first = tuple(x[:, 0] for x in out[:3])
  return first + (tuple(x[:, 0] for x in out[3]),) if topk else first


def dflash(params, cfg, settings, state) -> tree_lib.Tree:
  tokens, _, _ = first_draft(params, cfg, settings, state)
  return tree_lib.chain(state.anchor_B, tokens[:, 1:], jnp.ones_like(tokens[:, 1:], bool))


def branch_points(conf_BxG: jax.Array, n_branches: int) -> jax.Array:
  """The K most likely acceptance lengths i (0..gamma-2) under r(i) = c_1..c_i (1 - c_{i+1})."""
  c = jnp.clip(conf_BxG[:, 1:], 1e-6, 1 - 1e-6)  # c_1 .. c_{G-1}
  log_prefix = jnp.concatenate([jnp.zeros_like(c[:, :1]), jnp.cumsum(jnp.log(c), 1)[:, :-1]], 1)
  log_r = log_prefix + jnp.log1p(-c)  # i = 0 .. G-2
  return jax.lax.top_k(log_r, n_branches)[1].astype(jnp.int32)


def _chain_and_cuts(params, cfg, settings, state):
  """Drafter 1's chain, its distributions, and the K branch prefixes at the likely rejection
  points: (chain [B, G], probs [B, G, V], cut [B, K], prefix tokens [B, K, G], keep [B, K, G],
  first re-drafted position [B, K, G])."""
  G, K = settings.gamma, settings.n_branches
  chain_BxG, conf_BxG, probs_BxGxV = first_draft(params, cfg, settings, state)
  cut_BxK = branch_points(conf_BxG, K)
  k = jnp.arange(G)[None, None]
  keep_BxKxG = k <= cut_BxK[..., None]  # the anchor + the first i chain tokens
  prefix_BxKxG = jnp.where(keep_BxKxG, chain_BxG[:, None], 0)
  first_BxKxG = k == cut_BxK[..., None] + 1
  return chain_BxG, probs_BxGxV, cut_BxK, prefix_BxKxG, keep_BxKxG, first_BxKxG


def redrafts(params, cfg, settings, state, name: str, chain_BxG, cut_BxK, forbid: bool = True):
  """Drafter `name`'s branches [B, K, G] and their confidences [B, K, G] from the K cuts: the
  anchor and the chain up to each cut given, the rest drafted. forbid: the chain's token is
  excluded at each branch's first re-drafted position.

  With settings.branch_passes = P > 1, passes 2..P each see one more re-drafted token (pass 2
  the first pass's first token) and draft the rest again: a single pass leaves the positions
  after a branch's first token unconditioned on it, and with the chain's token excluded there
  they mostly continue the rejected token instead (benchmarks/drafter_quality.py, 'twopass')."""
  G = settings.gamma
  k = jnp.arange(G)[None, None]
  given_BxKxG = k <= cut_BxK[..., None]
  forbid_BxKxG = (jnp.where(k == cut_BxK[..., None] + 1, chain_BxG[:, None], -1) if forbid
                  else None)
  branch_BxKxG, conf_BxKxG, _ = _denoise(params, cfg, settings, state, name,
                                         jnp.where(given_BxKxG, chain_BxG[:, None], 0),
                                         ~given_BxKxG, forbid_BxKxG)
  for p in range(1, settings.branch_passes):
    given_BxKxG = k <= cut_BxK[..., None] + p
    again_BxKxG, conf_again_BxKxG, _ = _denoise(params, cfg, settings, state, name,
                                                jnp.where(given_BxKxG, branch_BxKxG, 0),
                                                ~given_BxKxG)
    branch_BxKxG = jnp.where(given_BxKxG, branch_BxKxG, again_BxKxG)
    conf_BxKxG = jnp.where(given_BxKxG, conf_BxKxG, conf_again_BxKxG)
  return branch_BxKxG, conf_BxKxG


def _chain_and_redrafts(params, cfg, settings, state, name: str):
  """Drafter 1's chain [B, G], the K cuts [B, K], the branches [B, K, G] re-drafted by drafter
  `name` from its likely rejection points (argmax drafts: point masses; `redrafts`) and which
  branches are kept [B, K].

  A re-drafted token equal to the chain's at the branch's first position would repeat a chain
  node: sample-and-match could never enter the branch although it is verified. settings.redraft
  says what to do about it:
    'exclude'  the chain's token is forbidden at that position (the drafter's next choice);
    'merge'    the branch is drafted freely, and while it agrees with the chain it IS the chain:
               its cut moves down to where it first differs (fewer nodes), and it is dropped if
               it never differs or if an earlier branch hangs the same token at that cut."""
  chain_BxG, _, cut_BxK, _, _, _ = _chain_and_cuts(params, cfg, settings, state)
  merge = settings.redraft == 'merge'
  branch_BxKxG, _ = redrafts(params, cfg, settings, state, name, chain_BxG, cut_BxK,
                             forbid=not merge)
  keep_BxK = jnp.ones_like(cut_BxK, bool)
  if merge:
    cut_BxK, keep_BxK = merged_cuts(chain_BxG, branch_BxKxG)
  return chain_BxG, cut_BxK, branch_BxKxG, keep_BxK


def merged_cuts(chain_BxG, branch_BxKxG):
  """(cut [B, K], keep [B, K]) of branches merged into the chain where they agree with it:
  the cut is the last position of the common prefix (branch tokens up to it equal the chain's),
  a branch equal to the chain throughout is not kept, nor one whose first token after its cut
  repeats an earlier kept branch's at the same cut (it would be an unreachable twin)."""
  G, K = chain_BxG.shape[1], branch_BxKxG.shape[1]
  same_BxKxG = branch_BxKxG == chain_BxG[:, None]
  cut_BxK = jnp.sum(jnp.cumprod(same_BxKxG, axis=2), axis=2).astype(jnp.int32) - 1
  keep_BxK = cut_BxK < G - 1
  first_BxK = jnp.take_along_axis(branch_BxKxG, jnp.minimum(cut_BxK + 1, G - 1)[..., None],
                                  2)[..., 0]
  for k in range(1, K):  # K is small: a later twin of a kept branch is dropped
    twin = keep_BxK[:, :k] & (cut_BxK[:, :k] == cut_BxK[:, k:k + 1]) & (
        first_BxK[:, :k] == first_BxK[:, k:k + 1])
    keep_BxK = keep_BxK.at[:, k].set(keep_BxK[:, k] & ~jnp.any(twin, axis=1))
  return cut_BxK, keep_BxK


def _redrafted(params, cfg, settings, state, name: str) -> tree_lib.Tree:
  chain_BxG, cut_BxK, branch_BxKxG, keep_BxK = _chain_and_redrafts(params, cfg, settings, state,
                                                                   name)
  return pack_tree(state.anchor_B, chain_BxG, branch_BxKxG, cut_BxK, settings.tree_size,
                   branch_valid_BxK=keep_BxK)


def dflash_dflash(params, cfg, settings, state) -> tree_lib.Tree:
  """Ablation: the branches re-drafted by drafter 1 itself."""
  return _redrafted(params, cfg, settings, state, 'drafter1')


def d2sd(params, cfg, settings, state) -> tree_lib.Tree:
  """The method: the branches re-drafted by drafter 2 (the variable-prefix drafter)."""
  return _redrafted(params, cfg, settings, state, 'drafter2')


def dflash_resample(params, cfg, settings, state) -> tree_lib.Tree:
  """Ablation: branch tokens drawn independently from drafter 1's own distributions (the
  drafting stream of the cycle's keys), carrying their exact laws so that verification can
  use recursive rejection. The first re-drafted position excludes the chain's token there,
  renormalised; a branch with no mass left (the drafter was certain of the chain's token) is
  dropped rather than drawn from an empty law."""
  chain_BxG, probs_BxGxV, cut_BxK, prefix_BxKxG, keep_BxKxG, first_BxKxG = _chain_and_cuts(
      params, cfg, settings, state)
  B, K, G = prefix_BxKxG.shape
  V = probs_BxGxV.shape[-1]
  is_chain_token = jnp.arange(V) == chain_BxG[:, None, :, None]
  law_BxKxGxV = jnp.where(first_BxKxG[..., None] & is_chain_token, 0.0, probs_BxGxV[:, None])
  mass_BxKxG = jnp.sum(law_BxKxGxV, axis=-1)
  usable_BxK = jnp.all(keep_BxKxG | (mass_BxKxG > 1e-20), axis=-1)
  law_BxKxGxV = jnp.where((mass_BxKxG > 1e-20)[..., None],
                          law_BxKxGxV / jnp.maximum(mass_BxKxG, 1e-20)[..., None],
                          jax.nn.one_hot(chain_BxG[:, None], V))  # never drawn from or tried
  draft_key_B, _ = state.cycle_keys
  # One uniform per position, inverted through the law (no vocabulary-wide Gumbel noise).
  drawn_BxKxG = jax.vmap(lambda key, law: sampling_lib.draw(
      jax.random.uniform(key, law.shape[:-1]), jnp.log(law)))(draft_key_B, law_BxKxGxV)
  branch_BxKxG = jnp.where(keep_BxKxG, prefix_BxKxG, drawn_BxKxG).astype(jnp.int32)
  return pack_tree(state.anchor_B, chain_BxG, branch_BxKxG, cut_BxK, settings.tree_size,
                   branch_laws_BxKxGxV=law_BxKxGxV, branch_valid_BxK=usable_BxK)


def d2sd_pld(params, cfg, settings, state) -> tree_lib.Tree:
  """Beyond the paper: D2SD's tree plus prompt lookup's proposal as one more branch, verified
  in the same pass. It hangs under the deepest chain node it agrees with, and is dropped where
  its first new token repeats a sibling's (chain or drafter-2 branch at the same cut)."""
  chain_BxG, cut_BxK, branch_BxKxG, keep_BxK = _chain_and_redrafts(params, cfg, settings, state,
                                                                   'drafter2')
  lookup = pld(params, cfg, settings, state)  # a chain tree: [anchor, proposal ...]
  agree_BxG = jnp.cumprod(lookup.tokens_BxT == chain_BxG, axis=1).astype(bool)
  lookup_cut_B = jnp.sum(agree_BxG, axis=1) - 1  # deepest chain node on lookup's path
  depth = jnp.arange(settings.gamma)[None]
  first_B = jnp.take_along_axis(lookup.tokens_BxT, jnp.minimum(lookup_cut_B + 1,
                                                              settings.gamma - 1)[:, None], 1)[:, 0]
  repeats = jnp.any(keep_BxK & (cut_BxK == lookup_cut_B[:, None]) &
                    (jnp.take_along_axis(branch_BxKxG, jnp.minimum(cut_BxK + 1, settings.gamma - 1)
                                         [..., None], 2)[..., 0] == first_B[:, None]), axis=1)
  lookup_valid_BxG = lookup.valid_BxT & ~repeats[:, None] & (depth > lookup_cut_B[:, None])
  keep_BxKxG = jnp.broadcast_to(keep_BxK[..., None], branch_BxKxG.shape)
  return pack_tree(state.anchor_B, chain_BxG,
                   jnp.concatenate([branch_BxKxG, lookup.tokens_BxT[:, None]], 1),
                   jnp.concatenate([cut_BxK, lookup_cut_B[:, None]], 1), settings.tree_size,
                   branch_valid_BxK=jnp.concatenate([keep_BxKxG, lookup_valid_BxG[:, None]], 1))


def ddtree(params, cfg, settings, state) -> tree_lib.Tree:
  """DDTree (Ringel et al.): the tree_size - 1 likeliest prefixes under the product of drafter
  1's calibrated per-position marginals, from drafter 1's one block (tree.beam_pool), through
  drafter 1's reliability curve where it carries one (SpecSettings.node_calibration)."""
  W = settings.tree_size - 1
  _, _, _, (logp_BxGxW, ids_BxGxW) = first_draft(params, cfg, settings, state, topk=W)
  token, parent, score, depth = tree_lib.beam_pool(logp_BxGxW, ids_BxGxW)
  source = jnp.zeros_like(token)
  score = tree_lib.fall_along_paths(tree_lib.calibrate(
      score, source, depth, settings.node_calibration), parent, settings.gamma)
  return tree_lib.best_of_pool(state.anchor_B, token, parent, score, depth, settings.tree_size,
                               settings.gamma, source_BxP=source)


def _beam_paths(token_BxP, parent_BxP, G: int, W: int):
  """[B, P, G-1] the token path of every beam_pool node (its depth's tokens, then padding)."""
  B = token_BxP.shape[0]
  rows = jnp.arange(B)[:, None]
  path = jnp.zeros((B, W, G - 1), jnp.int32).at[:, :, 0].set(token_BxP[:, :W])
  paths = [path]
  for d in range(2, G):
    block = slice((d - 1) * W, d * W)
    prev = path[rows, parent_BxP[:, block] - (d - 2) * W]
    path = prev.at[:, :, d - 1].set(token_BxP[:, block])
    paths.append(path)
  return jnp.concatenate(paths, 1)


def d2sd_tree(params, cfg, settings, state) -> tree_lib.Tree:
  """One pool from every proposer, then the best tree_size - 1 nodes by the estimated
  probability of being reached and accepted (all point masses: sample-and-match verifies it):

    drafter 1's marginals   DDTree's beams, and drafter 1's chain: log-probability = the sum
                            of the calibrated log-probs of the path's tokens;
    drafter 2's re-drafts   from the K likeliest rejection points i of the chain, the chain's
                            token at i+1 excluded: P(chain prefix accepted) x (1 - c1_{i+1}) x
                            drafter 2's calibrated confidences along the branch;
    prompt lookup           its proposal, a^d at depth d, a = settings.lookup_accept[n - 1]
                            for a match of n tokens.
  A node proposed twice is one node with the higher score (tree.merge_paths). Each proposer's
  scores go through its reliability curve where the drafters carry one (tree.calibrate,
  SpecSettings.node_calibration), and are then capped by their parents' along every path."""
  G, K, W = settings.gamma, settings.n_branches, settings.tree_size - 1
  B = state.seq_len_B.shape[0]
  chain_BxG, conf_BxG, _, (logp_BxGxW, ids_BxGxW) = first_draft(params, cfg, settings, state,
                                                               topk=W)
  # Drafter 1: the beams and the chain (whose nodes the branches hang from).
  b_token, b_parent, b_score, b_depth = tree_lib.beam_pool(logp_BxGxW, ids_BxGxW)
  b_path = _beam_paths(b_token, b_parent, G, W)
  chain_logp_BxN = logp_BxGxW[:, 1:, 0]  # the chain token is each position's likeliest
  chain_score_BxN = jnp.cumsum(chain_logp_BxN, axis=1)  # depth 1..G-1
  depth_N = jnp.arange(1, G, dtype=jnp.int32)
  c_path = jnp.broadcast_to(chain_BxG[:, None, 1:], (B, G - 1, G - 1))
  # Drafter 2: branches from the likely rejection points, the chain's token excluded there.
  cut_BxK = branch_points(conf_BxG, K)
  branch_BxKxG, conf2_BxKxG = redrafts(params, cfg, settings, state, 'drafter2', chain_BxG,
                                       cut_BxK)
  at_cut = lambda x_BxN: jnp.take_along_axis(
      jnp.pad(x_BxN, ((0, 0), (1, 0))), cut_BxK, 1)  # x at depth cut (0 at the anchor)
  reject_next = jnp.log1p(-jnp.minimum(jnp.exp(jnp.take_along_axis(
      chain_logp_BxN, cut_BxK, 1)), 1 - 1e-6))  # log(1 - c1 at depth cut + 1)
  r_score = (at_cut(chain_score_BxN) + reject_next)[..., None] + jnp.cumsum(
      jnp.log(jnp.maximum(conf2_BxKxG[:, :, 1:], 1e-30)), axis=2)
  r_score = jnp.where(depth_N[None, None] > cut_BxK[..., None], r_score, -jnp.inf)
  r_path = jnp.broadcast_to(branch_BxKxG[:, :, None, 1:], (B, K, G - 1, G - 1))
  # Prompt lookup.
  l_draft, l_valid, l_score = lookup_lib.lookup_scores(settings, state)
  l_path = jnp.broadcast_to(l_draft[:, None], (B, G - 1, G - 1))
  # One pool, merged, and its best nodes.
  path = jnp.concatenate([c_path, b_path, r_path.reshape(B, K * (G - 1), G - 1), l_path], 1)
  score = jnp.concatenate([chain_score_BxN, b_score, r_score.reshape(B, K * (G - 1)), l_score], 1)
  depth = jnp.concatenate([jnp.broadcast_to(depth_N, (B, G - 1)), b_depth,
                           jnp.broadcast_to(jnp.tile(depth_N, K), (B, K * (G - 1))),
                           jnp.broadcast_to(depth_N, (B, G - 1))], 1)
  n_d1 = (G - 1) + b_token.shape[1]
  source = jnp.broadcast_to(jnp.concatenate([
      jnp.full((n_d1,), 0, jnp.int32), jnp.full((K * (G - 1),), 1, jnp.int32),
      jnp.full((G - 1,), 2, jnp.int32)]), score.shape)
  score = tree_lib.calibrate(score, source, depth, settings.node_calibration)
  token, parent, merged, source = tree_lib.merge_paths(path, depth, score, source)
  merged = tree_lib.fall_along_paths(merged, parent, G)
  return tree_lib.best_of_pool(state.anchor_B, token, parent, merged, depth, settings.tree_size,
                               G, source_BxP=source)


def pack_tree(anchor_B, chain_BxG, branches_BxKxG, cut_BxK, size: int,
              branch_laws_BxKxGxV=None, branch_valid_BxK=None) -> tree_lib.Tree:
  """Chain nodes 1..G-1, then each branch's re-drafted tokens (positions > its cut), in order,
  until `size` nodes: a branch of cut i hangs under chain node i (the anchor for i = 0).
  With `branch_laws`, the tree carries each node's proposal law (chain nodes: point masses);
  `branch_valid` ([B, K] or per position [B, K, G]) marks nodes never to be accepted."""
  B, K, G = branches_BxKxG.shape
  p = jnp.arange(G)
  new = p[None, None] > cut_BxK[..., None]  # [B, K, G]
  length = G - 1 - cut_BxK  # re-drafted tokens per branch
  offset = G + jnp.cumsum(length, 1) - length  # first node index of each branch
  dest = jnp.where(new, offset[..., None] + p - cut_BxK[..., None] - 1, size)  # size = dropped
  prev = jnp.concatenate([jnp.full((B, K, 1), size), dest[..., :-1]], axis=2)
  parent = jnp.where(p == cut_BxK[..., None] + 1, cut_BxK[..., None], prev)
  tokens = jnp.zeros((B, size), jnp.int32).at[:, :G].set(chain_BxG.at[:, 0].set(anchor_B))
  parents = jnp.zeros((B, size), jnp.int32).at[:, 1:G].set(jnp.arange(G - 1))
  valid = jnp.zeros((B, size), bool).at[:, :G].set(True)
  rows = jnp.arange(B)[:, None]
  flat = lambda x: x.reshape(B, K * G)
  tokens = tokens.at[rows, flat(dest)].set(flat(branches_BxKxG), mode='drop')
  parents = parents.at[rows, flat(dest)].set(flat(parent).astype(jnp.int32), mode='drop')
  ok = jnp.ones((B, K), bool) if branch_valid_BxK is None else branch_valid_BxK
  ok_BxKxG = jnp.broadcast_to(ok if ok.ndim == 3 else ok[..., None], (B, K, G))
  valid = valid.at[rows, flat(dest)].set(flat(ok_BxKxG), mode='drop')
  q = None
  if branch_laws_BxKxGxV is not None:
    V = branch_laws_BxKxGxV.shape[-1]
    q = jnp.zeros((B, size, V), jnp.float32).at[:, :G].set(jax.nn.one_hot(tokens[:, :G], V))
    q = q.at[rows, flat(dest)].set(branch_laws_BxKxGxV.reshape(B, K * G, V), mode='drop')
  return tree_lib.Tree(tokens_BxT=tokens, parents_BxT=parents, valid_BxT=valid, q_BxTxV=q)


# Node budgets auto weighs for the best-first trees, the anchor included (what the hardware
# decides: verifying N nodes costs little more than one on an accelerator, several AR steps on
# a CPU).
TREE_BUDGETS = (4, 8, 12, 16, 32, 64)


def _auto_branches(counts):
  """auto's candidates of a branched method: K branches for each K in `counts` that fits."""
  return lambda name, gamma: [(f'{name}(K={k})', {'n_branches': k}) for k in counts
                              if k <= gamma - 1]


# The budget of the adaptive tree auto weighs beside the fixed ones (its cycles verify fewer
# nodes where that pays, or prompt lookup's proposal alone: SpecSettings.adaptive).
ADAPTIVE_BUDGET = 32


def _auto_budgets(branches: bool, adaptive: bool = False):
  """auto's candidates of a best-first tree: one per node budget (with K = min(4, gamma-1)
  branches where the tree has them), and with `adaptive` the adaptive tree of ADAPTIVE_BUDGET
  nodes."""
  def candidates(name, gamma):
    k = {'n_branches': min(4, gamma - 1)} if branches else {}
    out = [(f'{name}(N={n})', {'tree_budget': n, **k}) for n in TREE_BUDGETS]
    if adaptive:
      out.append((f'{name}(adaptive)', {'tree_budget': ADAPTIVE_BUDGET, 'adaptive': True, **k}))
    return out
  return candidates


register('pld', Method(pld, auto=lambda name, gamma: [(f'{name}(gamma={gamma})', {})]))
register('dflash', Method(dflash, drafters=('drafter1',)))
register('dflash_resample', Method(dflash_resample, ('drafter1',), _chain_and_branches,
                                   branched=True, auto=None))
register('dflash_dflash', Method(dflash_dflash, ('drafter1',), _chain_and_branches, branched=True,
                                 passes=('drafter1', 'drafter1'), redrafter='drafter1',
                                 auto=None))
register('d2sd', Method(d2sd, ('drafter1', 'drafter2'), _chain_and_branches, branched=True,
                        redrafter='drafter2', auto=_auto_branches((1, 2, 4))))
register('ddtree', Method(ddtree, ('drafter1',), _budget, budgeted=True,
                          auto=_auto_budgets(branches=False)))
register('d2sd_tree', Method(d2sd_tree, ('drafter1', 'drafter2'), _budget, branched=True,
                             redrafter='drafter2', budgeted=True, lookup=True,
                             auto=_auto_budgets(branches=True, adaptive=True)))
# the hybrid: D²SD's tree plus prompt lookup's proposal as one more branch
register('d2sd_pld', Method(d2sd_pld, ('drafter1', 'drafter2'),
                            lambda s: _chain_and_branches(s) + s.gamma - 1, branched=True,
                            redrafter='drafter2',
                            auto=_auto_branches((1, 4))))
