"""A GPU lease's decoding figures beside the cost model's prediction for that chip.

  python benchmarks/gpu_results.py OUT [--chip h200] [--record] [--markdown [--write]]

OUT is the folder `benchmarks/gpu_session.sh` filled on the GPU: decode.jsonl (one JSON line
per method: tau, tokens/s, speed-up over AR, lossless), session.log (the machine, the
versions, the date) and metrics_<run>.jsonl (train.py's metrics of each drafter run there).
For each method this adds the roofline's prediction for the chip at
SmolLM2's shapes with the shipped drafters' configs: tau (measured there; it does not depend on
the hardware) × AR step / cycle, where the AR step and the cycle are the roofline costs of the
same programs (`costmodel.predict`); and each training run's held-out evaluations.
--record keeps the whole in results/gpu.json under the chip's name (--markdown then reads it
from there when OUT is not given); --markdown prints the tables, --write puts the decoding
table into docs/results.md and the training runs into docs/training.md, between their gpu_results.py
markers.
"""
from __future__ import annotations

import argparse
import ast
import glob
import json
import os
import re
import shlex
import sys

from d2sd_jax import files
from d2sd_jax.formats import checkpoints
from d2sd_jax.formats import loaders
from d2sd_jax.perf import costmodel
from d2sd_jax.spec_decode import ar
from d2sd_jax.spec_decode import speculative as SP

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD = os.path.join(ROOT, 'results', 'gpu.json')
RESULTS = os.path.join(ROOT, 'docs', 'results.md')
TRAINING = os.path.join(ROOT, 'docs', 'training.md')
BEGIN, END = '<!-- gpu_results.py --markdown: begin -->', '<!-- gpu_results.py --markdown: end -->'
# What each run of benchmarks/gpu_session.sh trained (its MODE, the run's name there).
RUNS = {'d1': 'drafter 1 from drafters/smollm2-drafter1, lr 3e-4',
        'd2': 'drafter 2 from drafters/smollm2-drafter2, lr 2e-4',
        'd1b': 'drafter 1 on from d1 (MODE=more), lr 2e-4',
        'd2b': 'drafter 2 on from d2 (MODE=more), lr 2e-4'}
COMMAND = ('OUT=DIR bash benchmarks/gpu_session.sh 565 (on the GPU), then '
           'python benchmarks/gpu_results.py')



def read_lease(out: str) -> dict:
  """decode.jsonl's rows and summary, and session.log's machine, versions and date."""
  rows, summary = [], {}
  with open(os.path.join(out, 'decode.jsonl')) as f:
    for line in f:
      r = json.loads(line)
      if 'summary' in r:
        summary = r
      else:
        rows.append(r)
  with open(os.path.join(out, 'session.log')) as f:
    log = f.read()
  gpu = re.search(r'GPU 0: (.+?) \(UUID', log)
  versions = re.search(r"^\{'jax'.*\}$", log, re.M)
  date = re.search(r'^date: (\S+)', log, re.M)
  versions = ast.literal_eval(versions.group(0)) if versions else {}
  machine = (f"{gpu.group(1) if gpu else 'unknown GPU'}, jax {versions.get('jax', '?')}")
  training = {}
  for path in sorted(glob.glob(os.path.join(out, 'metrics_*.jsonl'))):
    run = os.path.basename(path)[len('metrics_'):-len('.jsonl')]
    with open(path) as f:
      lines = [json.loads(line) for line in f if line.strip()]
    steps = [r for r in lines if 'eval' not in r]
    training[run] = {
        'what': RUNS.get(run, run), 'steps': steps[-1]['step'] if steps else 0,
        'sequence_tokens_per_s': steps[-1].get('tokens_per_s') if steps else None,
        'evals': [{'step': r['step'], 'loss': round(r['eval']['loss'], 3),
                   'tau_estimate': r['eval']['tau_estimate'], 'ece': r['eval'].get('ece')}
                  for r in lines if 'eval' in r]}
  return {'rows': rows, 'summary': summary, 'machine': machine, 'training': training,
          'date': date.group(1) if date else None}


def predictions(methods: list[str], chip: str, drafter1: str, drafter2: str, gamma: int = 8,
                budget: int = 16, context: int = 512) -> tuple[dict, costmodel.CycleCosts]:
  """Per method: the roofline's AR steps per cycle on `chip` (the cycle / the AR step)."""
  tcfg = loaders.gguf_config(loaders.smollm2_gguf_path())
  d1, _ = checkpoints.read_drafter_config(drafter1)
  d2, _ = checkpoints.read_drafter_config(drafter2)
  gen = ar.GenerationSettings(max_new_tokens=8, eos_ids=(), pad_id=0)
  specs = {m: SP.SpecSettings(gen, method=m, gamma=gamma, drafter1=d1, drafter2=d2,
                              n_branches=4, tree_budget=budget)
           for m in methods}
  costs = costmodel.predict(tcfg, costmodel.CHIPS[chip], list(specs.values()), 1, context,
                            sizes=sorted({1} | {s.tree_size for s in specs.values()}))
  return {m: costs.cycle(s) / costs.ar_step for m, s in specs.items()}, costs


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('out', nargs='?', default='',
                      help='the folder benchmarks/gpu_session.sh filled (none: --markdown of '
                      'results/gpu.json)')
  parser.add_argument('--chip', default='h200', choices=sorted(costmodel.CHIPS))
  parser.add_argument('--drafter1', default='drafters/smollm2-drafter1')
  parser.add_argument('--drafter2', default='drafters/smollm2-drafter2')
  parser.add_argument('--drafters_label', default='',
                      help='what the drafters were, for the record (default: their paths)')
  parser.add_argument('--date', default='', help="the lease's date, if session.log lacks it")
  parser.add_argument('--record', action='store_true', help='keep it in results/gpu.json')
  parser.add_argument('--markdown', action='store_true')
  parser.add_argument('--write', action='store_true', help='with --markdown: into docs/results.md and docs/training.md')
  args = parser.parse_args()
  if args.out:
    record = lease_record(args)
    print(json.dumps(record))
    if args.record:
      kept = {}
      if os.path.exists(RECORD):
        with open(RECORD) as f:
          kept = json.load(f)
      files.write_json(RECORD, {**kept, args.chip: record})
  elif args.markdown:
    with open(RECORD) as f:
      record = json.load(f)[args.chip]
  else:
    parser.error('give the folder gpu_session.sh filled, or --markdown')
  if args.markdown:
    print(markdown(record))
    print(training_markdown(record))
    if args.write:
      write_markdown(record)


def lease_record(args) -> dict:
  """What --record keeps: the lease's rows beside the roofline's predictions, its settings,
  machine, date and command, and its training runs."""
  lease = read_lease(args.out)
  methods = [r['method'] for r in lease['rows'] if r['method'] != 'ar']
  steps, costs = predictions(methods, args.chip, args.drafter1, args.drafter2)
  ar_row = next(r for r in lease['rows'] if r['method'] == 'ar')
  rows = [{'method': 'ar', 'tau': 1.0, 'tokens_per_s': ar_row['decode_tokens_per_s'],
           'ms_per_token': ar_row['ms_per_token'], 'speedup': 1.0, 'predicted_speedup': 1.0}]
  for r in lease['rows']:
    if r['method'] == 'ar':
      continue
    rows.append({'method': r['method'], 'tau': r['tau'], 'tokens_per_s': r['decode_tokens_per_s'],
                 'ms_per_token': r['ms_per_token'], 'speedup': r['speedup_vs_ar'],
                 'lossless': r['lossless'], 'tree_size': r['tree_size'],
                 'predicted_ar_steps_per_cycle': round(steps[r['method']], 3),
                 'predicted_speedup': round(r['tau'] / steps[r['method']], 2)})
  s = lease['summary']
  return {
      'command': ' '.join([COMMAND, *(shlex.quote(a) for a in sys.argv[1:])]),
      'date': lease['date'] or args.date, 'machine': lease['machine'],
      'settings': (f"{s.get('prompts')} prompts ({s.get('prompts_file')}), "
                   f"{s.get('new_tokens')} new tokens, batch 1, greedy, {s.get('dtype')} target, "
                   f"tree budget 16, "
                   f"{args.drafters_label or f'drafters {args.drafter1} and {args.drafter2}'}"),
      'roofline': {'chip': costmodel.CHIPS[args.chip].name,
                   'ar_step_ms': round(1e3 * costs.ar_step, 4),
                   'measured_ar_step_ms': ar_row['ms_per_token']},
      'rows': rows, 'training': lease['training']}


def markdown(record: dict) -> str:
  """The decoding table: measured beside the roofline's prediction."""
  roof = record['roofline']
  lines = [f"**{record['machine']}**: {record['settings']} ({record['date']}, "
           f"`{record['command']}`). AR step measured {roof['measured_ar_step_ms']} ms; the "
           f"{roof['chip']} roofline's {roof['ar_step_ms']} ms.", '',
           '| method | τ | tokens/s | speed-up over AR | roofline prediction '
           '(τ × AR step / cycle) |',
           '|---|---|---|---|---|']
  for r in record['rows']:
    lines.append(f"| {r['method']} | {r['tau']:.2f} | {r['tokens_per_s']:.0f} | "
                 f"{r['speedup']:.2f}× | {r['predicted_speedup']:.2f}× |")
  return '\n'.join(lines) + '\n'


def training_markdown(record: dict) -> str:
  """The training runs' held-out evaluations, first and last."""
  lines = [f"Training runs of the lease ({record['machine']}, {record['date']}):", '',
           '| run | steps | sequence tokens/s | held-out loss | held-out chain τ estimate |',
           '|---|---|---|---|---|']
  for run, t in record.get('training', {}).items():
    first, last = t['evals'][0], t['evals'][-1]
    lines.append(f"| {run}: {t['what']} | {t['steps']:,} | {t['sequence_tokens_per_s']:,.0f} | "
                 f"{first['loss']} (step {first['step']:,}) → {last['loss']} | "
                 f"{first['tau_estimate']} → {last['tau_estimate']} |")
  return '\n'.join(lines) + '\n'


def write_markdown(record: dict, results: str = RESULTS, training: str = TRAINING) -> None:
  """The decoding table into docs/results.md, the training runs into docs/training.md, each between
  its gpu_results.py markers."""
  files.replace_block(results, BEGIN, END, markdown(record))
  files.replace_block(training, BEGIN, END, training_markdown(record))


if __name__ == '__main__':
  main()
