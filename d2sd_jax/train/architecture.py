"""A drafter's architecture for train.py: the `drafter.*` fields the config sets, else the
drafter `init_from` starts from, else what follows from the target.

Every `drafter.*` field of configs/drafter1.py is None unless set (`--config.drafter.X=...`):

  init_from given   the whole architecture is the source drafter's (a train.py workdir, an
                    exported drafter or a DFlash folder); drafter 2 starts from drafter 1 and so
                    repeats no flag. A field set to another value than the source's is an error
                    naming both.
  from scratch      width, heads, head dim, FFN width, RoPE base, norm eps and q/k norms are the
                    target's (a drafter as wide as its target needs no in/out projections, and
                    a Qwen3 target's drafter has q/k norms, so it exports to DFlash format);
                    feature layers are spread over the target's depth as DFlash chooses them
                    (`dflash_format.default_layer_ids`, one per drafter layer), except for the
                    named target 'smollm2', whose shipped drafters read (1, 10, 20, 29); gamma,
                    n_layers and head_vocab take SCRATCH (head_vocab 0 for a vocabulary of at
                    most 2 x 8192 tokens: a subset would save little).

`drafter.mask_token_id` is not architecture but input: None, a learned mask vector (or, with
init_from, the starting drafter's mask token); N, the target's embedding of token N, kept frozen
in training, as DFlash drafters have it, so that the drafter exports to DFlash format unchanged.
"""
from __future__ import annotations

import dataclasses

from d2sd_jax.formats import dflash_format
from d2sd_jax.models import drafter as drafter_lib
from d2sd_jax.models import target as model_lib

# The DrafterConfig fields train.py sets (`drafter.*`): the drafter's architecture.
FIELDS = ('gamma', 'n_layers', 'd_model', 'n_heads', 'n_kv_heads', 'head_dim', 'd_ff',
          'feature_layers', 'rope_base', 'norm_eps', 'qk_norm', 'head_vocab')
# The fields a new drafter copies from the target (ModelConfig's of the same names).
FROM_TARGET = ('d_model', 'n_heads', 'n_kv_heads', 'head_dim', 'd_ff', 'rope_base', 'norm_eps',
               'qk_norm')
# From scratch, the fields the target does not decide (gamma 8 suits CPU verification; 16 is
# DFlash's and the paper's block on GPU/TPU).
SCRATCH = {'gamma': 8, 'n_layers': 2, 'head_vocab': 8192}
# Named targets whose shipped drafters read other layers than DFlash's choice.
NAMED_FEATURE_LAYERS = {'smollm2': (1, 10, 20, 29)}


def feature_layers_for(tcfg: model_lib.ModelConfig, n_layers: int,
                       target_name: str = '') -> tuple[int, ...]:
  """The target hidden states a new drafter of `n_layers` layers reads (HF numbering, as
  DrafterConfig.feature_layers): DFlash's target_layer_ids, offset to our numbering."""
  if target_name in NAMED_FEATURE_LAYERS:
    return NAMED_FEATURE_LAYERS[target_name]
  return tuple(i + dflash_format.OFFSET for i in
               dflash_format.default_layer_ids(tcfg.n_layers, n_layers))


def _normal(name: str, value):
  if value is None:
    return None
  if name == 'feature_layers':
    return tuple(int(i) for i in value)
  if name in ('rope_base', 'norm_eps'):
    return float(value)
  return bool(value) if name == 'qk_norm' else int(value)


def given(drafter_group) -> dict:
  """The `drafter.*` fields a config sets (not None), normalised."""
  return {k: _normal(k, drafter_group.get(k)) for k in FIELDS
          if drafter_group.get(k) is not None}


def resolve(drafter_group, tcfg: model_lib.ModelConfig | None, target_name: str = '',
            source: drafter_lib.DrafterConfig | None = None,
            source_path: str = '') -> drafter_lib.DrafterConfig:
  """The DrafterConfig train.py builds: see the module docstring. `source`: the config of the
  drafter init_from names (at `source_path`). Without a target config (tcfg None) every field
  must be set or inherited."""
  fields = given(drafter_group)
  set_head_vocab = 'head_vocab' in fields
  if source is not None:
    clash = [f'drafter.{k}={v!r} but init_from={source_path!r} has {getattr(source, k)!r}'
             for k, v in fields.items() if _normal(k, getattr(source, k)) != v]
    if clash:
      raise ValueError(f'{"; ".join(clash)}: init_from sets the whole drafter architecture, so '
                       'drop those drafter.* flags (or drop init_from to train another shape)')
    # (a new run fits its own confidence temperature; training keeps float32 weights)
    return dataclasses.replace(source, confidence_temperature=1.0, dtype='float32')
  for name, default in SCRATCH.items():
    fields.setdefault(name, default)
  missing = [k for k in FIELDS if k not in fields]
  if missing and tcfg is None:
    raise ValueError(f'drafter.{", drafter.".join(missing)} unset and no target to follow')
  for name in (n for n in FROM_TARGET if n in missing):
    value = getattr(tcfg, name)  # (floats to 6 digits: a GGUF stores 1e-5 as 9.9999997e-6)
    fields[name] = float(f'{value:.6g}') if isinstance(value, float) else value
  if 'feature_layers' in missing:
    fields['feature_layers'] = feature_layers_for(tcfg, fields['n_layers'], target_name)
  if not set_head_vocab and tcfg is not None and tcfg.vocab_size <= 2 * SCRATCH['head_vocab']:
    fields['head_vocab'] = 0
  return drafter_lib.DrafterConfig(**fields)


def describe(dcfg: drafter_lib.DrafterConfig) -> str:
  """One line of the architecture (printed at the start of a run)."""
  return ', '.join(f'{k}={getattr(dcfg, k)}' for k in FIELDS)


def changed(saved: dict, dcfg: drafter_lib.DrafterConfig) -> list[str]:
  """'field: old -> new' for each architecture field where a workdir's checkpoint metadata
  (`saved`, its 'drafter' dict) differs from this run's config."""
  return [f'{k}: {saved[k]!r} -> {getattr(dcfg, k)!r}' for k in FIELDS
          if k in saved and _normal(k, saved[k]) != _normal(k, getattr(dcfg, k))]


def mask_token(drafter_group, vocab_size: int, source_token: int | None = None,
               source_path: str = '') -> int | None:
  """The token whose target embedding is the drafter's mask embedding (None: a learned
  vector): drafter.mask_token_id if set, else init_from's (`source_token`)."""
  given = drafter_group.get('mask_token_id')
  if given is None:
    return source_token
  given = int(given)
  if source_path and given != source_token:
    has = ('a learned mask vector' if source_token is None else
           f'mask_token_id {source_token}')
    raise ValueError(f'drafter.mask_token_id={given} but init_from={source_path!r} has {has}: '
                     'drop the flag (init_from sets the mask too)')
  if not 0 <= given < vocab_size:
    raise ValueError(f'drafter.mask_token_id={given} is not a token of the target '
                     f'(0..{vocab_size - 1})')
  return given
