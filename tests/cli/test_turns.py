"""benchmarks/turns.py: decoding in turns (prompt-major, every run on a prompt before the next
prompt), its untimed warm-up, and the rows that merge each run's one-prompt calls."""
import os
import sys

import pytest

from tests.conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))
import turns  # pylint: disable=wrong-import-position


class _Tokenizer:
  def encode_prompt(self, prompt, chat, kwargs):
    return list(prompt) + (['<chat>'] if chat else [])


class _Decoder:
  """Stands in for d2sd_jax.Decoder: records each call; AR decodes 2 tokens/s, pld 4 (3 cycles
  per prompt of 6 new tokens; auto's vary); `wrong` changes pld's output on one prompt."""

  def __init__(self, wrong=None):
    self.target = type('T', (), {'tokenizer': _Tokenizer()})()
    self.calls, self.wrong = [], wrong

  def generate(self, prompts, tokens, *, method, prompt_width, **kw):
    self.calls.append((prompts[0], method, prompt_width, kw.get('seed'),
                       os.environ.get('D2SD_AUTO_CACHE')))
    ids = [[len(prompts[0])] * 7]  # (never the wrong output, [0] * 7)
    if method == 'pld' and prompts[0] == self.wrong:
      ids = [[0] * 7]
    stats = {'prompts': 1, 'new_tokens': 7, 'decode_s': 3.0 if method == 'ar' else 1.5}
    if method != 'ar':
      stats.update(cycles=3, tree_size=8)
    if method == 'auto':  # cycles 2, 3, 4 on prompts 'a', 'bb', 'ccc'
      stats.update(cycles=len(prompts[0]) + 1, auto_choice='pld(gamma=8)', expected_tau=1.5 if prompts[0] == 'a' else 3.0,
                   auto_parts=[{'choice': 'ar' if prompts[0] == 'ccc' else 'pld(gamma=8)',
                                'prompts': 1}])
    stats['decode_tokens_per_s'] = 6 / stats['decode_s']
    return type('G', (), {'ids': ids, 'stats': stats})()

  def drop_programs(self):
    self.calls.append(('dropped',))


def test_rows_decode_every_run_on_one_prompt_before_the_next(monkeypatch):
  """Prompt-major turns, every call padded to the section's longest prompt (chat marker
  included, the sets' programs shared: none dropped between them),
  a fresh auto cache per set (not per call), seed + i when sampling; the rows merge the calls:
  tau over all cycles, the trees' expected tau weighted by their cycles, auto's parts joined;
  a changed output stops the run."""
  monkeypatch.setenv('D2SD_AUTO_CACHE', 'unset')
  dec = _Decoder()
  runs = (('ar', 'ar', {}), ('pld', 'pld', {}), ('auto', 'auto', {}))
  out = turns.lossless_rows(dec, 'trees', {'s1': (['a', 'bb', 'ccc'], True),
                                               's2': (['ddddd'], False)}, runs, 6)
  assert ('dropped',) not in dec.calls
  order = [(prompt, method) for prompt, method, *_ in dec.calls]
  assert order == [(p, m) for p in ('a', 'bb', 'ccc', 'ddddd') for m in ('ar', 'pld', 'auto', 'ar')]
  assert [width for _, _, width, _, _ in dec.calls] == [5] * 16  # ('ddddd'; 'ccc' + marker: 4)
  caches = [cache for *_, cache in dec.calls]
  assert len(set(caches[:12])) == 1 and len(set(caches[12:])) == 1 and caches[0] != caches[12]
  assert 'unset' not in caches
  rows = {r['method']: r for r in out['s1']}
  assert list(rows) == ['ar', 'pld', 'auto', 'ar (end)']
  assert rows['pld']['tau'] == 2.0 and rows['ar']['tau'] == 1.0  # 18 tokens in 9 cycles
  assert rows['pld']['decode_tokens_per_s'] == 4.0 and rows['pld']['speedup_vs_ar'] == 2.0
  assert rows['auto']['expected_tau'] == pytest.approx(1 + (0.5 * 2 + 2 * 3 + 2 * 4) / 9,
                                                      abs=1e-3)
  assert rows['auto']['auto_parts'] == [{'choice': 'pld(gamma=8)', 'prompts': 2},
                                        {'choice': 'ar', 'prompts': 1}]
  dec = _Decoder()
  turns.lossless_rows(dec, 'sampled', {'s': (['a', 'bb'], True)}, runs[:2], 6,
                          sampling={'temperature': 0.7, 'top_p': 0.95, 'seed': 5})
  assert [call[3] for call in dec.calls if call != ('dropped',)] == [5, 5, 5, 6, 6, 6]
  with pytest.raises(SystemExit, match='pld on s, prompt 1, changed the output'):
    turns.lossless_rows(_Decoder(wrong='bb'), 'trees', {'s': (['a', 'bb'], True)},
                            runs[:2], 6)


def test_warm_up_decodes_each_run_once_untimed_and_rows_weigh_by_cycles(monkeypatch):
  """warm=True: every distinct run but auto decodes the first prompt once before the timed
  turns (not counted in its row); a row's mean tree size and lookup-only share are weighted by
  each call's cycles, and its acceptance histograms add."""
  monkeypatch.setenv('D2SD_AUTO_CACHE', 'unset')

  class Sized(_Decoder):
    def generate(self, prompts, tokens, *, method, prompt_width, **kw):
      g = super().generate(prompts, tokens, method=method, prompt_width=prompt_width, **kw)
      if method == 'pld':  # 'a': 2 cycles of 4 nodes, 'bbbb': 5 cycles of 10
        n = len(prompts[0])
        g.stats.update(cycles=n + 1, mean_tree_size=2.5 * n + (n == 1) * 1.5,
                       lookup_only_share=0.5 if n == 1 else 0.0, accepted_histogram=[n, 1])
      return g

  dec = Sized()
  runs = (('ar', 'ar', {}), ('pld', 'pld', {'stage_times': True}), ('auto', 'auto', {}))
  out = turns.lossless_rows(dec, 'turns', {'s': (['a', 'bbbb'], False)}, runs, 6, warm=True)
  order = [(prompt, method) for prompt, method, *_ in dec.calls]
  assert order[:2] == [('a', 'ar'), ('a', 'pld')]  # (ar (end) is the same run as ar; no auto)
  assert order[2:] == [(p, m) for p in ('a', 'bbbb') for m in ('ar', 'pld', 'auto', 'ar')]
  rows = {r['method']: r for r in out['s']}
  assert rows['pld']['decode_tokens_per_s'] == 4.0  # (2 timed calls: 12 tokens in 3 s)
  assert rows['pld']['mean_tree_size'] == pytest.approx((2 * 4 + 5 * 10) / 7, abs=1e-3)
  assert rows['pld']['lookup_only_share'] == pytest.approx(2 * 0.5 / 7, abs=1e-3)
  assert rows['pld']['accepted_histogram'] == [5, 2]
  assert 'mean_tree_size' not in rows['ar']
