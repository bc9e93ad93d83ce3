"""benchmarks/reproduce.py's quality measures (the Pareto frontier's axes) on known answers."""
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), 'benchmarks'))
import reproduce  # pylint: disable=wrong-import-position

from d2sd_jax import model as M  # pylint: disable=wrong-import-position


def test_pass_at_1_runs_the_tests_in_a_subprocess():
  """HumanEval's canonical solutions pass, a wrong body fails, a hang times out; code after the
  function (a stop sequence) is cut."""
  problems = reproduce.humaneval(2)
  for p in problems:
    assert reproduce.passes(p, p['canonical_solution'])
    assert reproduce.passes(p, p['canonical_solution'] + '\nprint(undefined_name)\n')
    assert not reproduce.passes(p, '    return None\n')
  assert not reproduce.passes(problems[0], '    while True:\n        pass\n', timeout=2)


def test_nll_per_token_is_the_mean_negative_log_likelihood(tiny):
  """Against a step-by-step computation from the model's logits."""
  cfg, params = tiny

  class Target:  # what nll_per_token reads of a loaders.Target
    pass
  target = Target()
  target.cfg, target.params = cfg, params
  prompt, completion = [1, 5, 9], [3, 7, 2, 8]
  ids = np.asarray([prompt + completion], np.int32)
  L = ids.shape[1]
  h, _, _ = M.forward(params, cfg, ids, np.arange(L)[None], M.init_cache(cfg, 1, L),
                      np.zeros((1,), np.int32))
  logp = np.asarray(jax.nn.log_softmax(M.logits(params, cfg, h)[0], -1))
  expected = -np.mean([logp[len(prompt) - 1 + i, t] for i, t in enumerate(completion)])
  np.testing.assert_allclose(reproduce.nll_per_token(target, prompt, completion), expected,
                             rtol=1e-4)


def test_agreement_is_the_common_prefix_fraction():
  assert reproduce.common_prefix([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
  assert reproduce.common_prefix([1, 2, 9, 4], [1, 2, 3, 4]) == 0.5
  assert reproduce.common_prefix([5, 2], [1, 2]) == 0.0


def test_only_keeps_the_other_sections_of_a_run_with_the_same_settings(tmp_path):
  """--only reruns some sections on top of the existing JSON; it refuses one written with other
  settings or drafters (one table would mix two runs) and leaves that file untouched."""
  import json  # pylint: disable=import-outside-toplevel
  import pytest  # pylint: disable=import-outside-toplevel
  path = tmp_path / 'reproduce.json'
  drafters = ['d1', 'd2']
  earlier = {'settings': 'S', 'drafters': drafters, 'ladder': {'x': [1]}, 'pareto': {'p': 2}}
  path.write_text(json.dumps(earlier))
  kept = reproduce.kept_sections(str(path), ['pareto'], 'S', drafters)
  assert kept['ladder'] == {'x': [1]} and kept['pareto'] == {'p': 2}  # pareto: overwritten next
  # Every section reruns: nothing is kept.
  assert reproduce.kept_sections(str(path), list(reproduce.SECTIONS), 'S', drafters) == {
      'settings': 'S', 'drafters': drafters}
  # No file yet: a fresh result.
  assert reproduce.kept_sections(str(tmp_path / 'none.json'), ['ladder'], 'S', drafters) == {
      'settings': 'S', 'drafters': drafters}
  with pytest.raises(SystemExit, match='other settings'):
    reproduce.kept_sections(str(path), ['pareto'], 'T', drafters)
  with pytest.raises(SystemExit, match="drafters \\['d1', 'd2'\\], not \\['d1', 'other'\\]"):
    reproduce.kept_sections(str(path), ['pareto'], 'S', ['d1', 'other'])
  assert json.loads(path.read_text()) == earlier
  # A file from before drafters were recorded is taken as it is.
  path.write_text(json.dumps({'settings': 'S', 'ladder': {}}))
  assert reproduce.kept_sections(str(path), ['pareto'], 'S', drafters)['drafters'] == drafters
  assert reproduce.sections_of('pareto,ladder') == ['pareto', 'ladder']
  for bad in ('paretto', '', 'ladder,,x'):
    with pytest.raises(ValueError, match='sections are ladder'):
      reproduce.sections_of(bad)
