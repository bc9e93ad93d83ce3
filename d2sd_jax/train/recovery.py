"""What D²SD's second draft recovers, teacher-forced on the target's own text.

At every anchor of a sequence the target wrote (its greedy completion), drafter 1's chain is
drafted as decoding drafts it, and its first rejection i* (drafts accepted, 0..G-1) is read off
the labels. The only branch that can add tokens in that cycle is the one cut at i*: a branch
cut earlier re-drafts a token the chain had right, one cut later keeps a wrong one. So for each
re-drafter (drafter 2, or drafter 1 reused) the block [anchor, the i* accepted drafts, MASK ...]
is drafted and we count the tokens its branch adds from the cut, under both of decoding's rules
for a first re-drafted token equal to the chain's (spec_decode/drafting.py):
  exclude  the chain's token is forbidden there: the re-drafter's next choice;
  merge    the branch is drafted freely; equal to the chain's (rejected) token, it adds nothing.
  twopass  as exclude, then the positions after the forced token drafted again in a second pass
           that sees it (spec.branch_passes=2): one pass leaves them unconditioned on it, and
           they mostly continue the rejected token instead.
Also whether i* is among the K cuts that r(i) = c_1..c_i (1 - c_{i+1}) selects (the branch is
drafted at all), by cut depth and by context length.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from d2sd_jax.train import losses

RULES = ('exclude', 'merge', 'twopass')


@functools.partial(jax.jit, static_argnums=(1, 3))
def block_top2(dparams, dcfg, tparams, tcfg, feats_1xLxF, tokens_1xL, anchors_1xA, prefix_len):
  """The drafter's two likeliest tokens [A, G, 2] (token ids) and its top-1 probability
  [A, G] at each position of the blocks [anchor, its next `prefix_len` tokens, MASK ...]."""
  A, G = anchors_1xA.shape[1], dcfg.gamma
  prefix = jnp.full_like(anchors_1xA, prefix_len)
  tokens, is_mask, positions, _ = losses.block_inputs(tokens_1xL, anchors_1xA, prefix, G)
  logits = losses.block_logits(dparams, dcfg, tparams, tcfg, feats_1xLxF, tokens, is_mask,
                               positions, anchors_1xA, head_only=True)
  probs = jax.nn.softmax(logits.astype(jnp.float32), -1)
  top_p, top_i = jax.lax.top_k(probs, 2)
  if 'head_ids' in dparams:
    top_i = dparams['head_ids'][top_i]
  return top_i.reshape(A, G, 2), top_p[..., 0].reshape(A, G)


def leading_matches(draft_N, labels_N, ok_N) -> int:
  """How many drafts agree with valid labels before the first that does not."""
  hit = (np.asarray(draft_N) == np.asarray(labels_N)) & np.asarray(ok_N)
  return int(np.cumprod(hit).sum())


def selected_cuts(conf_G, n_branches: int) -> set:
  """The K cuts D²SD selects from drafter 1's confidences (drafting.branch_points, in numpy)."""
  c = np.clip(np.asarray(conf_G, np.float64)[1:], 1e-6, 1 - 1e-6)
  log_r = np.concatenate([[0.0], np.cumsum(np.log(c))[:-1]]) + np.log1p(-c)
  return set(np.argsort(-log_r, kind='stable')[:n_branches].tolist())


def branch_gain(top2_GxK, chain_G, cut: int, labels_G, ok_G, rule: str,
                second_GxK=None) -> int:
  """Tokens a branch cut at `cut` adds, its first re-drafted token chosen by `rule`. twopass:
  second_GxK is the re-drafter's block with one more label given (prefix cut + 1): when the
  forced token is the label, that is exactly the block its second pass drafts."""
  first = top2_GxK[cut + 1]
  if rule == 'merge' and first[0] == chain_G[cut + 1]:  # the branch repeats the rejected token
    return 0
  token = first[1] if first[0] == chain_G[cut + 1] else first[0]  # exclude's (and twopass')
  if rule == 'twopass':  # the continuation from the pass that sees the token (when it is right)
    right = bool(ok_G[cut + 1] and token == labels_G[cut + 1])
    if not right or second_GxK is None:  # (None: the token is the block's last position)
      return int(right)
    return 1 + leading_matches(second_GxK[cut + 2:, 0], labels_G[cut + 2:], ok_G[cut + 2:])
  draft = np.concatenate([[token], top2_GxK[cut + 2:, 0]])
  return leading_matches(draft, labels_G[cut + 1:], ok_G[cut + 1:])


class Tally:
  """Cycles and branch gains by cut depth (and by context-length bucket)."""

  def __init__(self, gamma: int, names, buckets):
    self.G, self.names, self.buckets = gamma, list(names), list(buckets)
    shape = (len(self.buckets) + 1, gamma)  # the last bucket row: all contexts
    self.cycles = np.zeros(shape)
    self.covered = np.zeros(shape)
    self.gain = {(n, r): np.zeros(shape) for n in self.names for r in RULES}

  def bucket(self, context: int) -> int:
    return next((i for i, b in enumerate(self.buckets) if context <= b), len(self.buckets) - 1)

  def add(self, context: int, cut: int, covered: bool, gains: dict):
    for row in (self.bucket(context), -1):
      self.cycles[row, cut] += 1
      self.covered[row, cut] += covered
      for key, g in gains.items():
        self.gain[key][row, cut] += g

  def table(self, row: int = -1) -> dict:
    """The rejection distribution and, per cut depth, the mean tokens each re-drafter's branch
    adds there (and per cycle, weighted by how often each cut is the true one)."""
    n = self.cycles[row]
    total = max(n.sum(), 1)
    cuts = []
    for i in range(self.G - 1):
      entry = {'cut': i, 'cycles': int(n[i]), 'share': round(float(n[i] / total), 4),
               'covered': round(float(self.covered[row, i] / max(n[i], 1)), 4)}
      for (name, rule), g in self.gain.items():
        entry[f'{name}_{rule}'] = round(float(g[row, i] / max(n[i], 1)), 4)
      cuts.append(entry)
    per_cycle = {f'{name}_{rule}': round(float(g[row, :self.G - 1].sum() / total), 4)
                 for (name, rule), g in self.gain.items()}
    covered_cycle = {f'{name}_{rule}': round(float(
        sum(g[row, i] * self.covered[row, i] / max(n[i], 1) for i in range(self.G - 1)) /
        total), 4) for (name, rule), g in self.gain.items()}
    return {'cycles': int(total), 'accepted_whole': round(float(n[self.G - 1] / total), 4),
            'rejection': [round(float(x / total), 4) for x in n],
            'by_cut': cuts, 'gain_per_cycle': per_cycle,
            'gain_per_cycle_if_selected': covered_cycle}


def measure(seqs, target, drafters: dict, features_fn, n_branches: int, buckets, pad_id: int,
            bucket_len: int = 64) -> Tally:
  """Teacher-forced recovery over `seqs` [(tokens, n_prompt)]: drafters {'drafter1': (cfg,
  params), ...} (drafter 1 drafts the chain; every drafter re-drafts)."""
  d1cfg, d1params = drafters['drafter1']
  G = d1cfg.gamma
  tally = Tally(G, drafters, buckets)
  for tokens, n_prompt in seqs:
    L = len(tokens)
    padded = -(-L // bucket_len) * bucket_len
    tok = np.full((1, padded), pad_id, np.int32)
    tok[0, :L] = tokens
    feats = features_fn(target.params, tok)
    anchors = np.arange(n_prompt - 1, L - 1)  # every block whose drafts are completion tokens
    A = -(-len(anchors) // bucket_len) * bucket_len  # padded: a few programs for all lengths
    anchors_1xA = np.minimum(np.concatenate([anchors, np.full(A - len(anchors), L - 1)]),
                             L - 1)[None].astype(np.int32)
    chain_top2, chain_conf = map(np.asarray, block_top2(d1params, d1cfg, target.params,
                                                        target.cfg, feats, tok, anchors_1xA, 0))
    chain = chain_top2[..., 0]
    pos = anchors[:, None] + np.arange(G)[None]
    labels = np.where(pos < L, tok[0, np.minimum(pos, padded - 1)], -1)
    ok = (pos < L) & (pos >= n_prompt)
    n = len(anchors)
    cut = np.array([leading_matches(chain[a, 1:], labels[a, 1:], ok[a, 1:]) for a in range(n)])
    redrafts = {}
    for name, (dcfg, dparams) in drafters.items():
      # (prefix i + 1: the twopass rule's second pass at cut i)
      for i in sorted(set(cut[cut < G - 1].tolist()) | set((cut[cut < G - 2] + 1).tolist())):
        redrafts[name, i] = np.asarray(block_top2(dparams, dcfg, target.params, target.cfg,
                                                  feats, tok, anchors_1xA, i)[0])
    for a in range(n):
      i = int(cut[a])
      if i == G - 1:
        tally.add(int(anchors[a]) + 1, i, False, {})
        continue
      covered = i in selected_cuts(chain_conf[a], n_branches)
      gains = {(name, rule): branch_gain(
          redrafts[name, i][a], chain[a], i, labels[a], ok[a], rule,
          redrafts[name, i + 1][a] if i < G - 2 else None)
               for name in drafters for rule in RULES}
      tally.add(int(anchors[a]) + 1, i, covered, gains)
  return tally


def check_alike(drafters: dict) -> None:
  """Re-drafters must draft the block drafter 1 drafts from the same features."""
  d1 = drafters['drafter1'][0]
  for name, (dcfg, _) in drafters.items():
    if dcfg.gamma != d1.gamma or tuple(dcfg.feature_layers) != tuple(d1.feature_layers):
      raise SystemExit(f'{name} differs from drafter 1 in gamma or feature layers: compare '
                       'drafters built alike')


def rejection_prior(tally: Tally) -> str:
  """The measured first-rejection distribution over cuts 0..G-2, as loss.prefix_prior takes it."""
  n = tally.cycles[-1, :tally.G - 1]
  return ','.join(f'{x:.3f}' for x in n / max(n.sum(), 1))

