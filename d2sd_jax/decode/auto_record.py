"""What method='auto' remembers of a choice, and what every batch teaches it (`Record`).

A record is loaded and saved here only (`Record.load`, `Record.save`): one JSON file per key
under autoconfig.choice_dir(). It holds the table of candidates (label -> method, knobs and
the figures that rank them), which one decodes now, where the figures came from (`source`:
'probed' on the request's prompts, 'prior' from the drafters' recorded acceptance,
'prior+measured' once batches refined it) and, for a choice from a prior, what the batches
measured (`measured`, `machine`, `lookup_seen`). `Record.learn` is the update a batch makes.
"""
from __future__ import annotations

import dataclasses
import json
import types
import typing

from d2sd_jax import files
from d2sd_jax.perf import throughput
from d2sd_jax.spec_decode import drafting
from d2sd_jax.spec_decode import replay
from d2sd_jax.spec_decode import speculative as SP

VERSION = 4  # a record written under another version is chosen again
MIN_PROBE_CYCLES = 8  # fewer loop steps than this: too short to time
# learn: the weight of a candidate's earlier measurements when a batch adds a new one (0.5: the
# last two batches count for three quarters)
RECENCY = 0.5
# learn: a measured τ is shrunk toward the candidate's prior as if the prior had been measured
# over this many cycles. The first batch's timing (auto_policy.AR_TIMING_TOKENS tokens of one
# prompt) is a dozen cycles, whose τ moves by tens of percent with that prompt alone: without
# this, one hard opening ranks a tree below AR, and AR, which teaches the trees nothing, decodes
# the rest of the request. A whole batch of 96 tokens outweighs it two to one.
PRIOR_CYCLES = 16
SOURCES = ('probed', 'prior', 'prior+measured')


def _accepts(hint, value) -> bool:
  """Whether a JSON value fits a field's annotation (an int where a float goes)."""
  args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
  kinds = tuple(typing.get_origin(a) or a for a in args)
  return isinstance(value, kinds + ((int,) if float in kinds else ()))


def takes_lookup_cycles(row: dict) -> bool:
  """Whether a candidate (a record's auto_candidates entry) is an adaptive tree whose cycles may
  verify prompt lookup's proposal alone (SpecSettings.takes_lookup_cycles, from its knobs)."""
  spec = row['spec']
  return (row['method'] in drafting.REGISTRY and drafting.get(row['method']).lookup and
          bool(spec.get('adaptive', SP.SpecSettings.adaptive)) and
          bool(spec.get('lookup_cycles', SP.SpecSettings.lookup_cycles)))


class RecordError(ValueError):
  """A remembered record that cannot be used: unreadable, of another version, or malformed."""


@dataclasses.dataclass
class Record:
  """One remembered choice. auto_candidates: {label: {'method', 'spec', 'tau', ...,
  'predicted_tokens_per_s' (or 'predicted_tokens_per_ar_step' from a prior alone)}};
  measured: {label: the totals `learn` keeps (decode_tokens, cycles, decode_s, decode_steps,
  unit_s; opening: True while only the policy's timed openings measured it)}."""
  auto_choice: str
  auto_candidates: dict[str, dict]
  predicted_tokens_per_s: float | None = None  # (None: from a prior alone, in tokens per AR step)
  source: str = 'probed'
  version: int = VERSION
  cost_device: str = ''
  created: str = ''
  measured: dict[str, dict] = dataclasses.field(default_factory=dict)
  machine: float = 1.0  # how slow the machine runs now (1: as when first timed)
  not_in_prior: list[str] = dataclasses.field(default_factory=list)
  prior_file: str | None = None
  prior_run: dict | None = None
  prior_batch: int | None = None  # the batch the prior was measured at
  batch: int | None = None  # the batch this record decodes
  scale_from: str | None = None  # the drafter candidate measured last
  prompt_scale: float | None = None
  lookup_seen: dict | None = None  # {'tokens', 'cycles'} prompt lookup takes on the outputs
  probed_on: dict | None = None

  def __post_init__(self):
    if self.version != VERSION:
      raise RecordError(f'written by record version {self.version}, this is {VERSION}')
    if self.source not in SOURCES:
      raise RecordError(f'source {self.source!r} is none of {SOURCES}')
    if self.auto_choice not in self.auto_candidates:
      raise RecordError(f'its choice {self.auto_choice!r} is not among its candidates')
    for label, row in self.auto_candidates.items():
      if not isinstance(row, dict) or not isinstance(row.get('spec'), dict) or 'method' not in row:
        raise RecordError(f'candidate {label!r} has no method and knobs')

  @classmethod
  def load(cls, path: str) -> Record:
    """The record at `path`; RecordError naming what is wrong with it."""
    try:
      with open(path) as f:
        blob = json.load(f)
    except (OSError, ValueError) as e:
      raise RecordError(f'{type(e).__name__}: {e}') from e
    if not isinstance(blob, dict):
      raise RecordError('not a JSON object')
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(blob) - set(fields))
    missing = sorted(n for n, f in fields.items() if n not in blob and
                     f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    if unknown or missing:
      raise RecordError(f'unknown fields {unknown}, missing {missing}')
    hints = typing.get_type_hints(cls)
    for name, value in blob.items():
      if not _accepts(hints[name], value):
        raise RecordError(f'{name} is a {type(value).__name__}')
    return cls(**blob)

  def save(self, path: str) -> None:
    files.write_json(path, self.as_json())

  def as_json(self) -> dict:
    """The record as saved: the fields left at None are left out."""
    return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

  def chosen(self) -> dict:
    return self.auto_candidates[self.auto_choice]

  @property
  def learns(self) -> bool:
    """Whether batches refine it: a choice from the prior, not probed on a request's prompts."""
    return self.source in ('prior', 'prior+measured')

  @property
  def ar_untimed(self) -> bool:
    """Whether a choice from a prior has no timed AR step yet (the policy then times
    AR_TIMING_TOKENS tokens of AR, and of the prior's pick, before the first batch)."""
    return 'ar' in self.auto_candidates and self.measured.get('ar', {}).get(
        'decode_steps', 0) < MIN_PROBE_CYCLES

  def learn(self, measured: dict, batch: int, label: str | None = None,
            margin: float = 1.0, opening: bool = False) -> Record:
    """After a decode (or one batch of a request) chosen from a prior: what it measured of the
    chosen candidate, or of `label` (`measured`: decode_tokens, cycles, decode_s, decode_steps;
    with prompt_ids and completion_ids, what prompt lookup would take on them) is added to
    that candidate's totals, the earlier ones weighed by RECENCY (acceptance follows the
    prompts, which change), and the predictions are remade:

    - a candidate measured for at least MIN_PROBE_CYCLES loop steps (so weighed) is predicted
      by its own totals: τ = tokens / cycles, shrunk toward its prior's τ by PRIOR_CYCLES
      pseudo-cycles (a short measurement is one prompt's opening, not the request), and its
      cycle is its program's cost times how
      slow the machine runs now (`machine`). Every program has fixed shapes, so a candidate's
      cycle does not depend on the prompts: once it is timed, a later batch of it that runs
      slower or faster tells of the machine (a shared VM drifts by tens of percent within
      minutes), and every candidate's cycle moves with it. Without this, a candidate timed
      while the machine was fast would overtake the one decoding now when the machine slows;
    - the others' cycles are their recorded AR steps times this machine's AR step: for a
      drafter candidate, the one the measured drafter candidates' cycles imply (weighted by
      their loop steps; the prior's relative costs of the trees can be off on another machine,
      and the drafter candidates share them), for prompt lookup (which drafts nothing) AR's own
      timing, each falling back to whatever is measured;
    - the others' τ: a drafter's acceptance tells of the prompts, so every unmeasured candidate
      that drafts with the drafters has its extra tokens (τ - 1) scaled by the ratio the
      drafter candidate measured last shows (its measured τ - 1 over its prior's);
    - prompt lookup's τ, measured or not, is what it would have taken on every batch's outputs
      so far (`_see_lookup`: exact at T = 0, whichever candidate decoded them), as it depends
      on how much the request repeats itself, which no prior knows; shrunk toward its prior by
      PRIOR_CYCLES like every measured τ, since how much one prompt repeats itself varies
      widely (on 10 networkx prompts, the first one's outputs predicted prompt lookup at 116
      tokens/s, and it then decoded two at 56);
    - an adaptive tree that takes lookup-only cycles (`takes_lookup_cycles`), untimed or timed
      on openings alone (`opening`: the policy's first AR_TIMING_TOKENS tokens of a prompt), is
      predicted at least prompt lookup's tokens/s: its cycles verify lookup's proposal alone
      whenever that promises more than drafting (what a repetitive request shows through
      prompt lookup's τ, which the drafters' scale cannot). An opening under-measures it: its
      first cycles draft before its running lookup rate has anything to compare. On a tie it
      ranks first; once it decodes a whole batch, its own measurement predicts it.

    The choice becomes whichever now predicts fastest, if it predicts at least `margin` times
    the tokens/s of the choice so far (auto_policy.SWITCH_MARGIN after a decoded batch: the
    record is what the next batch and the next request start from, so a choice that a batch
    moved by less than the margin stays, within a request and across requests alike). A probed
    record (measured on the request's own prompts already) is left as it is. Returns self."""
    if not self.learns:
      return self
    table = self.auto_candidates
    label = label or self.auto_choice
    old = self.measured.get(label)
    machine = self.machine
    if (old and old['decode_steps'] >= MIN_PROBE_CYCLES and
        measured['decode_steps'] >= MIN_PROBE_CYCLES):
      # this candidate's program was timed before: how its cycle moved is the machine's drift
      machine = (measured['decode_s'] / measured['decode_steps']) / (
          old['unit_s'] / old['decode_steps'])
    self._see_lookup(measured)
    entry = {k: measured[k] + (RECENCY * old[k] if old else 0)
             for k in ('decode_tokens', 'cycles', 'decode_s', 'decode_steps')}
    # the seconds it would have taken at machine 1: the program's own cost
    entry['unit_s'] = measured['decode_s'] / machine + (RECENCY * old['unit_s'] if old else 0)
    if opening and (old is None or old.get('opening')):
      entry['opening'] = True  # (only the policy's timed openings have measured it so far)
    self.measured[label] = entry
    self.machine = machine
    if table[label]['method'] not in ('ar', 'pld'):
      self.scale_from = label  # the drafters' latest word on these prompts
    timed = {name: m for name, m in self.measured.items()
             if m['decode_steps'] >= MIN_PROBE_CYCLES}
    if not timed:  # too short to time yet: the same choice goes on, measuring
      return self
    for row in table.values():
      row.setdefault('prior_tau', row['tau'])

    def ar_step_ms(names):  # the AR step (ms) now that these measured candidates' cycles imply
      return machine * (sum(1e3 * timed[n]['unit_s'] / table[n]['cycle_ar_steps'] for n in names)
                        / sum(timed[n]['decode_steps'] for n in names))
    kind = lambda n: {'ar': 'ar', 'pld': 'pld'}.get(table[n]['method'], 'drafters')
    by_kind = {k: [n for n in timed if kind(n) == k] for k in ('ar', 'pld', 'drafters')}
    spec = by_kind['pld'] + by_kind['drafters']
    # a drafter candidate's cycle follows what the drafter candidates measured cost here; prompt
    # lookup drafts nothing (its cycle is a verification), so it follows AR's own step
    step_of = {'drafters': ar_step_ms(by_kind['drafters'] or spec or by_kind['ar']),
               'pld': ar_step_ms(by_kind['ar'] or spec)}
    shrunk = lambda tokens, cycles, prior: (tokens + PRIOR_CYCLES * prior) / (
        cycles + PRIOR_CYCLES)  # a measured τ, toward the prior's by PRIOR_CYCLES pseudo-cycles
    tau_of = {n: shrunk(m['decode_tokens'], m['cycles'], table[n]['prior_tau'])
              for n, m in timed.items()}
    seen = self.lookup_seen or {}
    last = self.scale_from
    scale = ((tau_of[last] - 1) / (table[last]['prior_tau'] - 1)
             if last in timed and table[last]['prior_tau'] > 1 else 1.0)
    for name, row in table.items():
      if name in timed:
        m = timed[name]
        tau, cycle = tau_of[name], machine * 1e3 * m['unit_s'] / m['decode_steps']
      else:
        tau = row['prior_tau']
        if row['method'] not in ('ar', 'pld'):
          tau = 1.0 + (tau - 1.0) * scale
        cycle = row['cycle_ar_steps'] * step_of.get(kind(name), step_of['pld'])
      if row['method'] == 'pld' and seen.get('cycles'):
        # every batch's outputs, whichever decoded them, shrunk toward its prior as a measured
        # τ is: one prompt that repeats itself is not the request
        tau = shrunk(seen['tokens'], seen['cycles'], row['prior_tau'])
      row.update(tau=round(tau, 3), cycle_ms=round(cycle, 4), measured=name in timed,
                 predicted_tokens_per_s=round(throughput.tokens_per_s(tau, cycle / 1e3, batch),
                                              2))
    # an adaptive tree that takes lookup-only cycles verifies prompt lookup's proposal alone
    # whenever that promises more: untimed or timed on an opening, it predicts at least what
    # prompt lookup does (and wins the tie, being the one of the two that also drafts where
    # lookup fails)
    lookup_rate = max((row['predicted_tokens_per_s'] for row in table.values()
                       if row['method'] == 'pld'), default=0.0)
    for name, row in table.items():
      if takes_lookup_cycles(row) and (name not in timed or timed[name].get('opening')):
        row['predicted_tokens_per_s'] = max(row['predicted_tokens_per_s'], lookup_rate)
    rate = lambda k: table[k]['predicted_tokens_per_s']
    best = max(table, key=lambda k: (rate(k), takes_lookup_cycles(table[k])))
    if rate(best) >= margin * rate(self.auto_choice):
      self.auto_choice = best
    self.predicted_tokens_per_s = table[self.auto_choice]['predicted_tokens_per_s']
    self.source, self.prompt_scale = 'prior+measured', round(scale, 4)
    return self

  def _see_lookup(self, measured: dict) -> None:
    """Adds to lookup_seen the tokens and cycles prompt lookup would have taken on the batch's
    completions (measured['prompt_ids'], measured['completion_ids']: every method's outputs
    are the target's own, so at T = 0 this is what pld does on them, replay.lookup_cycles,
    exactly), the earlier batches weighed by RECENCY. Prompt lookup's τ is then known from the
    first batch on, whichever candidate decoded it: its prior cannot know how much a request
    repeats its prompt."""
    pld = next((row for row in self.auto_candidates.values() if row['method'] == 'pld'), None)
    if pld is None or 'completion_ids' not in measured:
      return
    gamma = pld['spec'].get('gamma', SP.SpecSettings.gamma)
    ngram_max = pld['spec'].get('ngram_max', SP.SpecSettings.ngram_max)
    tokens = sum(max(len(c) - 1, 0) for c in measured['completion_ids'])
    cycles = sum(replay.lookup_cycles(p, c, gamma, ngram_max)
                 for p, c in zip(measured['prompt_ids'], measured['completion_ids']))
    old = self.lookup_seen or {'tokens': 0.0, 'cycles': 0.0}
    self.lookup_seen = {'tokens': tokens + RECENCY * old['tokens'],
                        'cycles': cycles + RECENCY * old['cycles']}

