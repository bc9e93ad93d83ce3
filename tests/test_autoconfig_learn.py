"""method='auto''s learning (d2sd_jax/decode/autoconfig.learn): how a batch's measurement moves
the remembered record's predictions, on records written by hand (no model)."""
import json

import pytest

from d2sd_jax.decode import autoconfig


def _prior_record(rows: dict) -> dict:
  """A record as from_prior writes it: {label: (method, tau, cycle in AR steps)}."""
  return {'version': autoconfig.RECORD_VERSION, 'source': 'prior', 'measured': {},
          'auto_choice': max(rows, key=lambda k: rows[k][1] / rows[k][2]),
          'predicted_tokens_per_s': None,
          'auto_candidates': {k: {'method': m, 'spec': {}, 'tau': t, 'cycle_ar_steps': c}
                              for k, (m, t, c) in rows.items()}}


def test_learn_scales_the_drafters_unmeasured_candidates_by_what_the_measured_ones_showed(
    tmp_path):
  """A drafter candidate measured below its prior lowers every unmeasured drafter candidate's
  extra tokens by the same ratio (prompt lookup's and AR's stay), the drafter candidates'
  cycles follow the AR step their measurement implies (prompt lookup's follow AR's own), and
  a decode too short to time accumulates without moving the choice."""
  path = tmp_path / 'r.json'
  rows = {'ar': ('ar', 1.0, 1.0), 'pld': ('pld', 1.7, 1.4), 'dflash': ('dflash', 1.7, 1.5),
          'ddtree(N=4)': ('ddtree', 1.9, 1.2), 'd2sd_tree(N=8)': ('d2sd_tree', 3.1, 1.7)}
  path.write_text(json.dumps(_prior_record(rows)))
  assert json.loads(path.read_text())['auto_choice'] == 'd2sd_tree(N=8)'
  # AR timed alone (0.05 s a step): every cycle is its AR steps at that, the choice stays
  rec = autoconfig.learn(str(path), {'decode_tokens': 20, 'cycles': 20, 'decode_s': 1.0,
                                     'decode_steps': 20}, 1, label='ar')
  assert rec['auto_choice'] == 'd2sd_tree(N=8)' and rec['prompt_scale'] == 1.0
  assert rec['auto_candidates']['pld']['cycle_ms'] == pytest.approx(1.4 * 50)
  assert rec['auto_candidates']['ar']['predicted_tokens_per_s'] == pytest.approx(20)
  short = {'decode_tokens': 10, 'cycles': 5, 'decode_s': 0.5, 'decode_steps': 5}
  rec = autoconfig.learn(str(path), short, 1)  # 5 steps < MIN_PROBE_CYCLES: nothing to time yet
  assert rec['auto_choice'] == 'd2sd_tree(N=8)'
  assert rec['measured']['d2sd_tree(N=8)'] == dict(short, unit_s=0.5)
  assert rec['auto_candidates']['d2sd_tree(N=8)']['tau'] == 3.1  # (unchanged)
  # 35 cycles more at 0.1 s (the speculative AR step: 0.1 / 1.7 s); the earlier 5 weigh half
  rec = autoconfig.learn(str(path), {'decode_tokens': 62, 'cycles': 35, 'decode_s': 3.5,
                                     'decode_steps': 35}, 1)
  assert rec['measured']['d2sd_tree(N=8)'] == {'decode_tokens': 67, 'cycles': 37.5,
                                               'decode_s': 3.75, 'decode_steps': 37.5,
                                               'unit_s': 3.75}
  table, ar_s, tau = rec['auto_candidates'], 0.1 / 1.7, 67 / 37.5
  scale = (tau - 1) / (3.1 - 1)
  assert rec['prompt_scale'] == pytest.approx(scale, abs=1e-4)
  assert table['d2sd_tree(N=8)']['tau'] == pytest.approx(tau, abs=1e-3)
  assert table['ddtree(N=4)']['tau'] == pytest.approx(1 + 0.9 * scale, abs=1e-3)
  assert table['dflash']['tau'] == pytest.approx(1 + 0.7 * scale, abs=1e-3)
  assert table['pld']['tau'] == 1.7 and table['ar']['tau'] == 1.0
  for label, (method, _, steps) in rows.items():
    if method not in ('ar', 'pld'):  # the drafters' measured cycles set the others' AR step
      assert table[label]['cycle_ms'] == pytest.approx(1e3 * steps * ar_s, rel=1e-3)
  assert table['ar']['cycle_ms'] == pytest.approx(50)  # AR keeps its own timing,
  assert table['pld']['cycle_ms'] == pytest.approx(1.4 * 50)  # and prompt lookup follows it
  # pld 1.7 / (1.4 * 50 ms) = 24.3 tokens/s, AR 20, ddtree 1.34 / (1.2 * 58.8 ms) = 18.9
  assert rec['auto_choice'] == 'pld' and rec['source'] == 'prior+measured'
  # pld measured poorly on these prompts too: its measurement is its prediction, and the
  # drafters' scale is unchanged by it
  rec = autoconfig.learn(str(path), {'decode_tokens': 22, 'cycles': 20, 'decode_s': 20 * 1.4 *
                                     ar_s, 'decode_steps': 20}, 1)
  table = rec['auto_candidates']
  assert table['pld']['tau'] == pytest.approx(1.1) and rec['prompt_scale'] == pytest.approx(
      scale, abs=1e-4)
  assert rec['auto_choice'] == 'ar'  # 20 tokens/s, ddtree 18.9, pld 13.4
  # a probed record is not the prior's to refine
  path.write_text(json.dumps(dict(_prior_record(rows), source='probed')))
  assert autoconfig.learn(str(path), short, 1) is None


def test_learn_reads_a_timed_candidates_slower_cycle_as_the_machines_drift(tmp_path):
  """A candidate's programs have fixed shapes, so once timed, its cycle measured slower later
  is the machine slowing down: every candidate's predicted cycle, measured or not, slows with
  it. A candidate timed while the machine was fast does not overtake the one decoding now."""
  path = tmp_path / 'r.json'
  rows = {'ar': ('ar', 1.0, 1.0), 'pld': ('pld', 1.3, 1.4), 'ddtree(N=4)': ('ddtree', 1.5, 1.5),
          'd2sd_tree(N=8)': ('d2sd_tree', 3.1, 1.7)}
  path.write_text(json.dumps(_prior_record(rows)))
  autoconfig.learn(str(path), {'decode_tokens': 20, 'cycles': 20, 'decode_s': 1.0,
                               'decode_steps': 20}, 1, label='ar')  # AR: 50 ms a step
  # d2sd_tree: τ 1.9 at 100 ms a cycle, 19 tokens/s, below AR's 20: AR decodes next
  rec = autoconfig.learn(str(path), {'decode_tokens': 38, 'cycles': 20, 'decode_s': 2.0,
                                     'decode_steps': 20}, 1)
  assert rec['auto_choice'] == 'ar' and rec['machine'] == 1.0
  table = rec['auto_candidates']
  assert table['d2sd_tree(N=8)']['predicted_tokens_per_s'] == pytest.approx(19, abs=0.01)
  # the machine slows by a fifth: AR runs at 60 ms a step, and so would every other program
  rec = autoconfig.learn(str(path), {'decode_tokens': 20, 'cycles': 20, 'decode_s': 1.2,
                                     'decode_steps': 20}, 1)
  table = rec['auto_candidates']
  assert rec['machine'] == pytest.approx(1.2)
  assert table['ar']['cycle_ms'] == pytest.approx(60)
  assert table['d2sd_tree(N=8)']['cycle_ms'] == pytest.approx(120)  # not its 100 ms of before
  assert table['pld']['cycle_ms'] == pytest.approx(1.4 * 60)
  assert table['ddtree(N=4)']['cycle_ms'] == pytest.approx(1.5 * 100 / 1.7 * 1.2)
  assert table['d2sd_tree(N=8)']['predicted_tokens_per_s'] == pytest.approx(19 / 1.2, abs=0.01)
  assert rec['auto_choice'] == 'ar'  # 16.7 tokens/s against d2sd_tree's 15.8 (19 undrifted)
  # the machine recovers while AR decodes: every prediction speeds up alike
  rec = autoconfig.learn(str(path), {'decode_tokens': 20, 'cycles': 20, 'decode_s': 0.9,
                                     'decode_steps': 20}, 1)
  assert rec['machine'] == pytest.approx(0.9)
  assert rec['auto_candidates']['d2sd_tree(N=8)']['cycle_ms'] == pytest.approx(90)
  assert rec['auto_candidates']['ar']['cycle_ms'] == pytest.approx(45)
