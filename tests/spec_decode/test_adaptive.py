"""Adaptive best-first trees (d2sd_jax/spec_decode/adaptive.py, SpecSettings.adaptive): every
cycle verifies the shape a reference of the rule computes from the drafted tree and the rate
the row's drafted cycles have been giving; lookup-only cycles happen exactly when the
reference says they pay; the outputs are AR's."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from d2sd_jax.spec_decode import adaptive
from d2sd_jax.spec_decode import ar as AR
from d2sd_jax.spec_decode import lookup as lookup_lib
from d2sd_jax.spec_decode import speculative as SP
from d2sd_jax.spec_decode import tree as tree_lib
from tests.helpers import loop_checks as H
from tests.helpers.tiny_drafters import PROMPTS, tree_spec


class DraftedRate:
  """A reference of SpecState.tree_rate_B: per row, running means of the expected tokens and
  the seconds of its drafted cycles (the first cycle's values, then a quarter of the way to
  each new one's), and their ratio; inf before the first."""

  def __init__(self, rows):
    self.tokens, self.seconds = np.zeros(rows), np.zeros(rows)

  def rate(self):
    with np.errstate(divide='ignore', invalid='ignore'):
      return np.where(self.seconds > 0, self.tokens / self.seconds, np.inf)

  def add(self, rows, tokens, seconds):
    for b in rows:
      if self.seconds[b] == 0:
        self.tokens[b], self.seconds[b] = tokens[b], seconds
      else:
        self.tokens[b] += 0.25 * (tokens[b] - self.tokens[b])
        self.seconds[b] += 0.25 * (seconds - self.seconds[b])


def reference_shape(reach_BxT, live, costs, rate_B):
  """(index of the shape to verify, each row's expected tokens per shape [B, S], the index a
  cycle's own best ratio would pick): each live row's expected tokens at n nodes are 1 + its
  tree's first n - 1 scores; the shape maximises the live rows' summed gain, tokens - r *
  cost, r the row's rate (its own best tokens / cost before its first drafted cycle)."""
  tokens = np.array([[1 + reach_BxT[b, :n - 1].sum() for n, _ in costs]
                     for b in range(len(reach_BxT))])
  c = np.array([c for _, c in costs])
  r = np.where(np.isinf(rate_B), (tokens / c).max(1), rate_B)
  gain = (tokens - r[:, None] * c)[live].sum(0)
  return int(np.argmax(gain)), tokens, int(np.argmax((tokens / c)[live].sum(0)))


@pytest.mark.parametrize('method', ['d2sd_tree', pytest.param('ddtree', marks=pytest.mark.slow)])
def test_adaptive_trees_equal_ar_and_choose_their_size_every_cycle(tiny, trained, method):
  """spec.adaptive: the greedy output is AR's; every cycle verifies the shape of the
  reference rule, computed here from the drafted tree, and the rows' drafted rates are the
  reference's. On these prompts the cycles choose more than one shape, and some choose
  otherwise than a cycle's own best ratio would (what the rule changes)."""
  cfg, _ = tiny
  costs = ((2, 1.0), (4, 1.25), (8, 1.6))
  spec = tree_spec(method, 8, max_new=20, adaptive=True, node_costs=costs, lookup_cycles=False)
  ar_out, sp_out, _ = H.run_both(cfg, trained, PROMPTS, spec)
  assert sp_out == ar_out
  _, init, _, step = H.jitted()
  draft = jax.jit(SP.draft, static_argnames=('cfg', 'settings'))
  block, lens = AR.pad_prompts(PROMPTS, 0, bucket=8)
  state = init(trained, cfg, spec, block, lens, AR.row_keys(0, range(len(PROMPTS))),
               SP.cache_size_needed(block.shape[1], spec))
  ref = DraftedRate(len(PROMPTS))
  chosen, unlike_ratio = [], 0
  while not bool(state.done_B.all()):
    live = ~np.asarray(state.done_B)
    reach = np.exp(np.asarray(draft(trained, cfg, spec, state).score_BxT, np.float64)[:, 1:])
    s, tokens, by_ratio = reference_shape(reach, live, costs, ref.rate())
    new = step(trained, cfg, spec, state)
    verified = np.asarray(new.verified_nodes_B - state.verified_nodes_B)
    assert list(verified[live]) == [costs[s][0]] * int(live.sum()) and not verified[~live].any()
    ref.add(np.flatnonzero(live), tokens[:, s], costs[s][1])
    np.testing.assert_allclose(np.asarray(new.tree_rate_B), ref.rate(), rtol=1e-5)
    chosen.append(costs[s][0])
    unlike_ratio += s != by_ratio
    state = new
  assert len(set(chosen)) > 1, chosen
  assert unlike_ratio > 0, chosen


def test_choice_grows_sure_trees_and_shrinks_unsure_ones_against_the_running_rate():
  """adaptive.choice by hand, shapes of 4 and 8 nodes at 1.0 and 1.5 s. A sure tree (node
  probabilities .9 .8 .7, then .3 .2 .1 .1) expects 3.4 tokens at 4 nodes and 4.1 at 8: its own
  ratio prefers 4 (3.4 > 2.73), but its 4 extra nodes give 1.4 tokens/s, more than the 1.0 its
  row has been getting, so the gain takes 8. An unsure tree (.3 at every node; 1.9 and 3.1
  tokens) in a row that has been getting 3.0 tokens/s: its ratio prefers 8 (2.07 > 1.9), the
  gain 4 (1.9 - 3.0 > 3.1 - 4.5). Before a row's first drafted cycle (rate inf) the gain
  takes what the ratio would. A finished row counts for nothing; two live rows sum their
  gains."""
  spec = tree_spec('d2sd_tree', 8, adaptive=True, node_costs=((4, 1.0), (8, 1.5)),
                   lookup_cycles=False)
  sure = [1.0, .9, .8, .7, .3, .2, .1, .1]
  unsure = [1.0] + [.3] * 7
  tree = tree_lib.Tree(tokens_BxT=jnp.zeros((2, 8), jnp.int32),
                       parents_BxT=jnp.zeros((2, 8), jnp.int32), valid_BxT=jnp.ones((2, 8), bool),
                       score_BxT=jnp.log(jnp.asarray([sure, unsure], jnp.float32)))

  def choose(rate, done):
    state = types.SimpleNamespace(tree_rate_B=jnp.asarray(rate, jnp.float32),
                                  done_B=jnp.asarray(done))
    s, tokens_B, seconds = adaptive.choice(spec, state, tree)
    assert float(seconds) == spec.node_costs[int(s)][1]
    return spec.node_costs[int(s)][0], np.asarray(tokens_B)

  n, tokens = choose([1.0, 3.0], [False, True])
  assert n == 8
  np.testing.assert_allclose(tokens, [4.1, 3.1], rtol=1e-5)
  n, tokens = choose([1.0, 3.0], [True, False])
  assert n == 4
  np.testing.assert_allclose(tokens, [3.4, 1.9], rtol=1e-5)
  assert choose([np.inf, 3.0], [False, True])[0] == 4  # the sure tree's own ratio
  assert choose([1.0, np.inf], [True, False])[0] == 8  # the unsure tree's own ratio
  # both live: gains 2.4 - 1.1 at 4 nodes, 2.6 - 1.4 at 8
  assert choose([1.0, 3.0], [False, False])[0] == 4


def test_the_drafted_rate_is_expected_tokens_over_seconds():
  """adaptive.running and SpecState.tree_rate_B by hand: a first cycle of 3 tokens in 0.5 s,
  then one of 1 token in 1.0 s: running means (2.5, 0.625), a rate of 4.0 tokens/s (a running
  mean of the cycles' own rates, 6 then 1, would say 4.75). A row with no drafted cycle yet
  has rate inf."""
  drafted = jnp.zeros((2, 2), jnp.float32)
  drafted = adaptive.running(drafted, jnp.asarray([3.0, 2.0]), 0.5)
  drafted = adaptive.running(drafted, jnp.asarray([1.0, 2.0]), 1.0)
  np.testing.assert_allclose(np.asarray(drafted), [[2.5, 0.625], [2.0, 0.625]], rtol=1e-6)
  kept = adaptive.running(drafted, jnp.asarray([9.0, 9.0]), 2.0, jnp.asarray([False, True]))
  np.testing.assert_allclose(np.asarray(kept[0]), [2.5, 0.625], rtol=1e-6)  # (a finished row)
  rate = SP.SpecState.tree_rate_B.fget(types.SimpleNamespace(
      drafted_Bx2=drafted.at[1].set(0.0)))
  np.testing.assert_allclose(np.asarray(rate), [4.0, np.inf])


# (a lookup trusted that much makes the floor, its own tokens at 1.6, exceed the running rate)
@pytest.mark.parametrize('lookup_cost,lookup_accept', [
    (0.45, (0.4, 0.674, 0.936)),
    pytest.param(0.6, (0.4, 0.674, 0.936), marks=pytest.mark.slow),
    (1.3, (0.9, 0.95, 0.99))])
def test_lookup_cycles_verify_the_lookup_alone_when_it_pays(tiny, trained, lookup_cost,
                                                           lookup_accept):
  """spec.lookup_cycles: the greedy output is AR's, and every cycle is what a reference of
  the rule computes from the state: verify prompt lookup's gamma nodes alone when the live
  rows' (1 + sum over its valid nodes of a^depth) / lookup_cost, summed, beat the drafted
  trees' rate (the reference's: inf before the first drafted cycle; at least the lookup's own
  tokens at the cost of the smallest shape of >= gamma nodes), leaving that rate as it was;
  else draft, verify the reference's shape, and count the cycle into the rate. On these
  prompts both kinds of cycle happen."""
  cfg, _ = tiny
  costs = ((2, 1.0), (4, 1.25), (8, 1.6))
  spec = tree_spec('d2sd_tree', 8, max_new=20, adaptive=True, node_costs=costs,
                   lookup_cost=lookup_cost, lookup_accept=lookup_accept)  # (lookup_cycles: on)
  ar_out, sp_out, _ = H.run_both(cfg, trained, PROMPTS, spec)
  assert sp_out == ar_out
  _, init, _, step = H.jitted()
  draft = jax.jit(SP.draft, static_argnames=('cfg', 'settings'))
  lookup = jax.jit(lookup_lib.lookup, static_argnames=('settings',))
  block, lens = AR.pad_prompts(PROMPTS, 0, bucket=8)
  state = init(trained, cfg, spec, block, lens, AR.row_keys(0, range(len(PROMPTS))),
               SP.cache_size_needed(block.shape[1], spec))
  ref = DraftedRate(len(PROMPTS))
  kinds = set()
  floored = 0  # cycles where a live row's floor exceeded its running rate
  while not bool(state.done_B.all()):
    live = np.flatnonzero(~np.asarray(state.done_B))
    _, valid, matched = (np.asarray(x) for x in lookup(spec, state))
    own = np.ones(len(PROMPTS))  # the lookup's 1 + expected drafts per row
    for b in range(len(PROMPTS)):
      if matched[b]:
        a = spec.lookup_accept[min(matched[b], len(spec.lookup_accept)) - 1]
        own[b] += sum(a ** d for d in range(1, spec.gamma) if valid[b, :d].all())
    rate = ref.rate()
    gain = sum(own[b] / lookup_cost - max(rate[b], own[b] / 1.6) for b in live)
    floored += any(own[b] / 1.6 > rate[b] for b in live)
    new = step(trained, cfg, spec, state)
    verified = np.asarray(new.verified_nodes_B - state.verified_nodes_B)
    counted = np.asarray(new.lookup_only_B - state.lookup_only_B)
    done = np.asarray(state.done_B)
    assert list(counted[live]) == [int(gain > 0)] * len(live) and not counted[done].any()
    if gain > 0:
      assert list(verified[live]) == [spec.gamma] * len(live)
      kinds.add('lookup')
    else:
      reach = np.exp(np.asarray(draft(trained, cfg, spec, state).score_BxT, np.float64)[:, 1:])
      s, tokens, _ = reference_shape(reach, np.isin(np.arange(len(PROMPTS)), live), costs,
                                     rate)
      assert list(verified[live]) == [costs[s][0]] * len(live)
      ref.add(live, tokens[:, s], costs[s][1])
      kinds.add('drafted')
    np.testing.assert_allclose(np.asarray(new.tree_rate_B), ref.rate(), rtol=1e-5)
    state = new
  assert kinds == {'lookup', 'drafted'}, kinds
  assert floored > 0 or lookup_cost < 1, floored


def test_lookup_wins_weighs_each_row_against_its_floor_at_batch_two():
  """lookup_wins at batch 2, by hand: row 0's lookup expects 2 drafts (two sure nodes: 3
  tokens), and its drafted cycles have run at 1 token per second; row 1's lookup proposes
  nothing (1 token) and its drafted cycles ran at 2. At a lookup cost of 0.9, and 1.0 for the
  smallest shape of >= gamma nodes, row 0 gains 3/0.9 - max(1, 3/1.0) = 0.33 and row 1 loses
  1/0.9 - 2 = 0.89: the batch drafts. Without the floor (a drafted tree holds the lookup's
  nodes too) row 0 would gain 2.33, and the batch would verify the lookup alone. A finished
  row counts for nothing."""
  spec = tree_spec('d2sd_tree', 8, adaptive=True, node_costs=((4, 0.7), (5, 1.0), (8, 1.4)),
                  lookup_cost=0.9)
  score = jnp.asarray([[0.0, 0.0, 0.0, -np.inf, -np.inf],
                       [0.0, -np.inf, -np.inf, -np.inf, -np.inf]], jnp.float32)
  tree = tree_lib.Tree(tokens_BxT=jnp.zeros((2, 5), jnp.int32),
                       parents_BxT=jnp.zeros((2, 5), jnp.int32),
                       valid_BxT=jnp.ones((2, 5), bool), score_BxT=score)
  wins = lambda rate, done: bool(adaptive.lookup_wins(spec, types.SimpleNamespace(
      tree_rate_B=jnp.asarray(rate, jnp.float32), done_B=jnp.asarray(done)), tree))
  assert not wins([1.0, 2.0], [False, False])  # 0.33 - 0.89
  assert wins([1.0, 2.0], [False, True])  # row 0 alone: 0.33
  assert not wins([1.0, 2.0], [True, False])  # row 1 alone: -0.89
  assert wins([1.0, 1.0], [False, False])  # 0.33 + 0.11
  assert not wins([np.inf, 1.0], [False, False])  # before row 0's first drafted cycle


def test_adaptive_settings_are_checked():
  with pytest.raises(ValueError, match="method 'd2sd' has a fixed tree"):
    tree_spec('d2sd', 0, adaptive=True, node_costs=((4, 1.0),))
  with pytest.raises(ValueError, match=r'node_costs=\(\) must pair .*leave it empty'):
    tree_spec('d2sd_tree', 8, adaptive=True, lookup_cost=1.0)
  with pytest.raises(ValueError, match='must pair distinct tree sizes in 2..8'):
    tree_spec('d2sd_tree', 8, adaptive=True, node_costs=((4, 1.0), (16, 2.0)), lookup_cost=1.0)
  with pytest.raises(ValueError, match='set adaptive=True or drop them'):
    tree_spec('d2sd_tree', 8, node_costs=((4, 1.0),))
  with pytest.raises(ValueError,
                     match=r'lookup_cost=0.0 must be the positive .*lookup_cycles=False'):
    tree_spec('d2sd_tree', 8, adaptive=True, node_costs=((4, 1.0),))
  assert not tree_spec('d2sd_tree', 8, adaptive=True, node_costs=((4, 1.0),),
                      lookup_cycles=False).takes_lookup_cycles
  assert not tree_spec('ddtree', 8, adaptive=True, node_costs=((4, 1.0),)).takes_lookup_cycles
  assert not tree_spec('d2sd_tree', 8).takes_lookup_cycles  # (not adaptive)
  for kw in ({'adaptive': True, 'node_costs': ((4, 1.0),), 'lookup_cycles': False}, {}):
    with pytest.raises(ValueError, match="lookup_cost is the lookup-only cycle's.*drop it"):
      tree_spec('d2sd_tree', 8, lookup_cost=1.0, **kw)
  with pytest.raises(ValueError, match="lookup_cost is the lookup-only cycle's"):
    tree_spec('ddtree', 8, adaptive=True, node_costs=((4, 1.0),), lookup_cost=1.0)


@pytest.mark.slow
def test_adaptive_d2sd_tree_chooses_several_shapes_on_real_prompts():
  """SmolLM2 with the shipped drafters, greedy, on two real prompts: the adaptive tree's output
  is AR's, and its cycles verified more than one shape. (A decode that kept one shape verifies
  exactly that many nodes every cycle, so its mean tree size would be one of the shapes.)
  The costs are a CPU's kind, every node costing: big trees only where the estimates say so."""
  import d2sd_jax  # pylint: disable=import-outside-toplevel
  dec = d2sd_jax.load('smollm2', drafter1='drafters/smollm2-drafter1',
                      drafter2='drafters/smollm2-drafter2')
  prompts = ['def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
             'Explain in two sentences what a hash map is.']
  ar = dec.generate(prompts, 40, method='ar', chat=False)
  costs = ((4, 1.0), (8, 1.1), (16, 1.5), (32, 2.4))
  out = dec.generate(prompts, 40, method='d2sd_tree', chat=False, batch_size=1,
                     tree_budget=32, adaptive=True, node_costs=costs, lookup_cycles=False)
  assert [list(a) for a in out.ids] == [list(a) for a in ar.ids]
  assert out.stats['tau'] > 1.5  # drafts were accepted
  assert out.stats['mean_tree_size'] not in {n for n, _ in costs}, out.stats
