"""method='auto' over one request: which candidate decodes each batch (`Policy`).

generate() asks the policy what to decode with and tells it what each batch measured; the
policy owns the remembered record (`auto_record.Record`) and saves it. Its loop:

1. `Policy.start`: autoconfig.choose picks a record (remembered, from the drafters' prior, or
   probed) and says in one line what it chose and why.
2. `time_first`, once per record chosen from a prior: the prior counts cycles in AR steps, so
   AR decodes the first batch's first AR_TIMING_TOKENS tokens (this machine's AR step), then
   the prior's pick does, and the next pick if that one measured below it, up to TIMED_FIRST
   programs (outputs dropped). A prompt set the drafters accept little on is found out in a
   few tokens, not in a whole batch decoded with the wrong candidate.
3. `observe`, after every batch: the record learns what the batch measured
   (`Record.learn`), and when another candidate now predicts more tokens/s the next batch
   decodes with it, with a line saying so, when it predicts SWITCH_MARGIN times more tokens/s
   than the one decoding (one prompt's difficulty is noise, not a ranking). The record keeps
   the choice so moved, so the next request starts from it: a request of one prompt does not
   undo the margin. Exploration is
   bounded: only the timed candidates, then whichever the measurements rank first by that
   margin, decode.

A probed record (measured on the request's own prompts) decodes every prompt in one call.
"""
from __future__ import annotations

import copy
import time
import typing

from d2sd_jax.decode import auto_record
from d2sd_jax.decode import autoconfig

# Tokens of the first batch that AR, then the prior's pick, decode (timed, outputs dropped)
# before a choice from a prior decodes (once per remembered record): the prior's cycles are in
# AR steps, and this machine's AR step at this context is what turns them into time; the pick's
# τ on these prompts tells whether the prior holds for them
AR_TIMING_TOKENS = 32
TIMED_FIRST = 3  # at most: AR, the prior's pick and the pick after it, if that one fell below
# A batch moves the next one to another candidate only if that one now predicts this much more
# than the one decoding: at batch 1 a batch is one prompt, whose difficulty moves the measured
# τ by tens of percent, and a candidate measured on other prompts than its rival is not beaten
# by noise (a switch also starts another program)
SWITCH_MARGIN = 1.1


class Policy:
  """One request's auto. `options`: the Options the next batch decodes with; `learns`: whether
  batches refine the choice (else every prompt decodes in one call)."""

  def __init__(self, request, record: auto_record.Record, path: str, stats: dict, log=print):
    self.request, self.record, self.path, self.log = request, record, path, log
    self._stats, self.label, self.parts = stats, record.auto_choice, []

  @classmethod
  def start(cls, target, drafters: dict, prompt_ids: list[list[int]], options, batch: int, tok,
            log=print, note: str = '') -> Policy:
    record, path, stats = autoconfig.choose(target, drafters, prompt_ids, options, batch, tok,
                                            log=log, note=note)
    return cls(options, record, path, stats, log)

  @property
  def options(self):
    return self.options_of(self.label)

  @property
  def learns(self) -> bool:
    return self.record.learns

  def options_of(self, label: str):
    return autoconfig.chosen_options(self.request, self.record.auto_candidates[label])

  def time_first(self, time_candidate: typing.Callable[[object, str], tuple[dict, float]],
                 batch: int) -> float:
    """Step 2 of the module docstring, when the record has no timed AR step yet.
    time_candidate(options, label) decodes AR_TIMING_TOKENS tokens of one batch with them and
    returns (what Record.learn takes, the seconds it spent compiling). Returns those seconds."""
    if not (self.learns and self.record.ar_untimed):
      return 0.0
    started, compile_s, timed = time.perf_counter(), 0.0, ['ar']
    while True:
      measured, spent = time_candidate(self.options_of(timed[-1]), timed[-1])
      compile_s += spent
      self.record.learn(measured, batch, label=timed[-1], opening=True)
      pick = self.record.auto_choice
      if pick in timed or len(timed) == TIMED_FIRST:
        break
      timed.append(pick)
    self.record.save(self.path)
    self._stats.update(auto_timed=timed, auto_timing_s=round(
        time.perf_counter() - started - compile_s, 3))
    self.label = pick
    return compile_s

  def observe(self, measured: dict, prompts: int, batch: int, more: bool) -> None:
    """Step 3: a batch of `prompts` prompts measured `measured` (Record.learn's argument);
    `more`: whether batches remain."""
    if not self.learns:
      return
    if self.parts and self.parts[-1]['choice'] == self.label:
      self.parts[-1]['prompts'] += prompts
    else:
      self.parts.append({'choice': self.label, 'prompts': prompts})
    # (the batch teaches the one that decoded it; the record's choice moves only by the margin)
    self.record.learn(measured, batch, label=self.label, margin=SWITCH_MARGIN)
    self.record.save(self.path)
    best, table = self.record.auto_choice, self.record.auto_candidates
    if best == self.label or not more:
      return
    # (a record not timed yet predicts in tokens per AR step only: its choice is followed)
    now, then = (table[k].get('predicted_tokens_per_s') for k in (self.label, best))
    said = lambda rate: 'an untimed rate' if rate is None else f'{rate:.2f} tokens/s'
    decoded = sum(p['prompts'] for p in self.parts)
    self.log(f'auto: after {decoded} prompts, {self.label} now predicts {said(now)} and {best} '
             f'{said(then)}: switching')
    self.label = best

  def stats(self) -> dict:
    """auto's part of the request's stats: the first choice and its figures (as chosen), the
    candidates timed first, and which candidate decoded how many prompts in turn."""
    out = copy.deepcopy(self._stats)
    if self.parts:
      # what each batch measured refined the remembered choice (the next request starts
      # there): which candidate decoded how many prompts, in order
      out.update(auto_learned=True, auto_parts=self.parts)
    return out
