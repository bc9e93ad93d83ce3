"""The distillation shards as a TFDS dataset (array_record; no TensorFlow needed):

  python scripts/prepare_tfds.py --shards data/distill --data_dir data/tfds
"""
from __future__ import annotations

import argparse
import time

from d2sd_jax.train import tfds_data


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--shards', default='data/distill', help='folder of shard-*.jsonl.gz')
  parser.add_argument('--data_dir', default='data/tfds', help='TFDS data_dir to prepare into')
  args = parser.parse_args()
  t0 = time.time()
  path = tfds_data.prepare(args.shards, args.data_dir)
  n = len(tfds_data.data_source(args.data_dir))
  print(f'{path}: {n} examples (array_record) in {time.time() - t0:.1f}s', flush=True)


if __name__ == '__main__':
  main()
