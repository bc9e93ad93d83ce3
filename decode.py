"""Generate text with a target LM: python decode.py --config configs/smollm2.py [--config.x=y].

Library logging (Orbax's and absl's INFO lines) stays out of the terminal unless asked for
with --verbosity=0 (or higher)."""
from absl import flags
from absl import logging
from ml_collections import config_flags

from d2sd_jax import cli
from d2sd_jax import config_check
from d2sd_jax.decode import generate as generate_lib
from d2sd_jax.decode import options as options_lib

_CONFIG = config_flags.DEFINE_config_file('config', None, 'decode config file', lock_config=True)


def main(argv):
  del argv
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
  generate_lib.run(_CONFIG.value)


if __name__ == '__main__':
  # user errors: one line on stderr, exit status 2; an unknown field with the one it likely means
  cli.run(main, lambda field: config_check.closest(field, options_lib.DECODE_FIELDS))
