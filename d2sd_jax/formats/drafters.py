"""Any drafter folder, in either format: ours (Orbax, `checkpoints`) or DFlash's (a Hugging Face
folder, `dflash_format`)."""
from __future__ import annotations

import os

from d2sd_jax.formats import checkpoints
from d2sd_jax.formats import dflash_format
from d2sd_jax.formats import loaders


def load_drafter(path: str, target: loaders.Target, dtype: str = 'float32', mesh=None):
  """(DrafterConfig, params, metadata) of the drafter at `path`: a train.py workdir, an exported
  drafter or a DFlash folder (`checkpoints.load_checkpoint`, `dflash_format.load_folder`: the
  parameters in `dtype`, on `mesh`'s shardings when given). Refuses a drafter made for another
  target."""
  path = os.path.abspath(checkpoints.resolve_path(path))
  if dflash_format.is_dflash_folder(path):
    return dflash_format.load_folder(path, target, dtype, mesh)
  return checkpoints.load_checkpoint(path, target, dtype, mesh)


def drafter_config(path: str):
  """The DrafterConfig of the drafter folder at `path` (either format), from its metadata and
  config alone: no weights are read and no target is checked."""
  path = os.path.abspath(checkpoints.resolve_path(path))
  if dflash_format.is_dflash_folder(path):
    return dflash_format.drafter_config(dflash_format.read_config(path), path)
  return checkpoints.read_drafter_config(path)[0]
