"""Export a trained drafter (bfloat16, no optimizer state), as drafters/ ships them:

  python scripts/export_drafter.py runs/drafter1 drafters/smollm2-drafter1 [--target TARGET]

The target is the one the checkpoint records (train.py's config.target) unless --target names
it (the same model moved elsewhere: its weights are checked against the recorded fingerprint).
"""
from __future__ import annotations

import argparse
import json
import os

from d2sd_jax import cli
from d2sd_jax.formats import checkpoints as ckpt
from d2sd_jax.formats import drafters as drafter_formats


def main():
  parser = argparse.ArgumentParser(description='Export a trained drafter (bfloat16, no '
                                   'optimizer state): what ships in drafters/.')
  parser.add_argument('workdir', help='a train.py workdir (its latest checkpoint is exported)')
  parser.add_argument('out', help='the exported drafter folder')
  parser.add_argument('--target', default=None, help='smollm2, a .gguf file or a Hugging Face '
                      'folder (default: the target the checkpoint records)')
  parser.add_argument('--dtype', default='bfloat16')
  args = parser.parse_args()
  _, target = drafter_formats.recorded_target(args.workdir, args.target)
  dcfg = ckpt.export_drafter(args.workdir, args.out, target, args.dtype)
  size = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(args.out)
             for f in files)
  print(json.dumps({'exported': args.out, 'gamma': dcfg.gamma, 'head_vocab': dcfg.head_vocab,
                    'confidence_temperature': dcfg.confidence_temperature,
                    'megabytes': round(size / 2**20, 2)}))


if __name__ == '__main__':
  cli.run_script(main)  # user errors: one line on stderr, exit status 2 (as decode.py)
