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
