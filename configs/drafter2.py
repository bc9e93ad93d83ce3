"""Train drafter 2 (the variable-prefix drafter) for the SmolLM2 target.

  python train.py --config configs/drafter2.py

The fields are configs/drafter1.py's (d2sd_jax/train/schema.py); these differ.
"""
from d2sd_jax.train import schema


def get_config():
  c = schema.default_config()
  c.kind = 'drafter2'  # prefix length l ~ beta^l, loss over positions l+1.. weighted by tau
  c.workdir = 'runs/drafter2'
  c.init_from = 'drafters/smollm2-drafter1'  # start from drafter 1 ('' = from scratch)
  c.train.steps = 1000  # a fine-tune of drafter 1 for the variable-prefix objective
  c.train.lr = 5e-4
  c.train.warmup = 100
  return c
