"""Per-chip memory of a training run on a mesh (d2sd_jax/train/memory.py: the arithmetic):

  python scripts/memory.py --config configs/drafter1.py --target qwen3-8b --mesh 4x8 \\
      --config.dtype=bfloat16 --config.train.batch_size=256 ...   (the same flags as train.py)
"""
from __future__ import annotations

import sys

from d2sd_jax.train import memory


def main(argv):
  from absl import flags  # pylint: disable=import-outside-toplevel
  del argv
  config = flags.FLAGS.config
  config.target = flags.FLAGS.target  # (the drafter follows this target: width, feature layers)
  data, model = (int(x) for x in flags.FLAGS.mesh.split('x'))
  tcfg = memory.target_config(flags.FLAGS.target, config.get('dtype', 'float32'))
  parts = memory.training_memory(config, tcfg, data, model)
  print(f'train.py on a {data}x{model} (data x model) mesh, target {flags.FLAGS.target} '
        f'({config.get("dtype", "float32")}), {config.train.batch_size} sequences of '
        f'{config.data.seq_len} tokens per step, grad_accum {config.train.get("grad_accum", 1)}, '
        f'remat {config.train.get("remat", False)}:')
  print(memory.report(parts))


if __name__ == '__main__':
  from absl import app, flags  # pylint: disable=ungrouped-imports
  from ml_collections import config_flags
  config_flags.DEFINE_config_file('config', None, 'training config file', lock_config=True)
  flags.DEFINE_string('target', 'qwen3-8b', 'a costmodel.TARGETS name or a Hugging Face folder')
  flags.DEFINE_string('mesh', '1x1', 'DATAxMODEL mesh shape, e.g. 4x8')
  sys.exit(app.run(main))
