"""Train drafter 1 (block diffusion) for the SmolLM2 target, or any other (`target`).

  python train.py --config configs/drafter1.py [--config.train.steps=2000]

Every field, its default and its meaning: d2sd_jax/train/schema.py (TrainConfig). This file
takes them all as they are; set any with --config.GROUP.FIELD=VALUE, or copy this file.
"""
from d2sd_jax.train import schema


def get_config():
  return schema.default_config()
