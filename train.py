"""Train a drafter: python train.py --config configs/drafter1.py [--config.x=y]."""
from absl import logging
from ml_collections import config_flags

from d2sd_jax import cli
from d2sd_jax import config_check
from d2sd_jax.train import schema
from d2sd_jax.train import training

_CONFIG = config_flags.DEFINE_config_file('config', None, 'training config file', lock_config=True)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO
  training.run(_CONFIG.value)


if __name__ == '__main__':
  # user errors: one line on stderr, exit status 2; an unknown field with the one it likely means
  cli.run(main, lambda field: config_check.closest(field, schema.FIELDS))
