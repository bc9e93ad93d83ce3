"""The best-first trees' estimates, checked and calibrated (tree.node_tally, tree.calibrate,
tree.fall_along_paths; SpecSettings.tally_nodes and node_calibration; the drafter folders'
node_calibration.json; scripts/calibrate_nodes.py's fit)."""

import dataclasses
import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from d2sd_jax.decode import options as options_lib
from d2sd_jax.formats import checkpoints
from d2sd_jax.spec_decode import ar as AR
from d2sd_jax.spec_decode import speculative as SP
from d2sd_jax.spec_decode import tree as tree_lib
from tests.helpers import loop_checks as H
from tests.helpers.tiny_drafters import DCFG, DCFG2, PROMPTS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def spec_with(method='d2sd_tree', budget=8, d1=DCFG, d2=DCFG2, **kw):
  return SP.SpecSettings(AR.GenerationSettings(max_new_tokens=20, eos_ids=(), pad_id=0),
                         method=method, gamma=5, drafter1=d1, drafter2=d2, n_branches=3,
                         tree_budget=budget, **kw)


def depths(tree, b):
  parents = np.asarray(tree.parents_BxT[b])
  out = [0]
  for j in range(1, len(parents)):
    out.append(out[int(parents[j])] + 1)
  return out


def reference_tally(tree, acc, live, max_depth):
  """tree.node_tally by loops over rows and nodes."""
  B, T = tree.tokens_BxT.shape
  edges = np.asarray(tree_lib.TALLY_EDGES)
  out = np.zeros((B, len(tree_lib.SOURCES), max_depth - 1, len(edges) - 1, 3))
  for b in range(B):
    if not live[b]:
      continue
    n = int(acc.accept_len_B[b])
    accepted = set(np.asarray(acc.path_BxC[b])[1:n + 1].tolist())
    dep = depths(tree, b)
    for t in range(1, T):
      if not bool(tree.valid_BxT[b, t]):
        continue
      p = float(np.exp(tree.score_BxT[b, t]))
      k = min(int(np.searchsorted(edges[1:-1], p, side='right')), len(edges) - 2)
      out[b, int(tree.source_BxT[b, t]), dep[t] - 1, k] += [1.0, p, float(t in accepted)]
  return out


@pytest.mark.parametrize('method', ['d2sd_tree', pytest.param('ddtree', marks=pytest.mark.slow)])
def test_node_tally_counts_every_verified_node_and_the_accepted_path(tiny, trained, method):
  """Each cycle adds, per live row, each valid node's count, estimate and acceptance in its
  proposer's, depth's and bin's cell (a loop over nodes here). Summed, the accepted nodes are the
  accepted drafts and the estimates the trees' expected drafts; on these prompts nodes of more
  than one proposer are accepted, at more than one depth."""
  cfg, params = tiny
  # (lookup's estimates a^depth kept off the bins' edges: float rounding would pick the bin)
  spec = spec_with(method, tally_nodes=True, lookup_accept=(0.33, 0.55, 0.85))
  bundle = SP.prepare(trained, cfg)
  seen = []

  def on_cycle(state, tree, acc, new_state):
    live = ~np.asarray(state.done_B)
    added = np.asarray(new_state.node_tally - state.node_tally)
    np.testing.assert_allclose(added, reference_tally(tree, acc, live, spec.gamma), atol=1e-5)
    seen.append(added.sum(0))

  outs, counts = H.run_cycles(cfg, bundle, spec, PROMPTS, check_caches=False, on_cycle=on_cycle)
  assert outs == H.ar_outputs(cfg, params, PROMPTS, spec.generation)
  total = np.sum(seen, axis=0)
  assert total[..., 2].sum() == counts['accepted']
  accepted_by = total[..., 2].sum((1, 2))
  assert (accepted_by > 0).sum() >= (2 if method == 'd2sd_tree' else 1), accepted_by
  assert (total[..., 2].sum((0, 2)) > 0).sum() >= 2  # accepted at depth 1 and deeper


def test_tally_nodes_needs_scored_nodes():
  with pytest.raises(ValueError, match="method 'd2sd' scores none"):
    spec_with('d2sd', 0, tally_nodes=True)


def test_calibrate_maps_each_proposer_by_its_curve_and_depth():
  """Linear between (0, 0) and the curve's points, flat past its last; the depth groups 1, 2,
  3+ take their own curves; an unnamed proposer and -inf scores stay as they are."""
  table = (('drafter1', (((0.5, 1.0), (0.25, 0.5)), ((0.5,), (0.1,)), ((1.0,), (0.3,)))),)
  p = np.asarray([[0.5, 0.25, 0.8, 0.5, 0.5, 0.5, 0.5, 0.0]])
  source = jnp.asarray([[0, 0, 0, 0, 0, 1, 2, 0]])
  depth = jnp.asarray([[1, 1, 1, 2, 5, 1, 1, 1]])
  got = np.exp(np.asarray(tree_lib.calibrate(jnp.log(jnp.asarray(p, jnp.float32)), source, depth,
                                             table)))
  np.testing.assert_allclose(got, [[0.25, 0.125, 0.4, 0.1, 0.15, 0.5, 0.5, 0.0]], rtol=1e-5)
  raw = jnp.log(jnp.asarray(p, jnp.float32))
  assert tree_lib.calibrate(raw, source, depth, ()) is raw


def test_fall_along_paths_caps_every_node_by_its_ancestors():
  score = jnp.log(jnp.asarray([[0.5, 0.9, 0.8, 0.2, 0.7]]))
  parent = jnp.asarray([[-1, 0, 1, -1, 3]])  # 0 -> 1 -> 2; 3 -> 4
  got = np.exp(np.asarray(tree_lib.fall_along_paths(score, parent, max_depth=4)))
  np.testing.assert_allclose(got, [[0.5, 0.5, 0.5, 0.2, 0.2]], rtol=1e-6)


def _trees(cfg, bundle, spec, cycles=4):
  _, draft, _, _, _ = H._stage_programs()
  step = jax.jit(SP.spec_step, static_argnames=('cfg', 'settings'))
  block, lens = AR.pad_prompts(PROMPTS, 0, bucket=8)
  state = H._stage_programs()[0](bundle, cfg, spec, block, lens, AR.row_keys(0, range(3)),
                                 SP.cache_size_needed(block.shape[1], spec))
  out = []
  for _ in range(cycles):
    out.append(draft(bundle, cfg, spec, state))
    state = step(bundle, cfg, spec, state)
  return out


@pytest.mark.slow  # (five decode programs, 40 s)
def test_calibrated_trees_follow_the_drafters_curves_and_stay_lossless(tiny, trained):
  """The curves a drafter carries decide the tree: the identity changes nothing; a drafter 2
  whose re-drafts are never accepted (rate 1e-6) puts none in the tree, though the raw trees
  hold some; spec.calibrated=False ignores the curves. The output is AR's either way."""
  cfg, params = tiny
  bundle = SP.prepare(trained, cfg)
  identity = tuple(((1.0,), (1.0,)) for _ in range(tree_lib.CALIBRATION_DEPTHS))
  never = tuple(((1.0,), (1e-6,)) for _ in range(tree_lib.CALIBRATION_DEPTHS))
  d1 = dataclasses.replace(DCFG, node_calibration=(('drafter1', identity), ('lookup', identity)))
  kw = dict(lookup_accept=(0.3, 0.5, 0.8))
  raw = _trees(cfg, bundle, spec_with(**kw))
  same = _trees(cfg, bundle, spec_with(d1=d1, **kw))
  for a, b in zip(raw, same):
    np.testing.assert_array_equal(np.asarray(a.tokens_BxT), np.asarray(b.tokens_BxT))
  assert any(bool(jnp.any((t.source_BxT == 1) & t.valid_BxT)) for t in raw)
  d2 = dataclasses.replace(DCFG2, node_calibration=(('drafter2', never),))
  muted = spec_with(d2=d2, **kw)
  assert all(not bool(jnp.any((t.source_BxT == 1) & t.valid_BxT))
             for t in _trees(cfg, bundle, muted))
  ignored = _trees(cfg, bundle, spec_with(d2=d2, calibrated=False, **kw))
  for a, b in zip(raw, ignored):
    np.testing.assert_array_equal(np.asarray(a.tokens_BxT), np.asarray(b.tokens_BxT))
  ar_out, sp_out, _ = H.run_both(cfg, trained, PROMPTS, muted)
  assert sp_out == ar_out


def test_a_drafter_folders_curves_round_trip_and_bad_ones_are_refused(tmp_path):
  curves = {'drafter1': [[[0.1, 0.5], [0.05, 0.4]]] * 3, 'lookup': [[[0.9], [0.7]]] * 3}
  file = checkpoints.write_node_calibration(str(tmp_path), curves, {'command': 'x'})
  got = checkpoints.read_node_calibration(str(tmp_path))
  assert dict(got)['drafter1'][0] == ((0.1, 0.5), (0.05, 0.4)) and len(got) == 2
  hash(got)  # a static setting: hashable
  with pytest.raises(ValueError, match='increasing estimates'):
    checkpoints.write_node_calibration(str(tmp_path), {'drafter1': [[[0.5, 0.1], [0, 0]]]}, {})
  assert checkpoints.read_node_calibration(str(tmp_path)) == got  # the file was not touched
  with open(file, 'w') as f:
    f.write('{"curves": {"drafter1": [[[0.5], [1.5]]]}}')
  with pytest.raises(ValueError, match='node_calibration.json is damaged.*delete it'):
    checkpoints.read_node_calibration(str(tmp_path))
  with open(file, 'w') as f:
    f.write('{"cur')
  with pytest.raises(ValueError, match='is damaged'):
    checkpoints.read_node_calibration(str(tmp_path))
  assert checkpoints.read_node_calibration(str(tmp_path / 'none')) == ()


def _script():
  spec = importlib.util.spec_from_file_location(
      'calibrate_nodes', os.path.join(ROOT, 'scripts', 'calibrate_nodes.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_the_fitted_curves_reproduce_the_tallied_acceptance():
  """A tally whose proposers are over- and under-confident: the fit's curves are
  non-decreasing, and the tallied nodes' estimates through them sum to the accepted nodes
  within the shrinkage's pull (raw: 40 % off)."""
  cal = _script()
  rng = np.random.default_rng(0)
  S, D, nb = len(tree_lib.SOURCES), 4, len(tree_lib.TALLY_EDGES) - 1
  tally = np.zeros((S, D, nb, 3))
  edges = np.asarray(tree_lib.TALLY_EDGES)
  for s, bias in enumerate((0.6, 2.0, 0.8)):
    p = rng.uniform(0.005, 1.0, 20000)
    hit = rng.uniform(size=p.size) < np.clip(bias * p ** 1.3, 0, 1)
    d = rng.integers(0, D, p.size)
    k = np.minimum(np.searchsorted(edges[1:-1], p, side='right'), nb - 1)
    np.add.at(tally, (s, d, k), np.stack([np.ones_like(p), p, hit], -1))
  curves = cal.fit_curves(tally)
  for name in tree_lib.SOURCES:
    for xs, ys in curves[name]:
      assert list(xs) == sorted(xs) and list(ys) == sorted(ys)
  accepted = tally[..., 2].sum((1, 2))
  raw = tally[..., 1].sum((1, 2))
  assert np.all(np.abs(raw / accepted - 1) > 0.15)
  np.testing.assert_allclose(cal.calibrated_sum(tally, curves), accepted, rtol=0.03)
  json.dumps(curves)
  checkpoints.as_curves(curves)  # what --write stores passes the loader's checks


def test_the_fit_refuses_the_evaluation_packages():
  with pytest.raises(SystemExit, match='reserved for evaluation'):
    _script().main(['--packages', 'sympy,networkx'])


def test_each_proposer_takes_the_curves_fitted_nearest_the_temperature():
  """Curves named 'proposer@T' were fitted at temperature T (plain: greedy): a program takes,
  per proposer, those nearest its own temperature, and only from the drafter that owns them."""
  greedy = tuple(((1.0,), (0.9,)) for _ in range(tree_lib.CALIBRATION_DEPTHS))
  warm = tuple(((1.0,), (0.5,)) for _ in range(tree_lib.CALIBRATION_DEPTHS))
  hot = tuple(((1.0,), (0.2,)) for _ in range(tree_lib.CALIBRATION_DEPTHS))
  d1 = dataclasses.replace(DCFG, node_calibration=(
      ('drafter1', greedy), ('drafter1@0.7', warm), ('drafter1@1.5', hot), ('lookup@0.7', warm),
      ('drafter2', hot)))  # (drafter 2's curves are drafter 2's to carry)
  d2 = dataclasses.replace(DCFG2, node_calibration=(('drafter2@0.7', warm),))

  def table(temperature):
    spec = spec_with(d1=d1, d2=d2)
    gen = dataclasses.replace(spec.generation, sampling=dataclasses.replace(
        spec.generation.sampling, temperature=temperature))
    return dict(dataclasses.replace(spec, generation=gen).node_calibration)
  assert table(0.0) == {'drafter1': greedy, 'lookup': warm, 'drafter2': warm}
  assert table(0.8) == {'drafter1': warm, 'lookup': warm, 'drafter2': warm}
  assert table(1.2)['drafter1'] == hot
  assert dict(spec_with(d1=d1, d2=d2, calibrated=False).node_calibration) == {}


def test_a_request_of_one_kind_takes_its_kinds_curves_else_the_pooled_ones():
  """Curves fitted on one kind of request ('drafter1:chat') serve requests of that kind
  (calibration_kind), the pooled ones the rest; the temperature still comes first; decode
  requests set the kind from `chat` for the trees only; an unknown kind is refused."""
  pooled = tuple(((1.0,), (0.9,)) for _ in range(tree_lib.CALIBRATION_DEPTHS))
  chat = tuple(((1.0,), (0.6,)) for _ in range(tree_lib.CALIBRATION_DEPTHS))
  warm = tuple(((1.0,), (0.5,)) for _ in range(tree_lib.CALIBRATION_DEPTHS))
  warm_chat = tuple(((1.0,), (0.3,)) for _ in range(tree_lib.CALIBRATION_DEPTHS))
  d1 = dataclasses.replace(DCFG, node_calibration=(
      ('drafter1', pooled), ('drafter1:chat', chat), ('lookup', pooled),
      ('drafter1@0.7', warm), ('drafter1@0.7:chat', warm_chat)))
  d2 = dataclasses.replace(DCFG2, node_calibration=(('drafter2:plain', chat),))

  def table(kind, temperature=0.0, d1=d1):
    spec = spec_with(d1=d1, d2=d2, calibration_kind=kind)
    gen = dataclasses.replace(spec.generation, sampling=dataclasses.replace(
        spec.generation.sampling, temperature=temperature))
    return dict(dataclasses.replace(spec, generation=gen).node_calibration)
  assert table('chat') == {'drafter1': chat, 'lookup': pooled}
  assert table('plain') == {'drafter1': pooled, 'lookup': pooled, 'drafter2': chat}
  assert table('') == {'drafter1': pooled, 'lookup': pooled}
  assert table('chat', 0.7)['drafter1'] == warm_chat and table('plain', 0.7)['drafter1'] == warm
  # the temperature first: pooled curves at the request's temperature over its kind's elsewhere
  only_greedy_chat = dataclasses.replace(DCFG, node_calibration=(
      ('drafter1:chat', chat), ('drafter1@0.7', warm)))
  assert table('chat', 0.7, only_greedy_chat)['drafter1'] == warm
  assert tree_lib.parse_curve_label(tree_lib.curve_label('lookup', 0.7, 'chat')) == (
      'lookup', 0.7, 'chat')
  with pytest.raises(ValueError, match="calibration_kind='code' must be one of"):
    spec_with(calibration_kind='code')
  fields = lambda **o: options_lib.spec_fields(options_lib.Options(**o), {})
  assert fields(method='d2sd_tree', chat=True)['calibration_kind'] == 'chat'
  assert fields(method='ddtree', chat=False)['calibration_kind'] == 'plain'
  assert 'calibration_kind' not in fields(method='d2sd', chat=True)
  assert fields(method='ddtree', spec={'calibration_kind': ''})['calibration_kind'] == ''
