"""Record.learn (d2sd_jax/decode/auto_record.py): how a batch's measurement moves the remembered
record's predictions, on records written by hand (no model)."""
import copy
import json

import pytest

from d2sd_jax.decode import auto_record
from d2sd_jax.spec_decode import replay


def learn(path, measured: dict, batch: int, label=None, opening=False) -> auto_record.Record:
  """Record.learn on the record saved at `path`, saved back (as auto_policy.Policy does)."""
  record = auto_record.Record.load(str(path))
  record.learn(measured, batch, label, opening=opening)
  record.save(str(path))
  return record


def shrunk(tokens, cycles, prior_tau):
  """A measured τ as Record.learn predicts from it: shrunk toward the prior's."""
  return (tokens + auto_record.PRIOR_CYCLES * prior_tau) / (cycles + auto_record.PRIOR_CYCLES)


def _prior_record(rows: dict) -> dict:
  """A record as from_prior writes it: {label: (method, tau, cycle in AR steps)}."""
  return {'version': auto_record.VERSION, 'source': 'prior', 'measured': {},
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
  rec = learn(str(path), {'decode_tokens': 20, 'cycles': 20, 'decode_s': 1.0,
                                     'decode_steps': 20}, 1, label='ar')
  assert rec.auto_choice == 'd2sd_tree(N=8)' and rec.prompt_scale == 1.0
  assert rec.auto_candidates['pld']['cycle_ms'] == pytest.approx(1.4 * 50)
  assert rec.auto_candidates['ar']['predicted_tokens_per_s'] == pytest.approx(20)
  short = {'decode_tokens': 10, 'cycles': 5, 'decode_s': 0.5, 'decode_steps': 5}
  rec = learn(str(path), short, 1)  # 5 steps < MIN_PROBE_CYCLES: nothing to time yet
  assert rec.auto_choice == 'd2sd_tree(N=8)'
  assert rec.measured['d2sd_tree(N=8)'] == dict(short, unit_s=0.5)
  assert rec.auto_candidates['d2sd_tree(N=8)']['tau'] == 3.1  # (unchanged)
  # 35 cycles more at 0.1 s (the speculative AR step: 0.1 / 1.7 s); the earlier 5 weigh half
  rec = learn(str(path), {'decode_tokens': 62, 'cycles': 35, 'decode_s': 3.5,
                                     'decode_steps': 35}, 1)
  assert rec.measured['d2sd_tree(N=8)'] == {'decode_tokens': 67, 'cycles': 37.5,
                                               'decode_s': 3.75, 'decode_steps': 37.5,
                                               'unit_s': 3.75}
  table, ar_s, tau = rec.auto_candidates, 0.1 / 1.7, shrunk(67, 37.5, 3.1)
  scale = (tau - 1) / (3.1 - 1)
  assert rec.prompt_scale == pytest.approx(scale, abs=1e-4)
  assert table['d2sd_tree(N=8)']['tau'] == pytest.approx(tau, abs=1e-3)
  assert table['ddtree(N=4)']['tau'] == pytest.approx(1 + 0.9 * scale, abs=1e-3)
  assert table['dflash']['tau'] == pytest.approx(1 + 0.7 * scale, abs=1e-3)
  assert table['pld']['tau'] == 1.7 and table['ar']['tau'] == 1.0
  for label, (method, _, steps) in rows.items():
    if method not in ('ar', 'pld'):  # the drafters' measured cycles set the others' AR step
      assert table[label]['cycle_ms'] == pytest.approx(1e3 * steps * ar_s, rel=1e-3)
  assert table['ar']['cycle_ms'] == pytest.approx(50)  # AR keeps its own timing,
  assert table['pld']['cycle_ms'] == pytest.approx(1.4 * 50)  # and prompt lookup follows it
  # pld 1.7 / (1.4 * 50 ms) = 24.3 tokens/s, AR 20, d2sd_tree 2.18 / 100 ms = 21.8
  assert rec.auto_choice == 'pld' and rec.source == 'prior+measured'
  # pld measured poorly on these prompts too, at length: its measurement (shrunk toward its
  # prior) is its prediction, and the drafters' scale is unchanged by it
  rec = learn(str(path), {'decode_tokens': 220, 'cycles': 200, 'decode_s': 200 * 1.4 *
                                     ar_s, 'decode_steps': 200}, 1)
  table = rec.auto_candidates
  assert table['pld']['tau'] == pytest.approx(shrunk(220, 200, 1.7), abs=1e-3)
  assert rec.prompt_scale == pytest.approx(scale, abs=1e-4)
  assert rec.auto_choice == 'd2sd_tree(N=8)'  # 21.8 tokens/s, AR 20, pld 14.2
  # a probed record is not the prior's to refine
  path.write_text(json.dumps(dict(_prior_record(rows), source='probed')))
  probed = auto_record.Record.load(str(path))
  before = copy.deepcopy(probed.as_json())
  assert probed.learn(short, 1).as_json() == before and probed.measured == {}


def test_learn_reads_a_timed_candidates_slower_cycle_as_the_machines_drift(tmp_path):
  """A candidate's programs have fixed shapes, so once timed, its cycle measured slower later
  is the machine slowing down: every candidate's predicted cycle, measured or not, slows with
  it. A candidate timed while the machine was fast does not overtake the one decoding now."""
  path = tmp_path / 'r.json'
  rows = {'ar': ('ar', 1.0, 1.0), 'pld': ('pld', 1.3, 1.4), 'ddtree(N=4)': ('ddtree', 1.5, 1.5),
          'd2sd_tree(N=8)': ('d2sd_tree', 3.1, 1.7)}
  path.write_text(json.dumps(_prior_record(rows)))
  learn(str(path), {'decode_tokens': 20, 'cycles': 20, 'decode_s': 1.0,
                               'decode_steps': 20}, 1, label='ar')  # AR: 50 ms a step
  # d2sd_tree: τ 1.9 over 400 cycles (1.96 with its prior's 3.1) at 100 ms a cycle, 19.6
  # tokens/s, below AR's 20: AR decodes next
  rec = learn(str(path), {'decode_tokens': 760, 'cycles': 400, 'decode_s': 40.0,
                                     'decode_steps': 400}, 1)
  assert rec.auto_choice == 'ar' and rec.machine == 1.0
  table = rec.auto_candidates
  rate = shrunk(760, 400, 3.1) / 0.1
  assert table['d2sd_tree(N=8)']['predicted_tokens_per_s'] == pytest.approx(rate, abs=0.01)
  # the machine slows by a fifth: AR runs at 60 ms a step, and so would every other program
  rec = learn(str(path), {'decode_tokens': 20, 'cycles': 20, 'decode_s': 1.2,
                                     'decode_steps': 20}, 1)
  table = rec.auto_candidates
  assert rec.machine == pytest.approx(1.2)
  assert table['ar']['cycle_ms'] == pytest.approx(60)
  assert table['d2sd_tree(N=8)']['cycle_ms'] == pytest.approx(120)  # not its 100 ms of before
  assert table['pld']['cycle_ms'] == pytest.approx(1.4 * 60)
  assert table['ddtree(N=4)']['cycle_ms'] == pytest.approx(1.5 * 100 / 1.7 * 1.2)
  assert table['d2sd_tree(N=8)']['predicted_tokens_per_s'] == pytest.approx(rate / 1.2,
                                                                            abs=0.01)
  assert rec.auto_choice == 'ar'  # 16.7 tokens/s against d2sd_tree's 16.3 (19.6 undrifted)
  # the machine recovers while AR decodes: every prediction speeds up alike
  rec = learn(str(path), {'decode_tokens': 20, 'cycles': 20, 'decode_s': 0.9,
                                     'decode_steps': 20}, 1)
  assert rec.machine == pytest.approx(0.9)
  assert rec.auto_candidates['d2sd_tree(N=8)']['cycle_ms'] == pytest.approx(90)
  assert rec.auto_candidates['ar']['cycle_ms'] == pytest.approx(45)


def test_learn_predicts_prompt_lookup_from_every_batchs_outputs(tmp_path):
  """Whatever decoded a batch, its outputs tell prompt lookup's τ on it (calibration.
  lookup_cycles), so a prior that underrates prompt lookup on a repetitive request is
  overruled by AR's timing tokens alone; later batches add to it, the earlier ones weighed by
  RECENCY."""
  path = tmp_path / 'r.json'
  rows = {'ar': ('ar', 1.0, 1.0), 'pld': ('pld', 1.3, 1.4),
          'd2sd_tree(N=8)': ('d2sd_tree', 2.0, 1.7)}
  path.write_text(json.dumps(_prior_record(rows)))
  prompt = [5, 6, 7, 8, 9, 10, 11, 12] * 3
  repeat = [5, 6, 7, 8, 9, 10, 11, 12] * 3  # the completion repeats the prompt
  cycles = replay.lookup_cycles(prompt, repeat, 8, 3)
  assert cycles < (len(repeat) - 1) / 3
  rec = learn(str(path), {'decode_tokens': 23, 'cycles': 23, 'decode_s': 1.15,
                                     'decode_steps': 23, 'prompt_ids': [prompt],
                                     'completion_ids': [repeat]}, 1, label='ar')
  # what it would have taken on them, shrunk toward its prior as every measured τ is
  assert rec.auto_candidates['pld']['tau'] == pytest.approx(shrunk(23, cycles, 1.3), abs=1e-3)
  assert rec.auto_choice == 'pld'
  # a batch that repeats nothing: lookup proposes nothing, one token a cycle
  fresh = list(range(100, 124))
  rec = learn(str(path), {'decode_tokens': 23, 'cycles': 23, 'decode_s': 1.15,
                                     'decode_steps': 23, 'prompt_ids': [prompt],
                                     'completion_ids': [fresh]}, 1, label='ar')
  assert rec.auto_candidates['pld']['tau'] == pytest.approx(
      shrunk(23 + 0.5 * 23, 23 + 0.5 * cycles, 1.3), abs=1e-3)


def test_learn_predicts_an_untimed_adaptive_tree_at_least_prompt_lookups_rate(tmp_path):
  """An adaptive d2sd_tree takes lookup-only cycles when they promise more, so once a request
  shows prompt lookup taking far more than its prior said, the untimed adaptive tree predicts
  prompt lookup's tokens/s and is chosen over prompt lookup itself; one with lookup_cycles off
  is not. Timed on an opening alone, the bound still holds; timed on a batch, its own
  measurement predicts it."""
  path = tmp_path / 'r.json'
  rows = {'ar': ('ar', 1.0, 1.0), 'pld': ('pld', 1.3, 1.4),
          'd2sd_tree(N=8)': ('d2sd_tree', 2.0, 1.7),
          'd2sd_tree(adaptive)': ('d2sd_tree', 1.9, 1.8),
          'd2sd_tree(adaptive, no lookup)': ('d2sd_tree', 1.9, 1.8)}
  record = _prior_record(rows)
  record['auto_candidates']['d2sd_tree(adaptive)']['spec'] = {'adaptive': True,
                                                              'tree_budget': 32}
  record['auto_candidates']['d2sd_tree(adaptive, no lookup)']['spec'] = {
      'adaptive': True, 'tree_budget': 32, 'lookup_cycles': False}
  path.write_text(json.dumps(record))
  assert [auto_record.takes_lookup_cycles(row) for row in record['auto_candidates'].values()
          ] == [False, False, False, True, False]
  prompt = [5, 6, 7, 8, 9, 10, 11, 12] * 3
  repeat = {'prompt_ids': [prompt], 'completion_ids': [prompt]}  # lookup takes it all
  rec = learn(str(path), {'decode_tokens': 23, 'cycles': 23, 'decode_s': 1.15,
                          'decode_steps': 23, **repeat}, 1, label='ar')
  table = rec.auto_candidates
  pld_rate = table['pld']['predicted_tokens_per_s']
  assert pld_rate > table['d2sd_tree(N=8)']['predicted_tokens_per_s'] > table['ar'][
      'predicted_tokens_per_s']
  # (the drafters' own prior: 1.9 tokens per 1.8 AR steps, below prompt lookup's now)
  assert table['d2sd_tree(adaptive, no lookup)']['predicted_tokens_per_s'] < pld_rate
  assert table['d2sd_tree(adaptive)']['predicted_tokens_per_s'] == pld_rate
  assert rec.auto_choice == 'd2sd_tree(adaptive)'
  # the policy times its opening, below prompt lookup's prediction: an opening is not the
  # request (its first cycles draft before it has a rate to weigh lookup against), so the
  # bound holds and it keeps the choice
  below = {'decode_tokens': 40, 'cycles': 20, 'decode_s': 2.0, 'decode_steps': 20, **repeat}
  rec = learn(str(path), below, 1, opening=True)
  table = rec.auto_candidates
  assert table['d2sd_tree(adaptive)']['measured']
  assert shrunk(40, 20, 1.9) / 0.1 < table['pld']['predicted_tokens_per_s']
  assert table['d2sd_tree(adaptive)']['predicted_tokens_per_s'] == table['pld'][
      'predicted_tokens_per_s']
  assert rec.auto_choice == 'd2sd_tree(adaptive)'
  # it decodes a whole batch, and measures below prompt lookup's prediction: its measurement
  # rules (the opening's totals weighed by RECENCY)
  rec = learn(str(path), below, 1)
  table = rec.auto_candidates
  assert 'opening' not in rec.measured['d2sd_tree(adaptive)']
  assert table['d2sd_tree(adaptive)']['predicted_tokens_per_s'] == pytest.approx(
      shrunk(60, 30, 1.9) / 0.1, abs=0.01)
  assert rec.auto_choice == 'pld'
