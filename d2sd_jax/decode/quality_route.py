"""method='auto' with a quality budget: (denoising steps, λ) from the measured frontier.

A request may accept outputs that are not the target's own, for speed: `quality_budget` is the
NLL per token (under the target) it may add over lossless decoding. 0, the default, is
lossless, and auto then weighs lossless configurations only (autoconfig.py). Above 0, auto
reads the (steps × λ) frontier that `python benchmarks/reproduce.py --only pareto` measured
(results/reproduce.json's "pareto": dflash at temperature 1; D2SD_FRONTIER overrides the file)
and decodes dflash with the fastest measured point whose NLL per token is within the budget
of the lossless point's (λ = 0, one denoising step). The frontier was measured at temperature
1, with the drafters it names, so a request at another temperature is refused: acceptance,
and so both speed and quality, depend on it.
"""
from __future__ import annotations

import dataclasses
import json
import os

from d2sd_jax.formats import checkpoints
from d2sd_jax.spec_decode import speculative as SP

METHOD = 'dflash'  # the method the frontier measures


def frontier_path() -> str:
  return os.environ.get('D2SD_FRONTIER',
                        os.path.join(checkpoints.REPO_ROOT, 'results', 'reproduce.json'))


def read_frontier(path: str | None = None) -> tuple[list[dict], dict]:
  """(the frontier's points, the run that measured them); a ValueError naming the fix."""
  path = path or frontier_path()
  fix = 'measure it: python benchmarks/reproduce.py --only pareto (or set D2SD_FRONTIER)'
  try:
    with open(path) as f:
      book = json.load(f)
    points = book['pareto']['points']
    run = book.get('runs', {}).get('pareto', {})
    for p in points:
      for key in ('steps', 'leniency', 'decode_tokens_per_s', 'nll_per_token'):
        float(p[key])
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise ValueError(f'quality_budget: no readable (steps x λ) frontier at {path} '
                     f'({type(e).__name__}: {e}); {fix}') from e
  if not any(p['leniency'] == 0 and p['steps'] == 1 for p in points):
    raise ValueError(f'quality_budget: the frontier at {path} has no lossless point (λ = 0, '
                     f'steps = 1) to measure the budget from; {fix}')
  return points, run


def choose_point(points: list[dict], budget: float) -> tuple[dict, float]:
  """(the fastest point whose NLL per token is within `budget` of the lossless point's, the NLL
  it adds). A point measured lossless (λ = 0) is always within any budget."""
  base = next(p for p in points if p['leniency'] == 0 and p['steps'] == 1)['nll_per_token']
  within = [p for p in points
            if p['leniency'] == 0 or p['nll_per_token'] - base <= budget]
  best = max(within, key=lambda p: p['decode_tokens_per_s'])
  return best, (0.0 if best['leniency'] == 0 else best['nll_per_token'] - base)


def check(options) -> None:
  """The budget's own checks (decode.py refuses before anything loads)."""
  budget = options.quality_budget
  if budget < 0:
    raise ValueError(f'quality_budget={budget} must be >= 0 (0: lossless, the target\'s own '
                     'outputs)')
  if budget and options.method != 'auto':
    raise ValueError(f'quality_budget={budget} is for method=auto; with method='
                     f'{options.method!r} set the knobs yourself (spec.leniency, spec.steps)')
  if budget and options.temperature != 1.0:
    raise ValueError(f'quality_budget={budget} needs temperature=1.0, where the frontier was '
                     f'measured (temperature={options.temperature}); or decode losslessly '
                     '(quality_budget=0)')
  defaults = {f.name: f.default for f in dataclasses.fields(SP.SpecSettings)}
  if budget and any(options.spec.get(k) not in (None, defaults[k]) for k in ('leniency', 'steps')):
    raise ValueError('quality_budget chooses spec.leniency and spec.steps: drop them, or drop '
                     'the budget')


def route(options, path: str | None = None, log=print):
  """(the Options that decode a request with quality_budget > 0, its stats): dflash at the
  frontier point `choose_point` picks, with one line saying which and why."""
  points, run = read_frontier(path)
  point, added = choose_point(points, options.quality_budget)
  spec = {**options.spec, 'steps': int(point['steps']), 'leniency': float(point['leniency'])}
  line = (f"auto: {METHOD}(steps={spec['steps']}, λ={spec['leniency']}) from the measured "
          f"frontier ({path or frontier_path()}, {run.get('date', 'undated')}, drafters "
          f"{run.get('drafters', '?')}): {point['decode_tokens_per_s']} tokens/s measured, "
          f'{added:+.3f} NLL/token against the budget {options.quality_budget}')
  log(line)
  return dataclasses.replace(options, method=METHOD, spec=spec), {
      'auto_choice': f"{METHOD}(steps={spec['steps']},leniency={spec['leniency']})",
      'auto_source': 'frontier', 'auto_reason': line, 'quality_budget': options.quality_budget,
      'quality_added_nll': round(added, 4)}
