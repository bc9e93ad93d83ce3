"""benchmarks/reproduce.py's quality measures (the Pareto frontier's axes) on known answers, and
its --quick run end to end (slow: CI runs it, .ci/run)."""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests.conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))
import reproduce  # pylint: disable=wrong-import-position

from d2sd_jax.models import target as M  # pylint: disable=wrong-import-position


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


def test_sets_reruns_prompt_sets_of_the_per_set_sections_with_their_own_record():
  """--sets names prompt sets of trees/sampled only; a set rerun alone shows its own run record,
  the others their section's."""
  assert reproduce.sets_of('', ['trees']) is None
  assert reproduce.sets_of('prose_chat,humaneval_chat', ['trees', 'sampled']) == [
      'prose_chat', 'humaneval_chat']
  with pytest.raises(ValueError, match='prompt sets are humaneval_chat,'):
    reproduce.sets_of('prose', ['trees'])
  with pytest.raises(ValueError, match='--sets reruns prompt sets of trees,sampled only'):
    reproduce.sets_of('prose_chat', ['trees', 'ladder'])
  whole = {'date': 'D1', 'machine': 'M', 'command': 'python benchmarks/reproduce.py'}
  alone = {'date': 'D2', 'machine': 'M', 'command': 'python benchmarks/reproduce.py --sets x'}
  res = {'runs': {'trees': whole, 'trees:prose_chat': alone}}
  assert 'D2' in reproduce._measured(res, 'trees', 'prose_chat')
  assert 'D1' in reproduce._measured(res, 'trees', 'humaneval_chat')
  assert 'D1' in reproduce._measured(res, 'trees')


def test_a_table_measured_with_other_drafters_says_so(tmp_path):
  """The run record keeps a digest of the drafter folders' files; a table whose run measured
  other drafters than the shipped ones is labelled, one measured with them is not."""
  d1, d2 = tmp_path / 'd1', tmp_path / 'd2'
  for d in (d1, d2):
    (d / '100' / 'params').mkdir(parents=True)
    (d / '100' / 'params' / 'w').write_bytes(b'weights')
  first = reproduce.drafters_digest([str(d1), str(d2)])
  assert first['drafter1'] == first['drafter2']  # same names and bytes
  (d2 / '100' / 'params' / 'w').write_bytes(b'retrained')
  second = reproduce.drafters_digest([str(d1), str(d2)])
  assert second['drafter1'] == first['drafter1'] and second['drafter2'] != first['drafter2']
  (d1 / '100').rename(d1 / '200')  # another step folder: other drafters too
  assert reproduce.drafters_digest([str(d1), str(d2)])['drafter1'] != first['drafter1']
  run = {'date': 'D', 'machine': 'M', 'command': 'c', 'drafters': first}
  res = {'runs': {'ladder': run}}
  assert 'other drafters' in reproduce._measured(res, 'ladder', shipped=second)
  assert '--only ladder' in reproduce._measured(res, 'ladder', shipped=second)
  assert 'other drafters' not in reproduce._measured(res, 'ladder', shipped=first)
  assert 'other drafters' not in reproduce._measured(res, 'ladder')  # nothing to compare with


@pytest.mark.slow
def test_quick_run_writes_every_section_and_the_tables(tmp_path):
  """`reproduce.py --quick` on SmolLM2 with the shipped drafters: every section in the JSON, the
  ladder lossless (the script stops at any output that differs from AR's) with every rung, the
  plots, and --markdown's tables from that JSON."""
  root = ROOT
  out = tmp_path / 'results'
  script = os.path.join(root, 'benchmarks', 'reproduce.py')
  proc = subprocess.run([sys.executable, script, '--quick', '--out', str(out)], cwd=root,
                        capture_output=True, text=True, timeout=3600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  res = json.loads((out / 'reproduce-quick.json').read_text())
  assert set(reproduce.SECTIONS) <= set(res) and res['settings'].startswith('3 prompts, 32')
  assert set(res['ladder']) == {'humaneval_chat', 'humaneval_plain', 'prose_chat'}
  for rows in res['ladder'].values():
    assert [r['method'] for r in rows] == [*reproduce.LADDER, 'ar (end)']
    assert all(r['tau'] >= 1.0 and r['decode_tokens_per_s'] > 0 for r in rows)
  assert set(res['trees']) == {'humaneval_chat', 'heldout_code_plain', 'heldout_questions_chat',
                                'prose_chat'}
  for rows in res['trees'].values():
    assert [r['method'] for r in rows] == [l for l, _, _ in reproduce.TREES] + ['ar (end)']
    # every speed-up is against the mean of the two AR runs' ms per token
    assert 1 / rows[0]['speedup_vs_ar'] + 1 / rows[-1]['speedup_vs_ar'] == pytest.approx(
        2.0, abs=5e-3)
    for r, (_, method, knobs) in zip(rows, reproduce.TREES):
      assert (r['auto_choice'] is not None) == (method == 'auto')
      # auto: its picks, one per run of prompts it decoded (auto_parts)
      picked = ([p['choice'].split('(')[0] for p in r['auto_parts']] if method == 'auto' else
                [method])
      assert method != 'auto' or sum(p['prompts'] for p in r['auto_parts']) == 3
      tree = any(p in ('ddtree', 'd2sd_tree') for p in picked)
      assert r['tree_size'] == reproduce.TREE_BUDGET if knobs else True
      assert (r['expected_tau'] is not None) == tree and r['tau'] >= 1.0
  assert set(res['sampled']) == {'humaneval_chat', 'heldout_code_plain'}
  for rows in res['sampled'].values():
    assert [r['method'] for r in rows] == [l for l, _, _ in reproduce.SAMPLED_RUNS] + ['ar (end)']
    assert all(r['tau'] >= 1.0 and r['decode_tokens_per_s'] > 0 for r in rows)
    for r in rows:
      picked = ([p['choice'].split('(')[0] for p in r['auto_parts']] if r['method'] == 'auto'
                else [r['method']])
      assert (r['expected_tau'] is not None) == any(p in ('ddtree', 'd2sd_tree') for p in picked)
  assert [r['gamma'] for r in res['scaling']['gamma']] == [4, 8, 16]
  assert [r['n_branches'] for r in res['scaling']['branches']] == [1, 2, 4]
  points = res['pareto']['points']
  assert {(p['steps'], p['leniency']) for p in points} == {(1, 0.0), (1, 0.5), (2, 0.0), (2, 0.5)}
  assert all(p['agreement'] == 1.0 for p in points if p['leniency'] == 0.0)
  assert any(p['frontier'] for p in points)
  assert any(r.get('summary') == 'drafter_quality' for r in res['calibration']['rows'])
  for png in ('ladder.png', 'pareto.png', 'calibration.png'):
    assert (out / png).stat().st_size > 1000, png
  md = subprocess.run([sys.executable, script, '--markdown', '--out', str(out)], cwd=root,
                      capture_output=True, text=True, timeout=600, check=True).stdout
  assert '| d2sd_pld |' in md and '| steps | λ |' in md and 'calibration:' in md
  assert 'best-first trees at 16 nodes, heldout_code_plain' in md and '| d2sd_tree |' in md
  assert 'sampling (temperature 0.7, top_p 0.95, seed 0), trees at 16 nodes, humaneval_chat' in md


def test_the_readme_and_results_page_hold_the_tables_the_command_prints():
  """README.md's headline table and docs/results.md's tables are what `reproduce.py --markdown
  --write` writes from results/*.json, and every section names the run that measured it."""
  root = ROOT
  out = os.path.join(root, 'results')
  assert reproduce.generated(os.path.join(root, 'README.md')) == reproduce.headline(out)
  assert reproduce.generated(os.path.join(root, 'docs', 'results.md')) == reproduce.markdown(
      out).strip('\n')
  with open(os.path.join(out, 'reproduce.json')) as f:
    runs = json.load(f)['runs']
  # every section's record, and those of prompt sets rerun alone (--sets: 'trees:prose_chat')
  assert set(reproduce.SECTIONS) <= set(runs)
  assert all(k.split(':')[0] in reproduce.PER_SET and k.split(':')[1] in reproduce.PROMPT_SETS
             for k in set(runs) - set(reproduce.SECTIONS))
  assert all(r['date'] and r['machine'] and r['command'].startswith(
      'python benchmarks/reproduce.py') for r in runs.values())
  assert '(ladder: ' in reproduce.headline(out) and 'no run record' not in reproduce.markdown(out)


def test_generated_blocks_are_replaced_and_nothing_else(tmp_path):
  page = tmp_path / 'p.md'
  page.write_text(f'intro\n{reproduce.BEGIN}\nold table\n{reproduce.END}\noutro\n')
  reproduce.replace_generated(str(page), '| new |')
  assert page.read_text() == f'intro\n{reproduce.BEGIN}\n| new |\n{reproduce.END}\noutro\n'
  page.write_text('no markers\n')
  with pytest.raises(SystemExit, match='needs one'):
    reproduce.replace_generated(str(page), 'x')
  record = reproduce.run_record(['--only', 'pareto'], list(reproduce.SHIPPED))
  assert record['command'] == 'python benchmarks/reproduce.py --only pareto'
  assert record['machine'] and record['date'].endswith('UTC')
  assert record['drafters'] == reproduce.drafters_digest(reproduce.SHIPPED)
