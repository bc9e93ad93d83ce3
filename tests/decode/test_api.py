"""d2sd_jax.load / Decoder: generation equals decode.py's, save -> load round trip, bad input."""
import dataclasses
import os
import shutil

import jax
import numpy as np
import pytest

import d2sd_jax
from d2sd_jax.decode import api



@pytest.mark.slow
def test_decoder_generates_losslessly_and_round_trips(tiny_folder, tiny_drafters, tmp_path):
  dec = d2sd_jax.load(tiny_folder, **tiny_drafters)
  assert dec.method == 'd2sd'
  prompts = ['abcabcab', 'hello hello', 'xyz']
  ar = dec.generate(prompts, 12, chat=False, method='ar')
  for method in ('pld', 'dflash', 'd2sd'):
    out = dec.generate(prompts, 12, chat=False, method=method)
    assert out.ids == ar.ids, method
    assert out.stats['cycles'] > 0 and out.stats['tau'] >= 1
    assert 'expected_tau' not in out.stats  # only best-first trees score their nodes
  tree = dec.generate(prompts, 12, chat=False, method='d2sd_tree', tree_budget=8)
  assert tree.ids == ar.ids
  # what the trees' scores expected: more than the anchor, at most one per draft node
  assert 1 < tree.stats['expected_tau'] <= 1 + (8 - 1)
  saved = dec.save(str(tmp_path / 'decoder'))
  again = d2sd_jax.load(saved)
  assert again.method == 'd2sd' and sorted(again.drafters) == ['drafter1', 'drafter2']
  for x, y in zip(jax.tree.leaves(dec.target.params), jax.tree.leaves(again.target.params)):
    np.testing.assert_array_equal(x, y)
  for name in ('drafter1', 'drafter2'):
    assert again.drafters[name][0] == dec.drafters[name][0]  # config incl. fitted temperature
    for x, y in zip(jax.tree.leaves(dec.drafters[name][1]),
                    jax.tree.leaves(again.drafters[name][1])):
      np.testing.assert_array_equal(x, y)
  assert again.target.tokenizer.encode('hello') == dec.target.tokenizer.encode('hello')
  assert again.generate(prompts, 12, chat=False).ids == ar.ids
  assert again.generate(prompts, 12, chat=True).ids == dec.generate(prompts, 12, chat=True).ids


@pytest.mark.slow
def test_adaptive_tree_measures_its_costs_with_the_lookup_cycle(tiny_folder, tiny_drafters,
                                                                cost_cache):
  """generate(adaptive=True) on d2sd_tree measures the shapes' cycle costs and the lookup-only
  cycle's (one cost-cache file, a pld draft in it), decodes AR's tokens, and reports the share
  of lookup-only cycles; with lookup_cycles=False it measures no lookup and reports none."""
  import json  # pylint: disable=import-outside-toplevel
  dec = d2sd_jax.load(tiny_folder, **tiny_drafters)
  prompts = ['abcabcabcabc', 'hello hello hello', 'xyz']
  ar = dec.generate(prompts, 16, chat=False, method='ar')
  out = dec.generate(prompts, 16, chat=False, method='d2sd_tree', tree_budget=8, adaptive=True)
  assert out.ids == ar.ids
  # both kinds of cycle: each row's first is drafted; the untrained drafters' trees accept
  # little, so lookup-only cycles win most of the others
  assert 0.0 < out.stats['lookup_only_share'] < 1.0
  files = sorted(cost_cache.glob('*.json'))
  assert len(files) == 1
  drafts = json.loads(files[0].read_text())['draft']
  assert any(k.startswith('pld:') for k in drafts) and any(k.startswith('d2sd_tree:')
                                                           for k in drafts), drafts
  off = dec.generate(prompts, 16, chat=False, method='d2sd_tree', tree_budget=8, adaptive=True,
                     lookup_cycles=False)
  assert off.ids == ar.ids and 'lookup_only_share' not in off.stats
  assert len(list(cost_cache.glob('*.json'))) == 2  # the shapes alone: another measurement


def test_decoder_bad_input(tiny_folder, tiny_drafters, tmp_path):
  dec = d2sd_jax.load(tiny_folder, drafter1=tiny_drafters['drafter1'])
  assert dec.method == 'dflash'
  with pytest.raises(ValueError, match=r"method='d2sd' needs drafter2 .*drafter2=PATH"):
    dec.generate('abc', 4, method='d2sd')
  with pytest.raises(ValueError, match=r"method='medusa' is not one of \('ar', 'auto', 'pld'"):
    dec.generate('abc', 4, method='medusa')
  with pytest.raises(ValueError, match=r'gama \(did you mean gamma\?\)'):
    dec.generate('abc', 4, gama=4)
  with pytest.raises(ValueError, match='steps=0 must be >= 1'):  # SpecSettings' own check
    dec.generate('abc', 4, steps=0)
  with pytest.raises(ValueError, match='empty prompt'):
    dec.generate([''], 4)
  with pytest.raises(ValueError, match='no prompts'):
    dec.generate([], 4)
  with pytest.raises(ValueError, match='exceeds the cache'):
    dec.generate('abc' * 20, 8, cache_len=32, chat=False)
  saved = dec.save(str(tmp_path / 'decoder'))
  damaged = str(tmp_path / 'damaged')
  shutil.copytree(saved, damaged)
  for root, _, files in os.walk(os.path.join(damaged, 'target')):
    for name in files:
      if not name.endswith('.json'):
        path = os.path.join(root, name)
        with open(path, 'r+b') as f:
          f.truncate(os.path.getsize(path) // 3)
  with pytest.raises(ValueError, match='corrupt or incomplete|does not match'):
    d2sd_jax.load(damaged)
  os.remove(os.path.join(saved, 'target', api.TARGET_FILE))
  with pytest.raises(ValueError, match='missing or unreadable'):
    d2sd_jax.load(saved)


def test_prompt_width_runs_prompts_of_other_lengths_in_one_program(tiny_folder, tiny_drafters):
  """A 10- and a 100-character prompt (one token a character) are padded to 64 and 128 tokens:
  two programs. With prompt_width=100 both run the 128-wide one, and the outputs do not move."""
  dec = d2sd_jax.load(tiny_folder, drafter1=tiny_drafters['drafter1'])
  short, long = 'abcabcabca', ('hello world ' * 9)[:100]
  for method in ('ar', 'dflash'):
    dec._runners.clear()  # pylint: disable=protected-access
    alone = [dec.generate(p, 12, chat=False, method=method).ids for p in (short, long)]
    assert len(dec._runners) == 2, method  # pylint: disable=protected-access
    dec._runners.clear()  # pylint: disable=protected-access
    padded = [dec.generate(p, 12, chat=False, method=method, prompt_width=100).ids
              for p in (short, long)]
    assert len(dec._runners) == 1, method  # pylint: disable=protected-access
    assert padded == alone, method
  with pytest.raises(ValueError, match=r'prompt_width=500 \+ max_new_tokens=12 exceeds the '
                     r'cache length 100 .*lower prompt_width .*raise cache_len'):
    dec.generate(short, 12, chat=False, prompt_width=500, cache_len=100)
  with pytest.raises(ValueError, match='prompt_width=-1 must be >= 0'):
    dec.generate(short, 12, prompt_width=-1)


@pytest.fixture
def compiles():
  """A list that grows by one for every XLA compilation during the test (jax.monitoring)."""
  seen = []

  def listen(event, _secs, **_):
    if event == '/jax/core/compile/backend_compile_duration':
      seen.append(event)
  jax.monitoring.register_event_duration_secs_listener(listen)
  yield seen
  jax.monitoring.unregister_event_duration_listener(listen)


def test_another_max_new_tokens_compiles_nothing(tiny_folder, tiny_drafters, compiles):
  """max_new_tokens is an argument of the compiled programs, under a static bound: after one
  call, calls for fewer or more tokens (up to the bound) compile nothing (no prefill, loop,
  step or state set-up), and each stops exactly where a call of its own length does: greedy,
  the first tokens of the longer call's."""
  dec = d2sd_jax.load(tiny_folder, **tiny_drafters)
  prompts = ['abcabcab', 'hello hello']
  for method in ('ar', 'd2sd'):
    longest = dec.generate(prompts, 24, chat=False, method=method).ids
    assert all(len(row) == 24 for row in longest), method  # (no EOS: each length is exact)
    before = len(compiles)
    for n in (9, 1, 30):
      out = dec.generate(prompts, n, chat=False, method=method)
      assert out.stats['compile_s'] == 0, (method, n)
      if n <= 24:
        assert out.ids == [row[:n] for row in longest], (method, n)
      else:
        assert [row[:24] for row in out.ids] == longest and len(out.ids[0]) == n, method
    assert len(compiles) == before, (method, compiles[before:])


def _scaled(target, factor):
  """The target with every weight multiplied by `factor`: another model of the same shapes."""
  return dataclasses.replace(target, params=jax.tree.map(lambda x: x * factor, target.params))


def test_saving_again_replaces_the_save_atomically(tiny_folder, tmp_path, monkeypatch):
  """A second save into the same folder replaces the first (a notebook rerun); a save that dies
  before its swap, or between the swap's two renames, leaves a loadable save."""
  target = d2sd_jax.load(tiny_folder).target
  path = str(tmp_path / 'decoder')
  api.Decoder(target).save(path)
  api.Decoder(_scaled(target, 2.0)).save(path)
  assert os.listdir(tmp_path) == ['decoder']  # no temporary or backup folder left
  embed = np.asarray(target.params['embed'])
  np.testing.assert_array_equal(d2sd_jax.load(path).target.params['embed'], 2.0 * embed)

  def dies(*args):  # the process is killed while the new save is being written
    real_save_target(*args)
    raise RuntimeError('killed mid-save')

  real_save_target = api.save_target
  monkeypatch.setattr(api, 'save_target', dies)
  with pytest.raises(RuntimeError, match='killed mid-save'):
    api.Decoder(_scaled(target, 3.0)).save(path)
  monkeypatch.undo()
  np.testing.assert_array_equal(d2sd_jax.load(path).target.params['embed'], 2.0 * embed)
  fresh, old = api.save_siblings(path)
  assert os.path.isdir(fresh)  # the half-written save, never loaded
  # Killed between the swap's renames: the earlier save waits beside the folder; load reads it,
  # and the next save completes the replacement.
  os.rename(path, old)
  np.testing.assert_array_equal(d2sd_jax.load(path).target.params['embed'], 2.0 * embed)
  api.Decoder(_scaled(target, 4.0)).save(path)
  assert os.listdir(tmp_path) == ['decoder']
  np.testing.assert_array_equal(d2sd_jax.load(path).target.params['embed'], 4.0 * embed)
  (tmp_path / 'notes').mkdir()
  (tmp_path / 'notes' / 'todo.txt').write_text('mine')
  with pytest.raises(ValueError, match='not a saved decoder'):  # never moves other files away
    api.Decoder(target).save(str(tmp_path / 'notes'))


def test_drop_programs_compiles_again_and_decodes_the_same(tiny_folder, tiny_drafters):
  """A second call with the same shapes reuses the compiled programs (no compile time); after
  drop_programs the next call compiles them again, and decodes the same tokens."""
  dec = d2sd_jax.load(tiny_folder, **tiny_drafters)
  first = dec.generate(['abcabc', 'xyz'], 8, chat=False, method='d2sd_tree', tree_budget=8)
  reused = dec.generate(['abcabc', 'xyz'], 8, chat=False, method='d2sd_tree', tree_budget=8)
  assert first.stats['compile_s'] > 0 and reused.stats['compile_s'] == 0
  dec.drop_programs()
  again = dec.generate(['abcabc', 'xyz'], 8, chat=False, method='d2sd_tree', tree_budget=8)
  assert again.stats['compile_s'] > 0 and again.ids == first.ids
