"""Best-first trees (d2sd_jax/spec_decode/tree.py's beam_pool, best_of_pool and merge_paths, and
the ddtree and d2sd_tree methods built on them): the chosen nodes are the likeliest ones, by
enumeration and by an independent reference of each proposer's scores; duplicates merge;
lossless. d2sd_tree's pool (a method of drafting.py) is checked here, with the enumeration
helpers it shares with the tree checks."""

import heapq
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from d2sd_jax.spec_decode import ar as AR
from d2sd_jax.spec_decode import drafting
from d2sd_jax.spec_decode import speculative as SP
from d2sd_jax.spec_decode import tree as tree_lib
from tests.helpers import loop_checks as H
from tests.helpers.tiny_drafters import PROMPTS, tree_spec


def node_paths(tree, b):
  """{path tuple below the anchor: node} of row b's valid nodes, by walking parents."""
  tokens, parents = np.asarray(tree.tokens_BxT[b]), np.asarray(tree.parents_BxT[b])
  valid = np.asarray(tree.valid_BxT[b])
  paths = {0: ()}
  for j in range(1, len(tokens)):
    assert parents[j] < j, 'a parent must precede its child'
    paths[j] = paths[int(parents[j])] + (int(tokens[j]),)
  return {paths[j]: j for j in range(1, len(tokens)) if valid[j]}


def best_prefixes(logp_GxV, m):
  """The m likeliest prefixes (depth 1..G-1) under independent per-position marginals, by
  enumerating every prefix: [(log-prob, path)], best first."""
  G, V = logp_GxV.shape
  found = []
  for d in range(1, G):
    for path in itertools.product(range(V), repeat=d):
      found.append((sum(logp_GxV[k + 1, t] for k, t in enumerate(path)), path))
  return sorted(found, key=lambda x: -x[0])[:m]


@pytest.mark.parametrize('m', [1, 6, 20])
def test_beam_pool_finds_the_likeliest_prefixes_by_enumeration(m):
  """DDTree's tree = the m likeliest prefixes of every depth, found by enumerating all of
  them (V = 5, depth <= 3: 155 prefixes), on random marginals; ordered parents first. A beam
  narrower than m, an expansion by fewer than m tokens, or a per-depth instead of a global
  top-m fails it."""
  rng = np.random.default_rng(m)
  B, G, V = 3, 4, 5
  logp = jax.nn.log_softmax(jnp.asarray(rng.normal(0, 2, (B, G, V)), jnp.float32))
  top_logp, top_ids = jax.lax.top_k(logp, min(m, V))
  if m > V:  # denoise pads like this when asked for more tokens than exist
    top_logp = jnp.pad(top_logp, ((0, 0), (0, 0), (0, m - V)), constant_values=-jnp.inf)
    top_ids = jnp.pad(top_ids, ((0, 0), (0, 0), (0, m - V)))
  pool = tree_lib.beam_pool(top_logp, top_ids)
  tree = tree_lib.best_of_pool(jnp.full((B,), 7), *pool, size=m + 1, max_depth=G)
  assert tree.size == m + 1
  for b in range(B):
    want = best_prefixes(np.asarray(logp[b], np.float64), m)
    assert set(node_paths(tree, b)) == {path for _, path in want}, b
    assert int(tree.tokens_BxT[b, 0]) == 7
    # Each node carries its prefix's log-probability, and the tree expects to commit their sum
    # of probabilities (a score of the wrong node, or a sum over the pool, fails it).
    score_of = {path: lp for lp, path in want}
    for path, j in node_paths(tree, b).items():
      np.testing.assert_allclose(float(tree.score_BxT[b, j]), score_of[path], rtol=1e-5,
                                 atol=1e-5)
    np.testing.assert_allclose(float(tree_lib.expected_drafts(tree)[b]),
                               sum(np.exp(lp) for lp, _ in want), rtol=1e-5)


def test_best_of_pool_invalidates_what_hangs_under_an_unchosen_node():
  """A child scoring above its parent (which best-first scores never do, but ties can) hangs
  under a node that was not chosen: it and its subtree are never accepted; -inf nodes too."""
  # pool: 0 = a (depth 1), 1 = b (depth 1), 2 = a/c (depth 2), 3 = a/c/d (depth 3)
  token = jnp.asarray([[10, 11, 12, 13]])
  parent = jnp.asarray([[-1, -1, 0, 2]])
  depth = jnp.asarray([[1, 1, 2, 3]])
  score = jnp.asarray([[-3.0, -1.0, -0.5, -0.6]])  # a loses to its own descendants
  tree = tree_lib.best_of_pool(jnp.asarray([5]), token, parent, score, depth, size=4, max_depth=4)
  got = {tuple(np.asarray(tree.tokens_BxT[0, [j]]).tolist()): bool(tree.valid_BxT[0, j])
         for j in range(1, 4)}
  assert got == {(11,): True, (12,): False, (13,): False}
  # nodes that can never be accepted add nothing to what the tree expects to commit
  np.testing.assert_allclose(float(tree_lib.expected_drafts(tree)[0]), np.exp(-1.0), rtol=1e-6)
  tree = tree_lib.best_of_pool(jnp.asarray([5]), token, parent,
                               jnp.asarray([[-1.0, -jnp.inf, -2.0, -3.0]]), depth, size=4,
                               max_depth=4)
  assert set(node_paths(tree, 0)) == {(10,), (10, 12), (10, 12, 13)}
  np.testing.assert_allclose(float(tree_lib.expected_drafts(tree)[0]),
                             np.exp(-1.0) + np.exp(-2.0) + np.exp(-3.0), rtol=1e-6)
  assert float(tree_lib.expected_drafts(tree_lib.chain(jnp.asarray([5]), token, token > 0))[0]) == 0


def test_merge_paths_keeps_one_node_per_path_with_the_best_score():
  """Against a dict of paths: each distinct path once, at its lowest pool index, with the max
  score of its copies and that copy's proposer, its parent the node of its prefix."""
  rng = np.random.default_rng(0)
  B, P, N = 2, 40, 3
  depth = rng.integers(1, N + 1, (B, P))
  path = rng.integers(0, 2, (B, P, N))  # 2 tokens: many repeats
  # Whole paths: every prefix of a pool path is in the pool too (append them).
  extra = [(b, path[b, p, :d]) for b in range(B) for p in range(P) for d in range(1, depth[b, p])]
  P2 = P + max(sum(1 for x in extra if x[0] == b) for b in range(B))
  full_path = np.zeros((B, P2, N), np.int64)
  full_depth = np.ones((B, P2), np.int64)
  full_score = np.full((B, P2), -50.0)
  for b in range(B):
    rows = [(path[b, p], depth[b, p]) for p in range(P)] + [
        (np.pad(pre, (0, N - len(pre))), len(pre)) for bb, pre in extra if bb == b]
    rows += [(np.zeros(N, np.int64), 1)] * (P2 - len(rows))
    for p, (pa, d) in enumerate(rows):
      full_path[b, p], full_depth[b, p] = pa, d
  full_score[:, :P] = rng.normal(-5, 2, (B, P))
  full_source = rng.integers(0, 3, (B, P2))
  token, parent, merged, source = tree_lib.merge_paths(
      jnp.asarray(full_path), jnp.asarray(full_depth), jnp.asarray(full_score, jnp.float32),
      jnp.asarray(full_source, jnp.int32))
  for b in range(B):
    best, first, by = {}, {}, {}
    for p in range(P2):
      key = tuple(full_path[b, p, :full_depth[b, p]].tolist())
      if full_score[b, p] > best.get(key, -np.inf):
        best[key], by[key] = full_score[b, p], full_source[b, p]
      first.setdefault(key, p)
    kept = {p: key for key, p in first.items()}
    for p in range(P2):
      if p not in kept:
        assert merged[b, p] == -np.inf, (b, p)
        continue
      key = kept[p]
      np.testing.assert_allclose(float(merged[b, p]), best[key], rtol=1e-6)
      assert int(source[b, p]) == by[key], (b, p)
      assert int(token[b, p]) == key[-1]
      assert int(parent[b, p]) == (first[key[:-1]] if len(key) > 1 else -1), (b, p, key)


# ----------------------------------------------------------------------------------------------
# The methods on the tiny target and drafters


def row_reference(spec, ref):
  """d2sd_tree's pool for a row, from `ref` (H.drafter_logits_reference: one fresh forward of
  each drafter) and prompt lookup's proposal, merged by a dict: {path: log score}."""
  lp1 = ref['logp1']  # [G, V] drafter 1's calibrated log-probs
  G = spec.gamma
  m = spec.tree_size - 1
  pool = {}

  def add(path, score):
    pool[path] = max(pool.get(path, -np.inf), score)

  for score, path in best_prefixes_heap(lp1, m):
    add(path, score)
  chain = ref['chain']
  chain_score = np.concatenate([[0.0], np.cumsum([lp1[k, chain[k]] for k in range(1, G)])])
  for d in range(1, G):
    add(tuple(chain[1:d + 1]), chain_score[d])
  c1 = np.exp([lp1[k, chain[k]] for k in range(G)])
  for cut, branch, conf2 in ref['branches']:
    score = chain_score[cut] + np.log1p(-min(c1[cut + 1], 1 - 1e-6))
    for d in range(cut + 1, G):
      score += np.log(max(conf2[d], 1e-30))
      add(tuple(branch[1:d + 1]), score)
  draft, valid, n = ref['lookup']
  if n > 0:
    a = spec.lookup_accept[min(n, len(spec.lookup_accept)) - 1]
    for d in range(1, G):
      if valid[d - 1]:
        add(tuple(draft[:d]), d * np.log(a))
  return pool


def best_prefixes_heap(logp_GxV, m):
  """The m likeliest prefixes under independent marginals, best-first from the anchor (a heap:
  exact, since scores fall along every path)."""
  G, V = logp_GxV.shape
  heap = [(-logp_GxV[1, t], (t,)) for t in range(V) if np.isfinite(logp_GxV[1, t])]
  heapq.heapify(heap)
  out = []
  while heap and len(out) < m:
    neg, path = heapq.heappop(heap)
    out.append((-neg, path))
    if len(path) < G - 1:
      for t in range(V):
        if np.isfinite(logp_GxV[len(path) + 1, t]):
          heapq.heappush(heap, (neg - logp_GxV[len(path) + 1, t], path + (t,)))
  return out


@pytest.mark.parametrize('budget', [6, 12])
def test_d2sd_tree_holds_the_best_nodes_of_every_proposer(tiny, trained, budget):
  """Over a few cycles on PROMPTS, d2sd_tree's nodes are the budget - 1 best of the merged
  pool, each proposer scored independently of drafting.py (reference logits, a heap for the
  marginals' best prefixes). Rows whose M-th and (M+1)-th scores are within float32 rounding
  of each other are not compared (either choice is right); most rows are."""
  cfg, _ = tiny
  spec = tree_spec('d2sd_tree', budget, max_new=30, lookup_accept=(0.3, 0.5, 0.8))
  init, draft, _, _, _ = H._stage_programs()
  step = jax.jit(SP.spec_step, static_argnames=('cfg', 'settings'))
  block, lens = AR.pad_prompts(PROMPTS, 0, bucket=8)
  state = init(trained, cfg, spec, block, lens, AR.row_keys(0, range(3)),
               SP.cache_size_needed(block.shape[1], spec))
  compared, sources = 0, {'branch': 0, 'lookup': 0}
  for _ in range(4):
    tree = draft(trained, cfg, spec, state)
    for b in range(3):
      if bool(state.done_B[b]):
        continue
      ref = H.drafter_logits_reference(tiny, trained, spec, state, b)
      pool = row_reference(spec, ref)
      ranked = sorted(pool.items(), key=lambda x: -x[1])
      m = spec.tree_size - 1
      if len(ranked) > m and ranked[m - 1][1] - ranked[m][1] < 1e-4:
        continue
      got = set(node_paths(tree, b))
      assert got == {p for p, _ in ranked[:m]}, (b, sorted(got), ranked[:m + 2])
      compared += 1
      sources['branch'] += any(tuple(br[1:d + 1]) in got for cut, br, _ in ref['branches']
                               for d in range(cut + 1, spec.gamma)
                               if tuple(br[1:d + 1]) not in dict(best_prefixes_heap(
                                   ref['logp1'], m)).values())
      draft_, valid, n = ref['lookup']
      sources['lookup'] += n > 0 and valid[0] and tuple(draft_[:1]) in got
    state = step(trained, cfg, spec, state)
  assert compared >= 6, compared
  assert sources['branch'] > 0 and sources['lookup'] > 0, sources  # every proposer contributes


@pytest.mark.parametrize('method,budget', [
    ('ddtree', 8), ('d2sd_tree', 8), pytest.param('ddtree', 0, marks=pytest.mark.slow),
    pytest.param('d2sd_tree', 0, marks=pytest.mark.slow), ('d2sd_tree', 2)])
def test_tree_methods_equal_ar(tiny, trained, method, budget):
  """Output = AR greedy and the caches equal a fresh prefill after every cycle, with accepted
  paths that leave drafter 1's chain (the chain recomputed by drafting.first_draft)."""
  cfg, params = tiny
  spec = tree_spec(method, budget)
  assert spec.tree_size == (budget or 5 + 3 * 4)
  bundle = SP.prepare(trained, cfg)
  chain_of = jax.jit(lambda state: drafting.first_draft(bundle, cfg, spec, state)[0])
  off_chain = [0]

  def on_cycle(state, tree, acc, new_state):
    chain = np.asarray(chain_of(state))
    for b in np.flatnonzero(~np.asarray(state.done_B)):
      n = int(acc.accept_len_B[b])
      path = np.asarray(tree.tokens_BxT[b])[np.asarray(acc.path_BxC[b])[1:n + 1]]
      off_chain[0] += bool(np.any(path != chain[b, 1:n + 1]))
    # each live row adds what this cycle's tree expected to commit; a finished row adds nothing
    live = ~np.asarray(state.done_B)
    np.testing.assert_allclose(np.asarray(new_state.expected_B - state.expected_B),
                               np.where(live, np.asarray(tree_lib.expected_drafts(tree)), 0.0),
                               rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(tree_lib.expected_drafts(tree))[live] > 0)

  outs, counts = H.run_cycles(cfg, bundle, spec, PROMPTS, on_cycle=on_cycle)
  assert outs == H.ar_outputs(cfg, params, PROMPTS, spec.generation)
  if budget == 2:  # one draft node: drafter 1's likeliest first token, or pld's
    assert counts['accepted'] > 0, counts
  else:
    assert counts['accepted'] >= counts['cycles'], counts
    assert off_chain[0] > 0, counts  # a node off the chain was accepted


def test_tree_budget_checks():
  with pytest.raises(ValueError, match='tree_budget=1 leaves'):
    tree_spec('ddtree', 1)
  assert tree_spec('ddtree', 3).tree_size == 3  # below gamma: allowed for best-first trees
  with pytest.raises(ValueError, match='must be 0 \\(no limit\\) or >= gamma'):
    tree_spec('d2sd', 3)
  with pytest.raises(ValueError, match='lookup_accept'):
    tree_spec('d2sd_tree', 8, lookup_accept=(0.5, 1.0))
