"""method='auto' over one request (d2sd_jax/decode/auto_policy.py) on a record of its own: the
first tokens timed, then batch by batch the candidate the measurements rank first. The
decoding itself is faked: these are the policy's decisions, given what batches measure."""
import json

import pytest

from d2sd_jax.decode import auto_policy
from d2sd_jax.decode import auto_record
from d2sd_jax.decode import options as options_lib

ROWS = {'ar': ('ar', 1.0, 1.0), 'pld': ('pld', 1.3, 1.4), 'dflash': ('dflash', 1.8, 1.5),
        'd2sd_tree(N=8)': ('d2sd_tree', 3.1, 1.7)}


@pytest.fixture(autouse=True)
def unshrunk(monkeypatch):
  """The decisions below are given the τ the batches measure, as measured (Record.learn's
  shrinkage toward the prior has tests of its own, and one here that switches it back on)."""
  monkeypatch.setattr(auto_record, 'PRIOR_CYCLES', 0)


def prior_policy(tmp_path, lines, rows=None):
  """A policy over a record from a prior (`rows`, ROWS by default: τ and cycles in AR steps),
  saved at r.json."""
  table = {k: {'method': m, 'spec': {'tree_budget': 8} if m == 'd2sd_tree' else {}, 'tau': t,
               'cycle_ar_steps': c, 'predicted_tokens_per_ar_step': t / c}
           for k, (m, t, c) in (rows or ROWS).items()}
  record = auto_record.Record(auto_choice='d2sd_tree(N=8)', auto_candidates=table,
                              source='prior')
  path = str(tmp_path / 'r.json')
  record.save(path)
  request = options_lib.Options(method='auto', spec={'tree_budget': 16, 'leniency': 0.0})
  return auto_policy.Policy(request, record, path, {'auto_choice': record.auto_choice},
                            log=lines.append)


def batch(tokens, cycles, seconds, steps=None):
  return {'decode_tokens': tokens, 'cycles': cycles, 'decode_s': seconds,
          'decode_steps': cycles if steps is None else steps}


def test_the_first_tokens_time_ar_then_each_pick_until_one_is_timed_or_the_bound(tmp_path,
                                                                                 monkeypatch):
  """AR first (its step turns the prior's AR steps into time), then the prior's pick, then
  the pick that measurement leads to, at most TIMED_FIRST programs; the options each runs with
  are its own knobs over the request's (tree_budget, the request's cap, dropped)."""
  lines, calls = [], []
  policy = prior_policy(tmp_path, lines, {**ROWS, 'pld': ('pld', 1.6, 1.2)})
  # AR: 50 ms a step; d2sd_tree: τ 1.25 at 85 ms (14.7 tokens/s < AR's 20); then pld
  # (1.6 / 60 ms: 26.7 tokens/s) would be next
  figures = {'ar': batch(20, 20, 1.0), 'd2sd_tree(N=8)': batch(25, 20, 1.7),
             'pld': batch(20, 20, 1.4)}

  def time_candidate(options, label):
    calls.append((label, options.method, dict(options.spec)))
    return figures[label], 0.25
  monkeypatch.setattr(auto_policy, 'TIMED_FIRST', 2)
  assert policy.time_first(time_candidate, batch=1) == 0.5  # the seconds compiling
  assert [c[0] for c in calls] == ['ar', 'd2sd_tree(N=8)']  # the bound: pld is not timed
  assert calls[1][1:] == ('d2sd_tree', {'leniency': 0.0, 'tree_budget': 8})
  assert policy.stats()['auto_timed'] == ['ar', 'd2sd_tree(N=8)']
  # the first batch decodes with the best prediction now: pld, untimed
  assert policy.label == 'pld' and policy.options.method == 'pld'
  saved = auto_record.Record.load(policy.path)
  assert saved.measured.keys() == {'ar', 'd2sd_tree(N=8)'} and saved.auto_choice == 'pld'
  # a record whose AR step is timed already is not timed again
  calls.clear()
  assert policy.time_first(time_candidate, batch=1) == 0.0 and not calls


def test_a_batch_measured_slower_moves_the_next_batch_and_says_so(tmp_path):
  """After each batch the record learns it; when another candidate now predicts more
  tokens/s, the next batch decodes with it and one line says why. After the last batch
  nothing switches (no batch is left to decode), and the parts say who decoded what."""
  lines = []
  policy = prior_policy(tmp_path, lines)
  # d2sd_tree: τ 3.0 at 50 ms a cycle, 60 tokens/s; the others follow the AR step it implies
  # (50 / 1.7 ms): AR 34, dflash 40, pld 31.6 tokens/s
  policy.observe(batch(60, 20, 1.0), prompts=1, batch=1, more=True)
  assert policy.label == 'd2sd_tree(N=8)' and not lines
  # then τ 1.0: (20 + 60/2) / (20 + 20/2) = 1.67 at 50 ms, 33.3 tokens/s: AR's 34 is the best
  # prediction now, but within SWITCH_MARGIN of it (one prompt's noise): d2sd_tree goes on,
  # and stays the record's choice, where the next request would start
  policy.observe(batch(20, 20, 1.0), prompts=1, batch=1, more=True)
  table = policy.record.auto_candidates
  assert max(table, key=lambda k: table[k]['predicted_tokens_per_s']) == 'ar'
  assert policy.record.auto_choice == policy.label == 'd2sd_tree(N=8)' and not lines
  # then τ 0.5 a cycle (a row that finished early): (10 + 25) / (20 + 15) = 1 at 50 ms, 20/s
  policy.observe(batch(10, 20, 1.0), prompts=1, batch=1, more=True)
  assert policy.label == 'ar' and policy.options.method == 'ar'
  assert lines == ['auto: after 3 prompts, d2sd_tree(N=8) now predicts 20.00 tokens/s and ar '
                   '34.00 tokens/s: switching']
  # AR measures 50 ms a step (20 tokens/s, as d2sd_tree), but on the last batch:
  # nothing is left to decode, so nothing switches
  policy.observe(batch(20, 20, 1.0), prompts=1, batch=1, more=False)
  assert policy.label == 'ar' and len(lines) == 1
  stats = policy.stats()
  assert stats['auto_parts'] == [{'choice': 'd2sd_tree(N=8)', 'prompts': 3},
                                 {'choice': 'ar', 'prompts': 1}]
  assert stats['auto_learned'] and stats['auto_choice'] == 'd2sd_tree(N=8)'  # (the first)
  saved = json.load(open(policy.path))
  assert saved['source'] == 'prior+measured'


def test_a_probed_record_decodes_everything_at_once_and_learns_nothing(tmp_path):
  lines = []
  policy = prior_policy(tmp_path, lines)
  policy.record.source = 'probed'
  before = json.load(open(policy.path))
  assert not policy.learns
  assert policy.time_first(lambda *_: pytest.fail('timed a probed choice'), batch=1) == 0.0
  policy.observe(batch(22, 20, 2.0), prompts=2, batch=1, more=True)
  assert policy.parts == [] and 'auto_parts' not in policy.stats() and not lines
  assert json.load(open(policy.path)) == before


def test_a_batch_too_short_to_time_leaves_the_prior_in_charge(tmp_path):
  """A batch of fewer loop steps than MIN_PROBE_CYCLES times nothing: the record keeps its
  prior's predictions (tokens per AR step, no tokens/s), and the policy follows its choice."""
  lines = []
  policy = prior_policy(tmp_path, lines)
  policy.label = 'pld'  # (decoding something the record does not rank first)
  policy.observe(batch(6, 3, 0.1), prompts=1, batch=1, more=True)
  assert policy.record.measured['pld']['decode_steps'] == 3
  assert 'predicted_tokens_per_s' not in policy.record.auto_candidates['pld']
  assert policy.label == 'd2sd_tree(N=8)'
  assert lines == ['auto: after 1 prompts, pld now predicts an untimed rate and d2sd_tree(N=8) '
                   'an untimed rate: switching']
  policy.observe(batch(6, 3, 0.1), prompts=1, batch=1, more=True)  # its own choice: no line
  assert len(lines) == 1


@pytest.mark.parametrize('prior_cycles', [auto_record.PRIOR_CYCLES, 0])
def test_a_hard_opening_does_not_hand_the_request_to_ar(tmp_path, monkeypatch, prior_cycles):
  """The first tokens of one prompt are a dozen cycles: a tree measured at τ 1.5 there (its
  prior: 3.1) is one hard opening, not the request. Shrunk toward its prior, it still ranks
  above AR and decodes the first batch; taken as measured (prior_cycles 0), it would fall below
  AR, which then decodes the request and teaches the trees nothing."""
  monkeypatch.setattr(auto_record, 'PRIOR_CYCLES', prior_cycles)
  policy = prior_policy(tmp_path, [])
  # AR: 50 ms a step (20 tokens/s); d2sd_tree: 18 tokens in 12 cycles of 85 ms (17.6 tokens/s
  # as measured, (18 + 16 x 3.1) / 28 = 2.41 a cycle, 28.4 tokens/s shrunk)
  figures = {'ar': batch(32, 32, 1.6), 'd2sd_tree(N=8)': batch(18, 12, 12 * 0.085)}
  policy.time_first(lambda options, label: (figures[label], 0.0), batch=1)
  table = policy.record.auto_candidates
  assert policy.stats()['auto_timed'] == ['ar', 'd2sd_tree(N=8)']
  if prior_cycles:
    assert table['d2sd_tree(N=8)']['tau'] == pytest.approx(
        (18 + prior_cycles * 3.1) / (12 + prior_cycles), abs=1e-3)
    assert policy.label == 'd2sd_tree(N=8)'
  else:
    assert table['d2sd_tree(N=8)']['tau'] == 1.5 and policy.label == 'ar'


def test_an_adaptive_trees_opening_below_prompt_lookup_does_not_hand_it_the_request(tmp_path):
  """On a request that repeats its prompt, AR's timing tokens show prompt lookup taking far
  more than its prior said, and the adaptive tree (which verifies lookup's proposal alone when
  that promises more) is timed next. Its opening measures below prompt lookup's prediction (its
  first cycles draft before it has a rate to weigh lookup against): that is the opening, not
  the request, so it decodes the first batch and prompt lookup is not timed. The batch it
  decodes is its measurement: below prompt lookup by the margin, the next batch is lookup's."""
  rows = {**ROWS, 'adaptive': ('d2sd_tree', 2.0, 1.8)}
  lines = []
  policy = prior_policy(tmp_path, lines, rows)
  policy.record.auto_candidates['adaptive']['spec'] = {'adaptive': True, 'tree_budget': 32}
  policy.record.auto_choice = policy.label = 'adaptive'
  prompt = [5, 6, 7, 8, 9, 10, 11, 12] * 4
  repeat = {'prompt_ids': [prompt], 'completion_ids': [prompt]}  # lookup takes it all
  figures = {'ar': batch(32, 32, 1.6, steps=32), 'adaptive': batch(32, 16, 16 * 0.09),
             'pld': batch(32, 8, 8 * 0.05)}
  calls = []

  def time_candidate(options, label):
    calls.append(label)
    return {**figures[label], **repeat}, 0.0
  policy.time_first(time_candidate, batch=1)
  table = policy.record.auto_candidates
  # the opening as measured: 2 tokens a cycle of 90 ms, 22 tokens/s (unshrunk), far below
  # what prompt lookup predicts now
  assert 32 / 16 / 0.09 < table['pld']['predicted_tokens_per_s'] / 1.5
  assert calls == ['ar', 'adaptive'] and policy.label == 'adaptive'
  assert policy.record.measured['adaptive']['opening']
  # a whole batch measured the same: its measurement rules, and prompt lookup decodes next
  policy.observe({**batch(96, 48, 48 * 0.09), **repeat}, prompts=1, batch=1, more=True)
  assert 'opening' not in policy.record.measured['adaptive']
  assert policy.label == 'pld' and len(lines) == 1
