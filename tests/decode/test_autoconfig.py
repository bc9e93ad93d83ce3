"""method='auto' (d2sd_jax/decode/autoconfig.py): probing, the drafters' prior, learning batch
by batch, the remembered choice and its key (tiny target and drafters: cheap). How a batch's
measurement moves the remembered record's predictions (Record.learn): test_auto_record.py."""
import dataclasses
import json

import jax
import pytest

from d2sd_jax.decode import auto_policy
from d2sd_jax.decode import auto_record
from d2sd_jax.decode import autoconfig
from d2sd_jax.decode import generate as generate_lib
from d2sd_jax.decode import options as options_lib
from d2sd_jax.decode import runner as runner_lib
from d2sd_jax.formats import checkpoints
from d2sd_jax.formats import loaders
from d2sd_jax.models import drafter as D
from d2sd_jax.perf import throughput
from d2sd_jax.spec_decode import drafting
from d2sd_jax.spec_decode import replay

TDCFG = D.DrafterConfig(gamma=4, n_layers=1, d_model=32, n_heads=4, n_kv_heads=2, head_dim=8,
                        d_ff=48, feature_layers=(0, 2), rope_base=10000.0, norm_eps=1e-6)


@pytest.mark.slow
def test_auto_chooses_the_best_predicted_candidate_and_stays_lossless(tiny_folder, cost_cache,
                                                                      auto_choices, monkeypatch):
  probed = []  # the prompts each probe decode got
  real_decode = runner_lib.decode_prompts
  monkeypatch.setattr(runner_lib, 'decode_prompts',
                      lambda runner, tok, ids, *a, **k: probed.append(len(ids)) or
                      real_decode(runner, tok, ids, *a, **k))
  target = loaders.load_target(tiny_folder)
  cfg = target.cfg
  dcfg = dataclasses.replace(TDCFG, gamma=4)
  drafters = {'drafter1': (dcfg, D.init_params(dcfg, cfg, jax.random.PRNGKey(1))),
              'drafter2': (dcfg, D.init_params(dcfg, cfg, jax.random.PRNGKey(2)))}
  prompts = ['abcabcabcabc', 'hello hello hello']
  base = options_lib.Options(method='ar', max_new_tokens=10, chat=False)
  ar, _ = generate_lib.generate(target, drafters, prompts, base)
  probed.clear()
  auto, stats = generate_lib.generate(target, drafters, prompts,
                                  dataclasses.replace(base, method='auto'))
  assert [r['completion_ids'] for r in auto] == [r['completion_ids'] for r in ar]
  table = stats['auto_candidates']
  trees = {f'{m}(N={n})' for m in ('ddtree', 'd2sd_tree') for n in autoconfig.TREE_BUDGETS} | {
      'd2sd_tree(adaptive)'}
  assert set(table) == {'ar', 'pld(gamma=4)', 'dflash', 'd2sd(K=1)', 'd2sd(K=2)',
                        'd2sd_pld(K=1)'} | trees
  best = max(table, key=lambda k: table[k]['predicted_tokens_per_s'])
  assert stats['auto_choice'] == best
  assert stats['predicted_tokens_per_s'] == table[best]['predicted_tokens_per_s']
  assert stats['method'] == table[best]['method']
  # (the probe's time used; the adaptive tree's shapes measured, once)
  assert 'ar' not in check_cycle_sources(table, cost_cache, adaptive_files=1)
  # Each candidate's probe: the first prompt to warm up (it counts for τ), then the other,
  # timed; then the decode itself, both prompts in one batch-1 call.
  assert probed == [1, 1] * len(table) + [2], probed
  for row in table.values():
    expected = throughput.tokens_per_s(row['tau'], row['cycle_ms'] / 1e3, stats['batch_size'])
    assert abs(row['predicted_tokens_per_s'] - expected) <= 0.01 * expected + 0.01
  assert stats['auto_source'] == 'probed'

  # The choice is remembered: the same request decodes at once with it (no probe), ...
  remembered = list(auto_choices.iterdir())
  assert [str(p) for p in remembered] == [stats['auto_file']]
  probed.clear()
  again, stats2 = generate_lib.generate(target, drafters, prompts,
                                    dataclasses.replace(base, method='auto'))
  assert probed == [2] and stats2['auto_source'] == 'remembered'
  assert [r['completion_ids'] for r in again] == [r['completion_ids'] for r in ar]
  assert (stats2['method'], stats2['auto_choice'], stats2['auto_candidates']) == (
      stats['method'], best, table)
  # ... and the file is what decides: edited to another candidate, that one decodes.
  record = json.loads(remembered[0].read_text())
  other = next(k for k in table if table[k]['method'] != stats['method'])
  remembered[0].write_text(json.dumps(dict(record, auto_choice=other)))
  probed.clear()
  edited, stats3 = generate_lib.generate(target, drafters, prompts,
                                     dataclasses.replace(base, method='auto'))
  assert probed == [2] and stats3['method'] == table[other]['method']
  assert [r['completion_ids'] for r in edited] == [r['completion_ids'] for r in ar]
  # auto_refresh probes again and rewrites the record with the probes' own choice; with
  # probes this short (9 cycles at most) every cycle time is now the cost model's (three
  # candidates only: measuring the cost model is what takes time).
  probed.clear()
  monkeypatch.setattr(auto_record, 'MIN_PROBE_CYCLES', 10)
  every = autoconfig.candidates
  monkeypatch.setattr(autoconfig, 'candidates', lambda d, cap=0: every(d, cap)[:3])
  _, stats4 = generate_lib.generate(target, drafters, prompts,
                                dataclasses.replace(base, method='auto', auto_refresh=True))
  assert stats4['auto_source'] == 'probed' and len(probed) == 2 * 3 + 1
  assert check_cycle_sources(stats4['auto_candidates'], cost_cache, adaptive_files=1) == {
      'ar', 'pld(gamma=4)', 'dflash'}
  rewritten = json.loads(remembered[0].read_text())
  assert rewritten['auto_choice'] == stats4['auto_choice'] == max(
      rewritten['auto_candidates'],
      key=lambda k: rewritten['auto_candidates'][k]['predicted_tokens_per_s'])


def test_auto_weighs_every_registered_method_as_its_entry_declares(tiny_folder, cost_cache,
                                                                   auto_choices, monkeypatch):
  """Candidates come from the registry: a method added with `register` is weighed at its
  defaults, or in the configurations its entry declares, one whose drafters are missing or
  that declares none (auto=None, as the paper's ablations do) is not; probed, the added
  method decodes and the output is AR's."""
  monkeypatch.setitem(drafting.REGISTRY, 'pld_again', drafting.Method(drafting.pld))
  monkeypatch.setitem(drafting.REGISTRY, 'pld_wide', drafting.Method(
      drafting.pld, auto=lambda name, gamma: [(f'{name}(n=5)', {'ngram_max': 5})]))
  monkeypatch.setitem(drafting.REGISTRY, 'pld_hidden', drafting.Method(drafting.pld, auto=None))
  monkeypatch.setitem(drafting.REGISTRY, 'pld_drafted', drafting.Method(
      drafting.pld, drafters=('drafter1',)))
  weighed = {label: (m, k) for label, m, k in autoconfig.candidates({})}
  assert weighed == {'ar': ('ar', {}), 'pld(gamma=8)': ('pld', {'gamma': 8}),
                     'pld_again': ('pld_again', {'gamma': 8}),
                     'pld_wide(n=5)': ('pld_wide', {'gamma': 8, 'ngram_max': 5})}
  with_d1 = {label for label, _, _ in autoconfig.candidates({'drafter1': (TDCFG, None)})}
  assert 'pld_drafted' in with_d1 and not with_d1 & {'dflash_resample', 'dflash_dflash'}
  target = loaders.load_target(tiny_folder)
  prompts = ['abcabcabcabc', 'hello hello hello']
  base = options_lib.Options(method='ar', max_new_tokens=10, chat=False)
  ar, _ = generate_lib.generate(target, {}, prompts, base)
  auto, stats = generate_lib.generate(target, {}, prompts, dataclasses.replace(
      base, method='auto', auto_probe=True))
  assert set(stats['auto_candidates']) == set(weighed)
  assert stats['auto_candidates']['pld_wide(n=5)']['spec'] == {'gamma': 8, 'ngram_max': 5}
  assert stats['auto_candidates']['pld_again']['tau'] > 1  # it decoded, and drafts were taken
  assert [r['completion_ids'] for r in auto] == [r['completion_ids'] for r in ar]


@pytest.mark.parametrize('batch_size', [1, 3])
def test_auto_on_prompts_of_different_lengths_equals_ar(tiny_folder, cost_cache, monkeypatch,
                                                        batch_size):
  """Prompts in different prompt buckets (64 and 128 tokens wide): the probes, whose first
  prompt is shorter than the others, and the decode run one program per candidate and give
  AR's tokens."""
  target = loaders.load_target(tiny_folder)
  dcfg = dataclasses.replace(TDCFG, gamma=4)
  drafters = {'drafter1': (dcfg, D.init_params(dcfg, target.cfg, jax.random.PRNGKey(1))),
              'drafter2': (dcfg, D.init_params(dcfg, target.cfg, jax.random.PRNGKey(2)))}
  every = autoconfig.candidates  # AR, prompt lookup and D²SD: one of each kind of program
  monkeypatch.setattr(autoconfig, 'candidates',
                      lambda d, cap=0: [c for c in every(d, cap)
                                        if c[0] in ('ar', 'pld(gamma=4)', 'd2sd(K=1)')])
  prompts = ['short one', 'a much longer prompt, ' * 4, 'in between: ' * 3, 'x']
  lens = [len(target.tokenizer.encode_prompt(p, False)) for p in prompts]
  assert lens[0] <= runner_lib.PROMPT_BUCKET < lens[1]  # the first probe prompt is narrower
  base = options_lib.Options(method='ar', max_new_tokens=10, chat=False, batch_size=batch_size)
  ar, _ = generate_lib.generate(target, drafters, prompts, base)
  auto, stats = generate_lib.generate(target, drafters, prompts,
                                  dataclasses.replace(base, method='auto'))
  assert stats['auto_source'] == 'probed' and len(stats['auto_candidates']) == 3
  assert [r['completion_ids'] for r in auto] == [r['completion_ids'] for r in ar]


def check_cycle_sources(table: dict, cost_cache, adaptive_files: int = 0) -> set:
  """Each candidate's cycle time is its probe's where the probe ran long enough, the cost
  model's otherwise, and the cost model is measured (cached) only for those: the short ones.
  `adaptive_files`: the cost-cache files the adaptive tree's shapes were measured into (one
  per request kind and context that probed it: it chooses its size by them)."""
  short = {k for k in table if table[k]['probe_cycles'] < auto_record.MIN_PROBE_CYCLES}
  for label, row in table.items():
    assert row['tau'] >= 1.0 and row['cycle_ms'] > 0
    if label in short:
      assert row['cycle_ms'] == row['model_cycle_ms'] > 0, label
    else:
      assert row['cycle_ms'] == row['probe_cycle_ms'] and row['model_cycle_ms'] is None, label
  files = list(cost_cache.iterdir()) if cost_cache.exists() else []
  assert len(files) == bool(short) + adaptive_files, files
  return short


def test_remembered_key_separates_what_the_ranking_depends_on(tiny_folder):
  target = loaders.load_target(tiny_folder)
  dcfg = dataclasses.replace(TDCFG, gamma=4)
  d1 = (dcfg, D.init_params(dcfg, target.cfg, jax.random.PRNGKey(1)))
  d2 = (dcfg, D.init_params(dcfg, target.cfg, jax.random.PRNGKey(2)))
  base = options_lib.Options(method='auto', max_new_tokens=10, chat=False)
  key = lambda drafters=None, batch=1, longest=12, **o: autoconfig.remembered_key(  # noqa: E731
      target, {'drafter1': d1, 'drafter2': d2} if drafters is None else drafters,
      dataclasses.replace(base, **o), batch, longest)
  k0 = key()
  # the same context window (prompt + new tokens <= 256): the same key
  assert key() == k0 and key(longest=20) == k0 and key(max_new_tokens=40) == k0
  # the prompts' text is left out: only their length's window counts
  others = [key(batch=2), key(temperature=0.7), key(top_k=5), key(chat=True),
            key(spec={'tree_budget': 16}), key(max_new_tokens=300), key(longest=600),
            key(drafters={'drafter1': d1}),
            key(drafters={'drafter1': d1, 'drafter2': (dcfg, D.init_params(
                dcfg, target.cfg, jax.random.PRNGKey(3)))})]
  assert len({k0, *others}) == len(others) + 1
  assert key(auto_refresh=True, seed=5) == k0  # neither changes what wins


def test_an_unreadable_or_stale_remembered_choice_is_probed_again(tmp_path):
  drafters = {'drafter1': (TDCFG, None)}
  weighed = {label: (m, k) for label, m, k in autoconfig.candidates(drafters)}
  good = {'version': auto_record.VERSION, 'auto_choice': 'dflash',
          'predicted_tokens_per_s': 1.0, 'cost_device': 'cpu',
          'auto_candidates': {label: {'method': m, 'spec': k, 'predicted_tokens_per_s': 1.0}
                              for label, (m, k) in weighed.items()}}
  path, said = tmp_path / 'c.json', []
  assert autoconfig._read_remembered(str(path), drafters, said.append) is None and not said
  path.write_text(json.dumps(good))
  got = autoconfig._read_remembered(str(path), drafters, said.append)
  assert {k: v for k, v in got.as_json().items() if k in good} == good and not said
  bad = {'truncated': json.dumps(good)[:40],
         'no choice': json.dumps({k: v for k, v in good.items() if k != 'auto_choice'}),
         'another version': json.dumps(dict(good, version=auto_record.VERSION + 1)),
         'a field of the wrong type': json.dumps(dict(good, machine='fast')),
         'a field it does not know': json.dumps(dict(good, chosen_by='hand')),
         'a choice not among its candidates': json.dumps(dict(good, auto_choice='d2sd(K=9)')),
         'other candidates': json.dumps(dict(good, auto_candidates={
             **good['auto_candidates'], 'd2sd(K=9)': {'method': 'd2sd', 'spec': {}}})),
         'other knobs': json.dumps(dict(good, auto_candidates={
             **good['auto_candidates'], 'dflash': {'method': 'dflash', 'spec': {'gamma': 3}}}))}
  for why, text in bad.items():
    said.clear()
    path.write_text(text)
    assert autoconfig._read_remembered(str(path), drafters, said.append) is None, why
    assert len(said) == 1 and str(path) in said[0] and 'choosing again' in said[0], (why, said)


def write_prior(path, target, drafters, taus_ratios: dict, batch: int = 1):
  """A priors file for these drafters: {label: (tau, cycle in AR steps)}."""
  weighed = {label: (m, k) for label, m, k in autoconfig.candidates(drafters)}
  record = {'target': checkpoints.target_fingerprint(target),
            'platform': jax.devices()[0].platform, 'batch': batch,
            'drafters': {n: autoconfig.params_digest(p) for n, (_, p) in drafters.items()},
            'candidates': {label: {'method': weighed[label][0], 'spec': weighed[label][1],
                                   'tau': tau, 'cycle_ar_steps': ratio}
                           for label, (tau, ratio) in taus_ratios.items()},
            'run': {'date': 'test', 'machine': 'test', 'command': 'test'}}
  path.write_text(json.dumps({'version': autoconfig.RECORD_PRIORS, 'records': [record]}))
  return str(path)


def _auto_with_prior(tiny_folder, monkeypatch, tmp_path, taus: dict, drafter2: bool = False):
  """A tiny target and drafter 1 (gamma 4), and drafter 2 with `drafter2`; auto weighs the
  candidates of the prior `taus` ({label: (τ, cycle in AR steps)}) only; every decode_prompts
  call is recorded as (its prompts, its runner's class). Returns (target, drafters, calls)."""
  target = loaders.load_target(tiny_folder)
  dcfg = dataclasses.replace(TDCFG, gamma=4)
  drafters = {n: (dcfg, D.init_params(dcfg, target.cfg, jax.random.PRNGKey(i)))
              for i, n in enumerate(('drafter1', 'drafter2')[:1 + drafter2], start=1)}
  every = autoconfig.candidates
  monkeypatch.setattr(autoconfig, 'candidates',
                      lambda d, cap=0: [c for c in every(d, cap) if c[0] in taus])
  monkeypatch.setenv('D2SD_AUTO_PRIORS', write_prior(tmp_path / 'priors.json', target, drafters,
                                                     taus))
  calls, real_decode = [], runner_lib.decode_prompts
  monkeypatch.setattr(runner_lib, 'decode_prompts', lambda runner, tok, ids, *a, **k: calls.append(
      (len(ids), type(runner).__name__)) or real_decode(runner, tok, ids, *a, **k))
  return target, drafters, calls


def test_auto_from_the_drafters_prior_chooses_at_once_then_learns(tiny_folder, auto_choices,
                                                                  monkeypatch, tmp_path):
  """With a prior for these drafters, auto probes nothing: it decodes the first batch with the
  candidate of highest τ per AR step. Each batch measures its candidate, and the next batch
  decodes with the best prediction given the measurements; the next request starts from the
  remembered choice. auto_probe times every candidate instead. Every output equals AR's."""
  # pld's prior τ is out of reach (gamma 4: at most 4 per cycle), dflash's just above it
  target, drafters, calls = _auto_with_prior(
      tiny_folder, monkeypatch, tmp_path,
      {'ar': (1.0, 1.0), 'pld(gamma=4)': (50.0, 1.0), 'dflash': (4.5, 1.0)})
  monkeypatch.setattr(auto_record, 'MIN_PROBE_CYCLES', 1)
  # AR's step is not timed here (a tiny model's AR beats every candidate: nothing would move),
  # and measurements add up whole, unshrunk by the prior (their recency weights and the
  # shrinkage: test_learn_... below)
  monkeypatch.setattr(auto_policy, 'AR_TIMING_TOKENS', 1)
  monkeypatch.setattr(auto_record, 'RECENCY', 1.0)
  monkeypatch.setattr(auto_record, 'PRIOR_CYCLES', 0)
  prompts = ['abcabcabcabc', 'hello hello hello', 'abcabcabcabc']
  base = options_lib.Options(method='ar', max_new_tokens=16, chat=False, batch_size=1)
  ar, _ = generate_lib.generate(target, drafters, prompts, base)
  calls.clear()
  out, stats = generate_lib.generate(target, drafters, prompts,
                                     dataclasses.replace(base, method='auto'))
  # AR's timing and the prior's pick's (1 token: no step, so no move; each run twice, the first
  # warms up), then a batch at a time: no probe
  assert [n for n, _ in calls] == [1] * 7 and stats['auto_source'] == 'prior'
  assert stats['auto_timed'] == ['ar', 'pld(gamma=4)']
  assert json.loads(open(stats['auto_file']).read())['measured']['ar']['decode_steps'] == 0
  assert stats['auto_choice'] == 'pld(gamma=4)'  # the prior's choice decodes the first batch
  assert 'pld(gamma=4)' in stats['auto_reason'] and 'priors.json' in stats['auto_reason']
  assert [r['completion_ids'] for r in out] == [r['completion_ids'] for r in ar]
  # pld measured far below its prior: the second prompt went to dflash, measured in its turn
  parts = stats['auto_parts']
  assert [p['choice'] for p in parts[:2]] == ['pld(gamma=4)', 'dflash'], parts
  assert sum(p['prompts'] for p in parts) == 3 and stats['auto_learned']
  record = json.loads(open(stats['auto_file']).read())
  assert record['source'] == 'prior+measured'
  table, measured = record['auto_candidates'], record['measured']
  assert set(measured) == {p['choice'] for p in parts} | {'ar'}
  assert table['pld(gamma=4)']['tau'] <= 4
  measured.pop('ar')  # (no step timed)
  # prompt lookup's τ: what it would have taken on every batch's outputs (its own and dflash's)
  seen = record['lookup_seen']
  assert seen['tokens'] == sum(len(r['completion_ids']) - 1 for r in out)
  assert seen['cycles'] == sum(replay.lookup_cycles(
      target.tokenizer.encode_prompt(p, False, {}), r['completion_ids'], 4, 3)
                               for p, r in zip(prompts, out))
  assert table['pld(gamma=4)']['tau'] == pytest.approx(seen['tokens'] / seen['cycles'], abs=1e-3)
  for label, m in measured.items():
    if label != 'pld(gamma=4)':
      assert table[label]['tau'] == pytest.approx(m['decode_tokens'] / m['cycles'], abs=1e-3)
    # (its program's cost, at how slow the machine ran last: test_learn_... below)
    assert table[label]['cycle_ms'] == pytest.approx(
        1e3 * record['machine'] * m['unit_s'] / m['decode_steps'], rel=1e-3)
  assert sum(m['decode_tokens'] for m in measured.values()) == sum(
      len(r['completion_ids']) - 1 for r in out)
  assert stats['tau'] == pytest.approx(sum(m['decode_tokens'] for m in measured.values()) /
                                       sum(m['cycles'] for m in measured.values()), abs=1e-3)
  assert record['auto_choice'] == max(table, key=lambda k: table[k]['predicted_tokens_per_s'])
  assert stats['method'] == table[parts[-1]['choice']]['method']
  # the next request starts from the remembered choice and goes on measuring
  calls.clear()
  again, stats2 = generate_lib.generate(target, drafters, prompts,
                                        dataclasses.replace(base, method='auto'))
  # (AR's 1-token timing timed no step: the remembered record times it, and the pick, again)
  assert [n for n, _ in calls] == [1] * (2 * len(stats2['auto_timed']) + 3)
  assert stats2['auto_source'] == 'remembered'
  assert stats2['auto_parts'][0]['choice'] == record['auto_choice']
  assert [r['completion_ids'] for r in again] == [r['completion_ids'] for r in ar]
  # auto_probe: every candidate decodes the prompts (the first warms up), then the request
  calls.clear()
  probed, stats3 = generate_lib.generate(target, drafters, prompts,
                                         dataclasses.replace(base, method='auto',
                                                             auto_probe=True))
  assert stats3['auto_source'] == 'probed' and [n for n, _ in calls] == [1, 2] * 3 + [3]
  assert 'auto_parts' not in stats3
  assert [r['completion_ids'] for r in probed] == [r['completion_ids'] for r in ar]


@pytest.mark.parametrize('timed_first', [3, 2])
def test_auto_times_ar_and_the_priors_pick_before_its_first_choice(
    tiny_folder, auto_choices, monkeypatch, tmp_path, timed_first):
  """Before the first batch, auto times AR_TIMING_TOKENS tokens of AR on it (this machine's AR
  step), then of the prior's pick, and of the next pick while the one timed falls below it, up
  to TIMED_FIRST programs (outputs dropped); the first batch decodes with the best prediction
  after them. Here every speculative program runs slowly: dflash (the prior's pick), then pld
  (the next) are timed and AR decodes; with TIMED_FIRST 2, pld decodes untimed. A remembered
  record does not time again. Outputs equal AR's."""
  target, drafters, calls = _auto_with_prior(
      tiny_folder, monkeypatch, tmp_path,
      {'ar': (1.0, 1.0), 'pld(gamma=4)': (1.4, 1.0), 'dflash': (1.5, 1.0)})
  monkeypatch.setattr(auto_policy, 'AR_TIMING_TOKENS', 12)
  monkeypatch.setattr(auto_policy, 'TIMED_FIRST', timed_first)
  # (prompt lookup predicted by its prior here, not by what the outputs say it would take:
  # test_learn_predicts_prompt_lookup_from_every_batchs_outputs)
  monkeypatch.setattr(auto_record.Record, '_see_lookup', lambda record, measured: None)
  prompts = ['abcabcabcabc', 'hello hello hello']
  base = options_lib.Options(method='ar', max_new_tokens=16, chat=False, batch_size=1)
  ar, _ = generate_lib.generate(target, drafters, prompts, base)
  calls.clear()
  # a program's first run pays a one-off cost: here 10 s for the first timing program's, which
  # the timing must not count; and every speculative run takes 5 s more
  counted, decode = [], runner_lib.decode_prompts
  def slow(runner, *a, **k):
    ids, st = decode(runner, *a, **k)
    counted.append(runner)
    return ids, dict(st, decode_s=st['decode_s'] + 10.0 * (len(counted) == 1) +
                     5.0 * (type(runner).__name__ == 'SpecRunner'))
  monkeypatch.setattr(runner_lib, 'decode_prompts', slow)
  # (one prompt: what AR measures of its own when it decodes a batch would add to the timing)
  out, stats = generate_lib.generate(target, drafters, prompts[:1],
                                     dataclasses.replace(base, method='auto'))
  assert stats['auto_choice'] == 'dflash'  # the prior's pick
  timed = ['ar', 'dflash', 'pld(gamma=4)'][:timed_first]
  assert stats['auto_timed'] == timed
  # each timing program runs twice (the first warms it up), then the batch
  assert calls == [(1, 'ARRunner')] * 2 + [(1, 'SpecRunner')] * 2 * (timed_first - 1) + [
      (1, 'ARRunner' if timed_first == 3 else 'SpecRunner')]
  assert counted[0] is counted[1] and counted[2] is counted[3]
  assert stats['auto_timing_s'] > 0
  record = json.loads(open(stats['auto_file']).read())
  measured = record['measured']
  first = 'ar' if timed_first == 3 else 'pld(gamma=4)'  # what decoded the batch
  # AR's timing (12 tokens, the prefill's aside), then the batch's 15 steps, if AR decoded it
  steps = 15 + auto_record.RECENCY * 11 if first == 'ar' else 11
  assert measured['ar']['decode_steps'] == measured['ar']['cycles'] == steps
  assert measured['ar']['decode_s'] < 10  # (the timing's second run)
  assert set(measured) == set(timed) | {first}
  assert measured['dflash']['decode_s'] >= 5  # (timed slow: no longer the pick)
  assert stats['auto_parts'] == [{'choice': first, 'prompts': 1}]
  assert [r['completion_ids'] for r in out] == [r['completion_ids'] for r in ar[:1]]
  calls.clear()
  again, stats2 = generate_lib.generate(target, drafters, prompts,
                                        dataclasses.replace(base, method='auto'))
  assert len(calls) == 2 and 'auto_timed' not in stats2  # no timing: a batch at a time
  assert [r['completion_ids'] for r in again] == [r['completion_ids'] for r in ar]


def test_a_switch_decodes_with_the_new_candidates_knobs_and_not_the_last_ones(
    tiny_folder, monkeypatch, tmp_path):
  """When auto moves to another candidate between batches, the next batch's program takes that
  candidate's knobs over the request's, none of the previous candidate's: after d2sd with one
  branch, prompt lookup's program has the default n_branches, as the program it was weighed by.
  Outputs equal AR's."""
  # the prior's pick is d2sd(K=1); untrained drafters accept little, and pld keeps its prior
  # (not predicted from the outputs here), so the second prompt moves to pld
  target, drafters, _ = _auto_with_prior(
      tiny_folder, monkeypatch, tmp_path,
      {'ar': (1.0, 1.0), 'pld(gamma=4)': (3.0, 1.0), 'd2sd(K=1)': (3.5, 1.0)}, drafter2=True)
  monkeypatch.setattr(auto_record.Record, '_see_lookup', lambda record, measured: None)
  monkeypatch.setattr(auto_record, 'MIN_PROBE_CYCLES', 1)
  monkeypatch.setattr(auto_policy, 'AR_TIMING_TOKENS', 1)
  prompts = ['abcabcabcabc', 'hello hello hello']
  base = options_lib.Options(method='ar', max_new_tokens=16, chat=False, batch_size=1)
  ar, _ = generate_lib.generate(target, drafters, prompts, base)
  runners = {}
  out, stats = generate_lib.generate(target, drafters, prompts,
                                     dataclasses.replace(base, method='auto', spec={'steps': 1}),
                                     runners=runners)
  assert [p['choice'] for p in stats['auto_parts']] == ['d2sd(K=1)', 'pld(gamma=4)']
  specs = {key[0]: dict(key[-1]) for key in runners}
  assert specs['d2sd'] == {'gamma': 4, 'n_branches': 1, 'steps': 1}
  assert specs['pld'] == {'gamma': 4, 'n_branches': 3, 'steps': 1}  # (min(4, gamma - 1))
  assert [r['completion_ids'] for r in out] == [r['completion_ids'] for r in ar]


def test_a_requests_tree_budget_caps_autos_candidates(tiny_folder, tmp_path):
  """With method=auto, spec.tree_budget is the most nodes a candidate may verify: the prior
  still applies, candidates over the cap are not weighed, and the chosen one keeps its own
  budget."""
  target = loaders.load_target(tiny_folder)
  dcfg = dataclasses.replace(TDCFG, gamma=4)
  drafters = {n: (dcfg, D.init_params(dcfg, target.cfg, jax.random.PRNGKey(i)))
              for i, n in enumerate(('drafter1', 'drafter2'))}
  labels = [label for label, _, _ in autoconfig.candidates(drafters)]
  taus = {label: (1.0 if label == 'ar' else 3.9 if label == 'd2sd_tree(N=64)' else 1.5, 1.2)
          for label in labels}
  path = write_prior(tmp_path / 'p.json', target, drafters, taus)
  nodes = {label: autoconfig.nodes(m, k) for label, m, k in autoconfig.candidates(drafters)}
  assert nodes['ar'] == 1 and nodes['dflash'] == 4 and nodes['d2sd(K=2)'] == 4 + 2 * 3
  assert nodes['ddtree(N=12)'] == 12 and nodes['d2sd_tree(N=64)'] == 64
  free = autoconfig.from_prior(target, drafters, options_lib.Options(method='auto'), 1, path)
  assert free.auto_choice == 'd2sd_tree(N=64)'
  capped = options_lib.Options(method='auto', spec={'tree_budget': 12})
  rec = autoconfig.from_prior(target, drafters, capped, 1, path)
  assert set(rec.auto_candidates) == {k for k, n in nodes.items() if n <= 12}
  assert 'd2sd(K=4)' not in rec.auto_candidates and 'ddtree(N=12)' in rec.auto_candidates
  chosen = autoconfig.chosen_options(capped, rec.auto_candidates['dflash'])
  assert chosen.method == 'dflash' and 'tree_budget' not in chosen.spec
  chosen = autoconfig.chosen_options(capped, rec.auto_candidates['ddtree(N=8)'])
  assert chosen.spec['tree_budget'] == 8


def test_a_prior_applies_only_to_its_drafters_platform_and_settings_nearest_batch_first(
    tiny_folder, tmp_path):
  target = loaders.load_target(tiny_folder)
  dcfg = dataclasses.replace(TDCFG, gamma=4)
  d1 = (dcfg, D.init_params(dcfg, target.cfg, jax.random.PRNGKey(1)))
  labels = [label for label, _, _ in autoconfig.candidates({'drafter1': d1})]
  path = write_prior(tmp_path / 'p.json', target, {'drafter1': d1},
                     {label: (1.5, 1.2) for label in labels})
  options = options_lib.Options(method='auto')
  assert autoconfig.from_prior(target, {'drafter1': d1}, options, 1, path) is not None
  other = (dcfg, D.init_params(dcfg, target.cfg, jax.random.PRNGKey(7)))
  assert autoconfig.from_prior(target, {'drafter1': other}, options, 1, path) is None
  # another batch: the nearest recorded one's, said so (its first tokens are timed at its own)
  at_4 = write_prior(tmp_path / 'p4.json', target, {'drafter1': d1},
                     {label: (1.5, 1.2) for label in labels}, batch=4)
  both = tmp_path / 'both.json'
  both.write_text(json.dumps({'version': autoconfig.RECORD_PRIORS, 'records': [
      json.loads(open(p).read())['records'][0] for p in (path, at_4)]}))
  for batch, nearest in ((1, 1), (2, 1), (3, 4), (4, 4), (32, 4)):
    rec = autoconfig.from_prior(target, {'drafter1': d1}, options, batch, str(both))
    assert (rec.prior_batch, rec.batch) == (nearest, batch)
    line = autoconfig.explain(rec, 'prior')
    assert (f'measured at batch {nearest}' in line) == (nearest != batch), line
  assert autoconfig.from_prior(target, {'drafter1': d1}, options, 8, path).prior_batch == 1
  # sampling starts from the (greedy) prior too: its batches correct it
  assert autoconfig.from_prior(target, {'drafter1': d1}, dataclasses.replace(
      options, temperature=0.7, top_p=0.9), 1, path) is not None
  for changed in ({'spec': {'leniency': 0.1}}, {'spec': {'steps': 2}}):
    assert autoconfig.from_prior(target, {'drafter1': d1},
                                 dataclasses.replace(options, **changed), 1, path) is None
  # the knobs a config file fixes at their defaults change nothing
  assert autoconfig.from_prior(target, {'drafter1': d1}, dataclasses.replace(
      options, spec={'gamma': 8, 'tree_budget': 0, 'leniency': 0.0}), 1, path) is not None
  (tmp_path / 'p.json').write_text('{"version": 1, "rec')  # truncated: ignored
  assert autoconfig.from_prior(target, {'drafter1': d1}, options, 1, path) is None
