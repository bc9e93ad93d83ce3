"""Prompt lookup's measured per-token acceptance rate per matched n-gram length, on held-out
distillation records (the target's greedy responses, never trained on): the table d2sd_tree
scores prompt lookup's nodes with (SpecSettings.lookup_accept).

  python scripts/lookup_rates.py [--data data/distill] [--gamma 8] [--ngram_max 3]
"""
from __future__ import annotations

import argparse
import json

from d2sd_jax.train import calibration
from d2sd_jax.train import data as data_lib


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--data', default='data/distill', help='distillation shards (folders, '
                      'comma-separated)')
  parser.add_argument('--eval_fraction', type=float, default=0.05)
  parser.add_argument('--gamma', type=int, default=8)
  parser.add_argument('--ngram_max', type=int, default=3)
  args = parser.parse_args(argv)
  seqs, prompt_lens = [], []
  for path in args.data.split(','):
    for r in data_lib.held_out_records(path, args.eval_fraction):
      seqs.append(r['prompt_ids'] + r['response_ids'])
      prompt_lens.append(len(r['prompt_ids']))
  rates, counts = calibration.lookup_accept_rates(seqs, prompt_lens, args.gamma, args.ngram_max)
  print(json.dumps({'records': len(seqs), 'lookup_accept': [round(r, 3) for r in rates],
                    'proposals_stopped': counts}))


if __name__ == '__main__':
  main()
