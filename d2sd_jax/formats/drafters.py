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


def mask_token_id(path: str) -> int | None:
  """The token whose target embedding is the mask embedding of the drafter at `path`: a DFlash
  folder's dflash_config.mask_token_id, or what a drafter converted or trained from one
  records (metadata 'dflash'); None for a drafter with a learned mask vector."""
  path = os.path.abspath(checkpoints.resolve_path(path))
  if dflash_format.is_dflash_folder(path):
    config = dflash_format.read_config(path)
    token = config['dflash_config'].get('mask_token_id', config.get('mask_token_id'))
  else:
    token = (checkpoints.read_drafter_config(path)[1].get('dflash') or {}).get('mask_token_id')
  return None if token is None else int(token)


def target_mismatch(path: str, target: loaders.Target) -> str | None:
  """Why the drafter at `path` is not for `target` (its load would be refused), from its
  metadata or config alone; None when it is."""
  path = os.path.abspath(checkpoints.resolve_path(path))
  try:
    if dflash_format.is_dflash_folder(path):
      config = dflash_format.read_config(path)
      dflash_format.check_target(config, dflash_format.drafter_config(config, path), path,
                                 target)
    else:
      meta = checkpoints.read_drafter_config(path)[1]
      checkpoints.check_metadata(meta, target, path)
  except ValueError as e:
    return str(e)
  return None


def is_shipped(path: str) -> bool:
  """A drafter of the repository's drafters/ folder (the decode config's defaults)."""
  shipped = os.path.join(checkpoints.REPO_ROOT, 'drafters') + os.sep
  return os.path.abspath(checkpoints.resolve_path(path)).startswith(shipped)


def recorded_target(path: str, given: str | None = None) -> tuple[str, loaders.Target]:
  """(source, Target) of the target a drafter folder was made for: `given` (smollm2, a .gguf
  file or a Hugging Face folder), else the one its metadata records (train.py records its
  config.target). Refuses a given target the drafter was not made for, naming the fix."""
  path = os.path.abspath(checkpoints.resolve_path(path))
  if dflash_format.is_dflash_folder(path):
    recorded = dflash_format.target_name(dflash_format.read_config(path), path)
    recorded = None if recorded == 'unknown' else recorded
  else:
    recorded = checkpoints.read_drafter_config(path)[1].get('target')
  source = given or recorded
  if not source:
    raise ValueError(f'{path} records no target: pass --target (smollm2, a .gguf file or a '
                     'Hugging Face folder)')
  try:
    target = loaders.load_target(source)
  except OSError as e:
    raise FileNotFoundError(f'{e}; {path} was made for target {recorded!r}: pass --target with '
                            'where that model is now') from e
  why = target_mismatch(path, target)
  if why:
    raise ValueError(f'{why} (--target {source}): leave --target out to use the recorded '
                     f'{recorded!r}, or pass --target with where that model is now' if given
                     else why)
  return source, target
