"""DFlash drafter folders (z-lab/*-DFlash) to our checkpoint format and back:

  python scripts/dflash.py import HF_FOLDER OUT --target TARGET   # -> an Orbax drafter
  python scripts/dflash.py export DRAFTER HF_FOLDER [--target TARGET]   # default: the recorded one
"""
from __future__ import annotations

import argparse
import json

from d2sd_jax import cli
from d2sd_jax.formats import dflash_format
from d2sd_jax.formats import drafters as drafter_formats
from d2sd_jax.formats import loaders


def main():
  parser = argparse.ArgumentParser(
      description='Convert DFlash drafter folders (config.json with dflash_config + safetensors, '
      'e.g. z-lab/Qwen3-8B-DFlash-b16) to our drafter checkpoints, and back.')
  sub = parser.add_subparsers(dest='command', required=True)
  imp = sub.add_parser('import', help='a DFlash folder -> our drafter checkpoint (Orbax)')
  imp.add_argument('folder', help='the DFlash folder (config.json + *.safetensors)')
  imp.add_argument('out', help='the drafter checkpoint folder to write')
  exp = sub.add_parser('export', help='our drafter -> a DFlash folder')
  exp.add_argument('drafter', help='a train.py workdir or an exported drafter folder')
  exp.add_argument('out', help='the DFlash folder to write')
  exp.add_argument('--mask-token-id', type=int, default=None,
                   help='use the target\'s embedding of this token as the mask embedding '
                   '(default: the token it already is)')
  exp.add_argument('--full-head', action='store_true',
                   help='export a head_vocab drafter with the whole vocabulary head')
  imp.add_argument('--target', required=True, help='the target the drafter is for: smollm2, a '
                   '.gguf file or a Hugging Face folder')
  exp.add_argument('--target', default=None, help='the target the drafter is for: smollm2, a '
                   '.gguf file or a Hugging Face folder (default: the one it records)')
  for p in (imp, exp):
    p.add_argument('--dtype', default=None, choices=['float32', 'bfloat16'],
                   help='tensor dtype written (default: as stored)')
  args = parser.parse_args()
  if args.command == 'import':
    target = loaders.load_target(args.target)
    dcfg = dflash_format.import_drafter(args.folder, args.out, target, args.target, args.dtype)
    print(json.dumps({'imported': args.out, 'gamma': dcfg.gamma,
                      'feature_layers': list(dcfg.feature_layers)}))
  else:
    source, target = drafter_formats.recorded_target(args.drafter, args.target)
    info = dflash_format.export_drafter(args.drafter, args.out, target, args.mask_token_id,
                                        args.full_head, args.dtype, source)
    print(json.dumps({'exported': args.out, **info}))


if __name__ == '__main__':
  cli.run_script(main)  # user errors: one line on stderr, exit status 2 (as decode.py)
