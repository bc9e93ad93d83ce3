"""Recipe ablation: the same fine-tune of drafter 1 under each recipe change, one held-out table.

  python benchmarks/recipe_ablation.py                       # all variants (resumable)
  python benchmarks/recipe_ablation.py --variants distill,corpus_hard --steps 400

Every variant starts from the shipped drafter 1 (`--init_from`) and trains the same number of
steps with the same schedule, seed and batches of distilled windows; variants differ in one
recipe change each:

  distill        the distilled responses only (the baseline: what more steps alone buy)
  corpus_hard    + the teacher-forced corpus (data/corpus), labelled with the target's argmax
  corpus_soft    + the corpus, labelled with the target's top-k distribution (loss.soft=1)
  corpus_both    + the corpus, half argmax and half top-k (loss.soft=0.5)
  reveal         the distilled responses, half the blocks partly unmasked (loss.reveal=0.5):
                 what multi-step denoising needs (measure spec.steps with drafter_quality.py)

All are evaluated on the same held-out distilled windows (the corpus is training data only),
so the held-out τ estimate and loss compare directly. Each run is `train.py` in its own
workdir (rerunning resumes it; finished runs are read back, not retrained). Prints a table and
writes it as JSON (--out).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

VARIANTS = {
    'distill': [],
    'corpus_hard': ['--config.data.corpus_path={corpus}', '--config.loss.soft=0.0'],
    'corpus_soft': ['--config.data.corpus_path={corpus}', '--config.loss.soft=1.0'],
    'corpus_both': ['--config.data.corpus_path={corpus}', '--config.loss.soft=0.5'],
    'reveal': ['--config.loss.reveal=0.5'],
}


def last_eval(workdir: str) -> dict | None:
  path = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.exists(path):
    return None
  evals = [r for r in map(json.loads, open(path)) if 'eval' in r]
  return evals[-1] if evals else None


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--variants', default=','.join(VARIANTS))
  parser.add_argument('--steps', type=int, default=400)
  parser.add_argument('--lr', type=float, default=3e-4)
  parser.add_argument('--init_from', default=os.path.join(ROOT, 'drafters', 'smollm2-drafter1'))
  parser.add_argument('--data', default=os.path.join(ROOT, 'data', 'distill'))
  parser.add_argument('--corpus', default=os.path.join(ROOT, 'data', 'corpus'))
  parser.add_argument('--corpus_windows', type=int, default=0, help='0: all labelled windows')
  parser.add_argument('--features_dir', default=os.path.join(ROOT, 'runs', 'drafter1',
                                                            'features'),
                      help='shared by every variant (the distilled windows\' file is reused)')
  parser.add_argument('--workdir', default=os.path.join(ROOT, 'runs', 'ablation'))
  parser.add_argument('--out', default=os.path.join(ROOT, 'results', 'recipe_ablation.json'))
  args = parser.parse_args()
  names = args.variants.split(',')
  unknown = [n for n in names if n not in VARIANTS]
  if unknown:
    parser.error(f'unknown variant(s) {unknown}: choose from {list(VARIANTS)}')

  rows = []
  for name in names:
    workdir = os.path.join(args.workdir, name)
    done = last_eval(workdir)
    if not done or done['step'] < args.steps:
      cmd = [sys.executable, os.path.join(ROOT, 'train.py'), '--config',
             os.path.join(ROOT, 'configs', 'drafter1.py'), f'--config.workdir={workdir}',
             f'--config.init_from={args.init_from}', f'--config.data.path={args.data}',
             f'--config.data.features_dir={args.features_dir}',
             f'--config.data.corpus_windows={args.corpus_windows}',
             f'--config.train.steps={args.steps}', f'--config.train.lr={args.lr}',
             f'--config.train.warmup={max(1, args.steps // 10)}',
             f'--config.eval_every={args.steps}', '--config.progress_bar=False']
      cmd += [a.format(corpus=args.corpus) for a in VARIANTS[name]]
      print('$ ' + ' '.join(cmd), flush=True)
      subprocess.run(cmd, check=True, cwd=ROOT)
      done = last_eval(workdir)
    ev = done['eval']
    metrics = [r for r in map(json.loads, open(os.path.join(workdir, 'metrics.jsonl')))
               if 'tokens_per_s' in r]
    rows.append({'variant': name, 'step': done['step'], 'eval_loss': round(ev['loss'], 4),
                 'tau_estimate': ev['tau_estimate'], 'acc_by_pos': ev['acc_by_pos'],
                 'ece': ev['ece'], 'train_tokens_per_s': metrics[-1]['tokens_per_s'],
                 'flags': VARIANTS[name]})
    print(json.dumps(rows[-1]), flush=True)
  print('\n| variant | held-out loss | held-out τ estimate | pos-1 acc |\n|---|---|---|---|')
  for r in rows:
    print(f"| {r['variant']} | {r['eval_loss']:.3f} | {r['tau_estimate']:.3f} | "
          f"{r['acc_by_pos'][1]:.3f} |")
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, 'w') as f:
    json.dump({'steps': args.steps, 'lr': args.lr, 'init_from': args.init_from,
               'corpus_windows': args.corpus_windows, 'rows': rows}, f, indent=1)


if __name__ == '__main__':
  main()
