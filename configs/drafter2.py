"""Train drafter 2 (the variable-prefix drafter) for the SmolLM2 target.

  python train.py --config configs/drafter2.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import drafter1  # pylint: disable=wrong-import-position


def get_config():
  c = drafter1.get_config()
  c.kind = 'drafter2'  # prefix length l ~ beta^l, loss over positions l+1.. weighted by tau
  c.workdir = 'runs/drafter2'
  c.init_from = 'drafters/smollm2-drafter1'  # start from drafter 1 ('' = from scratch)
  c.train.steps = 1000  # a fine-tune of drafter 1 for the variable-prefix objective
  c.train.lr = 5e-4
  c.train.warmup = 100
  return c
