"""method='auto' with a quality budget (d2sd_jax/decode/quality_route.py): the fastest measured
(steps, λ) whose NLL per token stays within the budget of lossless decoding's; 0 is lossless."""
import dataclasses
import json

import jax
import pytest

from d2sd_jax.decode import generate as generate_lib
from d2sd_jax.decode import options as options_lib
from d2sd_jax.decode import quality_route
from d2sd_jax.formats import loaders
from d2sd_jax.models import drafter as D

# (steps, λ, tokens/s, NLL/token): the lossless point at 2.0; a 2-step lossless point faster
# than the 1-step one would be odd, but lossless at any speed is within every budget
POINTS = [{'steps': s, 'leniency': lam, 'decode_tokens_per_s': v, 'nll_per_token': n}
          for s, lam, v, n in [(1, 0.0, 20.0, 2.0), (2, 0.0, 21.0, 1.9), (1, 0.25, 30.0, 2.3),
                               (1, 0.5, 40.0, 2.9), (4, 0.5, 35.0, 2.45), (1, 0.75, 60.0, 3.5)]]


def write_frontier(tmp_path, points=POINTS):
  path = tmp_path / 'frontier.json'
  path.write_text(json.dumps({'pareto': {'points': points}, 'runs': {'pareto': {
      'date': '2026-01-01 00:00 UTC', 'drafters': {'drafter1': 'abc'}}}}))
  return str(path)


@pytest.mark.parametrize('budget,want', [(0.0, (2, 0.0)), (0.29, (2, 0.0)), (0.3, (1, 0.25)),
                                         (0.5, (4, 0.5)), (0.9, (1, 0.5)), (5.0, (1, 0.75))])
def test_the_fastest_point_within_the_budget(tmp_path, budget, want):
  points, _ = quality_route.read_frontier(write_frontier(tmp_path))
  point, added = quality_route.choose_point(points, budget)
  assert (point['steps'], point['leniency']) == want
  assert added == pytest.approx(0.0 if want[1] == 0 else point['nll_per_token'] - 2.0)
  assert added <= budget + 1e-9


def test_bad_budgets_and_frontiers_are_refused_with_the_fix(tmp_path):
  auto = options_lib.Options(method='auto', temperature=1.0, quality_budget=0.5)
  quality_route.check(auto)  # (fine)
  quality_route.check(dataclasses.replace(auto, quality_budget=0.0, temperature=0.0))
  for changed, message in [({'quality_budget': -0.1}, 'must be >= 0'),
                           ({'method': 'dflash'}, 'set the knobs yourself'),
                           ({'temperature': 0.0}, 'needs temperature=1.0'),
                           ({'spec': {'leniency': 0.5}}, 'drop them, or drop the budget')]:
    with pytest.raises(ValueError, match=message):
      options_lib.check(dataclasses.replace(auto, **changed), ['drafter1'])
  # decode.py's config carries every knob at its default: that is not fixing them
  options_lib.check(dataclasses.replace(auto, spec={'leniency': 0.0, 'steps': 1}), ['drafter1'])
  (tmp_path / 'torn.json').write_text('{"pareto": {"poi')
  with pytest.raises(ValueError, match=r'no readable .* frontier .*reproduce.py --only pareto'):
    quality_route.read_frontier(str(tmp_path / 'torn.json'))
  lossy_only = [p for p in POINTS if p['leniency'] > 0]
  with pytest.raises(ValueError, match='no lossless point'):
    quality_route.read_frontier(write_frontier(tmp_path, lossy_only))


def test_auto_with_a_budget_decodes_at_the_frontier_point(tiny_folder, auto_choices, tmp_path,
                                                          monkeypatch):
  """A budget routes the request to dflash at the chosen (steps, λ), saying so, with the
  outputs of that configuration requested explicitly. (Without a budget auto weighs lossless
  candidates only: tests/decode/test_autoconfig.py.)"""
  target = loaders.load_target(tiny_folder)
  dcfg = D.DrafterConfig(gamma=4, n_layers=1, d_model=32, n_heads=4, n_kv_heads=2, head_dim=8,
                         d_ff=48, feature_layers=(0, 2), rope_base=10000.0, norm_eps=1e-6)
  drafters = {'drafter1': (dcfg, D.init_params(dcfg, target.cfg, jax.random.PRNGKey(1)))}
  monkeypatch.setenv('D2SD_FRONTIER', write_frontier(tmp_path))
  request = options_lib.Options(method='auto', max_new_tokens=12, chat=False, temperature=1.0,
                                quality_budget=0.5, seed=3)
  out, stats = generate_lib.generate(target, drafters, ['abcabc', 'hello hello'], request)
  assert stats['method'] == 'dflash' and stats['auto_source'] == 'frontier'
  assert stats['auto_choice'] == 'dflash(steps=4,leniency=0.5)'
  assert stats['quality_added_nll'] == pytest.approx(0.45)
  assert 'from the measured frontier' in stats['auto_reason'] and len(out) == 2
  # the same request at λ = 0.5 and 4 steps, explicitly: the same outputs
  explicit = dataclasses.replace(request, method='dflash', quality_budget=0.0,
                                 spec={'steps': 4, 'leniency': 0.5})
  same, _ = generate_lib.generate(target, drafters, ['abcabc', 'hello hello'], explicit)
  assert [r['completion_ids'] for r in same] == [r['completion_ids'] for r in out]
