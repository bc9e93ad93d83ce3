"""Drafter training-step cost on this machine: what the CPU levers buy, measured in one run.

  python benchmarks/train_step.py [--batch 4]

Times one jitted step of drafter-1 training (SmolLM2 target, 2-layer drafter of width 576,
320-token windows) for: the recipe in configs/drafter1.py (precomputed features, an 8,192-token
head, gamma 8 x 48 anchors), the same with the full 49,152-token head, and the same with the
target's features computed inside the step. Prints one JSON line per variant (seconds per step,
drafted label positions per second) and the ratios to the recipe.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'configs'))
import drafter1 as drafter1_config  # pylint: disable=wrong-import-position

from d2sd_jax.models import drafter as drafter_lib  # pylint: disable=wrong-import-position
from d2sd_jax.formats import loaders  # pylint: disable=wrong-import-position
from d2sd_jax.train import training  # pylint: disable=wrong-import-position


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--batch', type=int, default=4)
  parser.add_argument('--repeats', type=int, default=3)
  args = parser.parse_args()
  target = loaders.load_target('smollm2', 'float32')
  base = drafter1_config.get_config()
  B, L = args.batch, base.data.seq_len
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, target.cfg.vocab_size, (B, L)).astype(np.int32)
  labels = np.ones((B, L), bool)
  variants = {'recipe': dict(), 'full_head': dict(head_vocab=0),
              'in_step_features': dict(precompute=False)}
  results = {}
  for name, v in variants.items():
    config = drafter1_config.get_config()
    config.drafter.head_vocab = v.get('head_vocab', config.drafter.head_vocab)
    dcfg = training.drafter_config(config, target.cfg)
    dparams = drafter_lib.init_params(dcfg, target.cfg, jax.random.PRNGKey(0))
    opt = training.optimizer(config)
    step, _ = training.make_train_step(config, target.cfg, dcfg, opt)
    opt_state = opt.init(drafter_lib.split_fixed(dparams)[0])
    feats = None
    if v.get('precompute', True):
      feats = rng.standard_normal((B, L, len(dcfg.feature_layers) * target.cfg.d_model)).astype(
          np.float16)
    dparams, opt_state, m = step(dparams, opt_state, target.params, tokens, labels,
                                 jax.random.PRNGKey(0), feats)  # compile
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for i in range(args.repeats):
      dparams, opt_state, m = step(dparams, opt_state, target.params, tokens, labels,
                                   jax.random.PRNGKey(i + 1), feats)
      jax.block_until_ready(m)
    seconds = (time.perf_counter() - t0) / args.repeats
    positions = B * config.train.anchors_per_seq * (dcfg.gamma - 1)
    results[name] = seconds
    print(json.dumps({'variant': name, 'seconds_per_step': round(seconds, 3),
                      'label_positions_per_s': round(positions / seconds)}), flush=True)
  print(json.dumps({'summary': 'train_step', 'batch': B,
                    **{f'{k}_vs_recipe': round(t / results['recipe'], 2)
                       for k, t in results.items() if k != 'recipe'}}))


if __name__ == '__main__':
  main()
