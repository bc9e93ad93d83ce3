"""Records what method='auto' predicts from: each candidate's acceptance (E[τ]) and its cycle
in AR steps, measured on held-out prompts, into drafters/auto_priors.json:

  python scripts/auto_priors.py [--prompts 6] [--new_tokens 128] [--batch 1]

The prompts are held-out distillation records (data/distill, the split training holds out by
id: never trained on), half chat requests and half plain completions. Every candidate decodes
them through autoconfig.probe (the first prompt warms the programs up). A record is kept per
target, drafters (weights digests), platform and batch; rerunning replaces that record and
keeps the others. The measurement's date, machine and command are stored with it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax

from d2sd_jax import files
from d2sd_jax.decode import autoconfig
from d2sd_jax.decode import options as options_lib
from d2sd_jax.formats import checkpoints
from d2sd_jax.formats import loaders
from d2sd_jax.formats.drafters import load_drafter
from d2sd_jax.perf import costmodel
from d2sd_jax.train import data as data_lib


def held_out_prompts(path: str, n: int, fraction: float, max_tokens: int) -> list[list[int]]:
  """The prompt ids of n held-out records, alternating chat and plain styles."""
  styles = {}
  for r in data_lib.held_out_records(path, fraction):
    if len(r['prompt_ids']) <= max_tokens:
      styles.setdefault(bool(r.get('chat')), []).append(r['prompt_ids'])
  chat, plain = styles.get(True, []), styles.get(False, [])
  out = [p for pair in zip(chat, plain) for p in pair][:n]
  if len(out) < n:
    raise SystemExit(f'{path}: only {len(out)} held-out prompts of both styles')
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--target', default='smollm2')
  parser.add_argument('--drafter1', default='drafters/smollm2-drafter1')
  parser.add_argument('--drafter2', default='drafters/smollm2-drafter2')
  parser.add_argument('--data', default='data/distill')
  parser.add_argument('--eval_fraction', type=float, default=0.05)
  parser.add_argument('--prompts', type=int, default=6)
  parser.add_argument('--new_tokens', type=int, default=128)
  parser.add_argument('--batch', type=int, default=1)
  parser.add_argument('--out', default=autoconfig.priors_path())
  args = parser.parse_args()
  target = loaders.load_target(args.target)
  drafters = {n: load_drafter(p, target)[:2] for n, p in
              (('drafter1', args.drafter1), ('drafter2', args.drafter2))}
  prompts = held_out_prompts(args.data, args.prompts, args.eval_fraction, 448)
  options = options_lib.Options(method='auto', max_new_tokens=args.new_tokens, chat=False)
  autoconfig.PROBE_PROMPTS = len(prompts)  # every held-out prompt, the first to warm up
  t0 = time.time()
  probed = autoconfig.probe(target, drafters, prompts, options, args.batch, target.tokenizer,
                            log=lambda m: print(m, file=sys.stderr))
  record = {
      'target': checkpoints.target_fingerprint(target), 'platform': jax.devices()[0].platform,
      'batch': args.batch,
      'drafters': {n: autoconfig.params_digest(p) for n, (_, p) in drafters.items()},
      'candidates': {label: {k: row[k] for k in ('method', 'spec', 'tau', 'cycle_ar_steps')}
                     for label, row in probed.auto_candidates.items()},
      'run': {'date': time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()),
              'machine': costmodel.machine(),
              'command': ' '.join(['python scripts/auto_priors.py', *sys.argv[1:]]).strip(),
              'prompts': f'{len(prompts)} held-out records of {args.data}, '
                         f'{args.new_tokens} new tokens', 'seconds': round(time.time() - t0)}}
  book = {'version': autoconfig.RECORD_PRIORS, 'records': []}
  if os.path.exists(args.out):
    with open(args.out) as f:
      book = json.load(f)
  keep = [r for r in book['records'] if (r['target'], r['platform'], r['batch'], r['drafters'])
          != (record['target'], record['platform'], record['batch'], record['drafters'])]
  book['records'] = keep + [record]
  files.write_json(args.out, book)
  print(json.dumps(record, indent=1))


if __name__ == '__main__':
  main()
