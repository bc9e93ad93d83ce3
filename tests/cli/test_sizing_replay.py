"""benchmarks/sizing_replay.py: what a cycle commits at each node count of a drafted tree, and
its numpy rule against the adaptive program's own (adaptive.choice, adaptive.running,
adaptive.lookup_wins) on the same scores."""
import os
import sys
import types

import jax.numpy as jnp
import numpy as np

from tests.conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))
import sizing_replay  # pylint: disable=wrong-import-position

from d2sd_jax.spec_decode import adaptive  # pylint: disable=wrong-import-position


def test_committed_is_the_deepest_accepted_node_among_the_first_n():
  """anchor -> 5 -> 6 -> 9 and anchor -> 7 -> 6 -> 8 -> 4, against the output [a, 5, 6, 8, 4]:
  node 1 (5) and its child (6) are the continuation; 9 misses 8; under the rejected 7, the
  chain 6 -> 8 -> 4 matches the output but is never accepted; a cycle never commits past the
  room."""
  tokens = np.array([3, 5, 7, 6, 9, 6, 8, 4])
  parents = np.array([0, 0, 0, 1, 3, 2, 5, 6])
  valid = np.ones(8, bool)
  truth = [3, 5, 6, 8, 4]
  assert sizing_replay.committed(tokens, parents, valid, truth, 1, 4).tolist() == [
      1, 2, 2, 3, 3, 3, 3, 3]
  assert sizing_replay.committed(tokens, parents, valid, truth, 1, 2).tolist() == [
      1, 2, 2, 2, 2, 2, 2, 2]
  valid[3] = False  # an invalid node is never accepted, nor anything under it
  assert sizing_replay.committed(tokens, parents, valid, truth, 1, 4).tolist() == [
      1, 2, 2, 2, 2, 2, 2, 2]


def test_the_replayed_rule_chooses_what_the_program_chooses():
  """Cycle after cycle of random scores (some sure, some not), the numpy rule picks the same
  shape or lookup-only cycle as adaptive.choice / adaptive.lookup_wins with the running rate
  adaptive.running keeps, and more than one choice happens."""
  rng = np.random.default_rng(0)
  costs = {4: 0.050, 8: 0.056, 16: 0.071, 32: 0.112, 'lookup': 0.043}
  shapes, gamma = (4, 8, 16, 32), 8
  cycles = []
  for _ in range(60):
    sure = rng.uniform(0.05, 0.95)
    tree = np.concatenate([[0.0], np.sort(np.log(rng.uniform(0, sure, 31)))[::-1]])
    lookup = np.concatenate([[0.0], np.arange(1, gamma) * np.log(rng.uniform(0.05, 0.9))])
    cycles.append((None, tree, None, lookup))
  settings = types.SimpleNamespace(node_costs=tuple((n, costs[n]) for n in shapes), gamma=gamma,
                                   lookup_cost=costs['lookup'])
  choose = sizing_replay.shipped_rule(cycles, costs, shapes, gamma, lookup=True)
  memory, drafted = {}, jnp.zeros((1, 2), jnp.float32)
  picked = []
  for p, (_, tree, _, lookup) in enumerate(cycles):
    rate = jnp.where(drafted[:, 1] > 0, drafted[:, 0] / jnp.maximum(drafted[:, 1], 1e-30),
                     jnp.inf)
    state = types.SimpleNamespace(done_B=jnp.zeros((1,), bool), tree_rate_B=rate)
    as_tree = lambda s: types.SimpleNamespace(score_BxT=jnp.asarray(s, jnp.float32)[None],
                                              valid_BxT=jnp.isfinite(jnp.asarray(s))[None])
    if bool(adaptive.lookup_wins(settings, state, as_tree(lookup))):
      want = 'lookup'
    else:
      i, tokens_B, seconds = adaptive.choice(settings, state, as_tree(tree))
      want = shapes[int(i)]
      drafted = adaptive.running(drafted, tokens_B, seconds)
    got = choose(p, memory)
    assert got == want, (p, got, want)
    picked.append(got)
  assert 'lookup' in picked and len(set(picked) - {'lookup'}) >= 2, picked
