"""TPU compile results kept in a JSON file (results/tpu_compile.json), each under its chip,
target, drafters, mesh, batch and context (`record_key`): benchmarks/tpu_compile.py writes them
(`record`); the cost model (`costmodel predict`) and the break-even tables read them back
(`recorded`, `breakeven`)."""
from __future__ import annotations

import json
import os

from d2sd_jax import files


def record_key(result: dict) -> str:
  """What a kept result is looked up by: chip, target, drafters, mesh, batch and context."""
  mesh = 'x'.join(str(result['mesh'][a]) for a in ('data', 'model'))
  return (f"{result['chip']}|{result['target']}|{result['drafters']}|mesh={mesh}|"
          f"batch={result['batch']}|context={result['context']}")


def record(path: str, result: dict) -> None:
  """Keeps `result` in the JSON file at `path` under `record_key` (other entries stay)."""
  kept = {}
  if os.path.exists(path):
    with open(path) as f:
      kept = json.load(f)
  kept[record_key(result)] = result
  files.write_json(path, kept)


def recorded(path: str, chip: str, target: str, drafters: str = 'paper', batch: int = 1,
             context: int = 1024) -> dict | None:
  """The kept result (`record`) for `chip` (a TpuChip name, e.g. 'TPU v5p'), target, drafters,
  batch and context on the fewest devices, or None. `costmodel predict` takes TPU cycle costs
  from it."""
  if not os.path.exists(path):
    return None
  with open(path) as f:
    kept = json.load(f)
  fits = [r for r in kept.values() if (r['chip'], r['target'], r['drafters'], r['batch'],
                                       r['context']) == (chip, target, drafters, batch, context)]
  return min(fits, key=lambda r: r['mesh']['data'] * r['mesh']['model'], default=None)


def step_estimates(result: dict) -> dict:
  """{method: estimated seconds of its step (AR step or cycle)} of a result."""
  return {p['method']: p['estimate_s'] for p in result['programs']
          if p.get('compiled') and p['name'] == 'step'}


def breakeven(kept: dict, chip: str, target: str, drafters: str = 'paper', mesh: str = '1x1',
              context: int = 1024) -> dict:
  """{batch: {method: its cycle in AR steps}} of every kept result (`record`) for this chip,
  target, drafters, mesh ('DATAxMODEL') and context. A cycle of c AR steps commits τ tokens per
  row where AR commits c: the method beats AR exactly where its τ exceeds c, at that batch.
  As the batch grows, the AR step stays bound by the weights while a cycle's verification
  reads more per row, so c rises and speculation stops paying where τ falls below it."""
  out = {}
  for result in kept.values():
    shape = f"{result['mesh']['data']}x{result['mesh']['model']}"
    if (result['chip'], result['target'], result['drafters'], shape, result['context']) != (
        chip, target, drafters, mesh, context):
      continue
    est = step_estimates(result)
    if 'ar' in est:
      out[result['batch']] = {m: s / est['ar'] for m, s in est.items() if m != 'ar'}
  return dict(sorted(out.items()))
