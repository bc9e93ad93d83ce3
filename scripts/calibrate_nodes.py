"""Fits the best-first trees' reliability curves: how often a node that its proposer (drafter 1,
drafter 2, prompt lookup) scored p is really accepted, by depth, on held-out prompts, and stores
them with the drafters (their folders' node_calibration.json; DrafterConfig.node_calibration).

  python scripts/calibrate_nodes.py [--packages sympy,pydantic,hypothesis,werkzeug]
      [--prompts 6] [--kinds plain,chat] [--budgets 8,16,32] [--new_tokens 96]
      [--temperatures 0,0.7] [--drafter1 drafters/smollm2-drafter1]
      [--drafter2 drafters/smollm2-drafter2] [--tallies FILE] [--write]

The prompts are the documented functions of installed packages that no training set holds
(plain completions, and questions about them in the chat template; benchmarks/drafter_quality.py's
package_prompts), so the curves describe code the drafters never saw. numpy stays out (it is
reserved for evaluation), and so does networkx (the unseen package the docs measure on).
d2sd_tree decodes them greedily at each node budget with raw scores (spec.calibrated=False) and
tallies every verified node (spec.tally_nodes): count, estimated probability, accepted. Per
proposer and depth group (tree.CALIBRATION_DEPTHS) the curve is each bin's accepted rate at its
mean estimate, shrunk toward the group's overall rate where the bin holds few nodes, made
non-decreasing (pool-adjacent-violators). It prints each proposer's estimated against accepted
nodes before and after; --write stores the curves: drafter 1's folder gets its own and prompt
lookup's, drafter 2's its re-drafts'. Sampling accepts less than greedy matching, so each
temperature of --temperatures gets curves of its own (named 'lookup@0.7' for T = 0.7; plain
'lookup' for greedy), and a decode takes those fitted nearest its temperature
(SpecSettings.node_calibration). With several --kinds each kind also gets its own ('lookup:chat',
'drafter1@0.7:plain'; tree.curve_label), which a request of that kind reads
(SpecSettings.calibration_kind); --tallies FILE keeps the raw counts per temperature and kind.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))
from drafter_quality import package_prompts  # pylint: disable=wrong-import-position

import d2sd_jax  # pylint: disable=wrong-import-position
from d2sd_jax.formats import checkpoints  # pylint: disable=wrong-import-position
from d2sd_jax.spec_decode import tree as tree_lib  # pylint: disable=wrong-import-position

RESERVED = ('numpy', 'networkx')  # evaluation's packages: never fitted on
SHRINK = 5.0  # pseudo-nodes pulling a bin toward its group's overall rate


def isotonic(y, w):
  """Pool-adjacent-violators: the non-decreasing sequence nearest to y in weights w."""
  blocks = []  # [value, weight, length]
  for v, wt in zip(y, w):
    blocks.append([v, wt, 1])
    while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
      v2, w2, n2 = blocks.pop()
      v1, w1, n1 = blocks.pop()
      blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
  return [v for v, _, n in blocks for _ in range(n)]


def fit_curves(tally) -> dict:
  """{proposer: [[estimates, rates] per depth group]} from a tally [sources, depths, bins, 3]
  (count, estimated sum, accepted sum); a group without nodes gets the identity."""
  tally = np.asarray(tally, np.float64)
  G = tree_lib.CALIBRATION_DEPTHS
  out = {}
  for s, name in enumerate(tree_lib.SOURCES):
    curves = []
    for g in range(G):
      cells = tally[s, g:] if g == G - 1 else tally[s, g:g + 1]
      bins = cells.sum(0)  # [bins, 3]
      count, est, acc = bins[:, 0], bins[:, 1], bins[:, 2]
      if count.sum() == 0:
        curves.append([[1.0], [1.0]])
        continue
      rate = (acc.sum() + 1.0) / (est.sum() + 1.0)  # the group's overall accepted / estimated
      keep = count > 0
      x = est[keep] / count[keep]
      y = (acc[keep] + SHRINK * rate * x) / (count[keep] + SHRINK)
      y = np.clip(isotonic(list(y), list(count[keep])), 0.0, 1.0)
      x = np.clip(x, 1e-6, 1.0)
      xs, ys = [], []
      for xi, yi in zip(x, y):  # strictly increasing estimates
        if not xs or xi > xs[-1]:
          xs.append(round(float(xi), 6))
          ys.append(round(float(yi), 6))
      curves.append([xs, ys])
    out[name] = curves
  return out


def calibrated_sum(tally, curves: dict) -> np.ndarray:
  """[sources] the tallied nodes' estimates summed after the curves (bin means through them)."""
  tally = np.asarray(tally, np.float64)
  G = tree_lib.CALIBRATION_DEPTHS
  out = np.zeros(len(tree_lib.SOURCES))
  for s, name in enumerate(tree_lib.SOURCES):
    for d in range(tally.shape[1]):
      xs, ys = curves[name][min(d, G - 1)]
      count, est = tally[s, d, :, 0], tally[s, d, :, 1]
      mean = np.where(count > 0, est / np.maximum(count, 1), 0.0)
      out[s] += float(np.sum(count * np.interp(mean, [0.0] + xs, [0.0] + ys)))
  return out


def report(tally, curves: dict) -> list[str]:
  tally = np.asarray(tally, np.float64)
  after = calibrated_sum(tally, curves)
  lines = [f"{'proposer':<10}{'nodes':>8}{'estimated':>11}{'accepted':>10}{'calibrated':>12}"]
  for s, name in enumerate(tree_lib.SOURCES):
    t = tally[s].sum((0, 1))
    lines.append(f'{name:<10}{t[0]:>8.0f}{t[1]:>11.1f}{t[2]:>10.0f}{after[s]:>12.1f}')
  return lines


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  ap.add_argument('--packages', default='sympy,pydantic,hypothesis,werkzeug')
  ap.add_argument('--prompts', type=int, default=6, help='per package and kind')
  ap.add_argument('--kinds', default='plain,chat')
  ap.add_argument('--budgets', default='8,16,32', help='d2sd_tree node budgets to decode at')
  ap.add_argument('--new_tokens', type=int, default=96)
  ap.add_argument('--temperatures', default='0,0.7', help='sampling temperatures to fit at')
  ap.add_argument('--target', default='smollm2')
  ap.add_argument('--drafter1', default='drafters/smollm2-drafter1')
  ap.add_argument('--drafter2', default='drafters/smollm2-drafter2')
  ap.add_argument('--write', action='store_true', help="store the curves in the drafters' folders")
  ap.add_argument('--tallies', default='', help='also save the raw node tallies (JSON) here')
  args = ap.parse_args(argv)
  packages = [p for p in args.packages.split(',') if p]
  reserved = [p for p in packages if p.split('.')[0] in RESERVED]
  if reserved:
    raise SystemExit(f'--packages {",".join(reserved)}: reserved for evaluation; fit on others')
  dec = d2sd_jax.load(args.target, args.drafter1, args.drafter2)
  curves, tallies = {}, {}
  kinds = args.kinds.split(',')
  for temperature in (float(t) for t in args.temperatures.split(',')):
    by_kind = {}
    for kind in kinds:
      chat = kind == 'chat'
      prompts = [p for pkg in packages for p in package_prompts(pkg, args.prompts, chat)]
      for budget in (int(b) for b in args.budgets.split(',')):
        g = dec.generate(prompts, max_new_tokens=args.new_tokens, method='d2sd_tree', chat=chat,
                         batch_size=1, tree_budget=budget, calibrated=False, tally_nodes=True,
                         temperature=temperature, calibration_kind='')
        part = np.asarray(g.stats['node_tally'])
        by_kind[kind] = part if kind not in by_kind else by_kind[kind] + part
        print(f"T {temperature} {kind} budget {budget}: tau {g.stats['tau']}, raw expected tau "
              f"{g.stats['expected_tau']}", flush=True)
    tally = sum(by_kind.values())
    # pooled curves, and with several kinds each kind's own (a request of that kind reads them)
    for kind, part in [('', tally)] + (list(by_kind.items()) if len(kinds) > 1 else []):
      fitted = fit_curves(part)
      curves.update({tree_lib.curve_label(name, temperature, kind): c
                     for name, c in fitted.items()})
      print(f"T = {temperature:g}{', ' + kind if kind else ', pooled'}:")
      print('\n'.join(report(part, fitted)))
    tallies[temperature] = tally
    if args.tallies:  # the raw counts, so curves can be refitted without decoding again
      kept = json.load(open(args.tallies)) if os.path.exists(args.tallies) else {}
      kept.update({f'{temperature:g}:{kind}': np.asarray(part).tolist()
                   for kind, part in by_kind.items()})
      with open(args.tallies, 'w') as f:
        json.dump(kept, f)
  if args.write:
    about = {'command': 'python ' + ' '.join(shlex.quote(a) for a in sys.argv),
             'date': datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC'),
             'machine': f'{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs',
             'packages': packages, 'prompts_per_package': args.prompts, 'kinds': args.kinds,
             'budgets': args.budgets, 'new_tokens': args.new_tokens,
             'drafter1': args.drafter1, 'drafter2': args.drafter2,
             'temperatures': args.temperatures,
             'nodes': {f'{n} at T {t:g}': int(np.asarray(tally)[s, ..., 0].sum())
                       for t, tally in tallies.items() for s, n in enumerate(tree_lib.SOURCES)}}
    for folder, names in ((args.drafter1, ('drafter1', 'lookup')), (args.drafter2, ('drafter2',))):
      mine = {label: c for label, c in curves.items()
              if tree_lib.parse_curve_label(label)[0] in names}
      kept, fits = stored(folder)  # the other temperatures' curves stay
      fits.update({f'{t:g}': about for t in tallies})
      print('wrote', checkpoints.write_node_calibration(folder, {**kept, **mine},
                                                        {'fits': fits}))


def stored(folder: str) -> tuple[dict, dict]:
  """(curves, fits: {temperature: how they were fitted}) already in a drafter folder's file."""
  path = os.path.join(checkpoints.resolve_path(folder), checkpoints.CALIBRATION_FILE)
  if not os.path.exists(path):
    return {}, {}
  with open(path) as f:
    book = json.load(f)
  fits = book.get('fits') or {'0': {k: v for k, v in book.items() if k != 'curves'}}
  return dict(book.get('curves', {})), fits


if __name__ == '__main__':
  main()
