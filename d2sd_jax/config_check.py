"""Start-up checks of ml_collections configs: unknown fields are named, with the closest known.

A config file written by hand (or copied from an older version) can carry a misspelt field
that would otherwise be ignored silently; `check_fields` refuses it before anything loads.
"""
from __future__ import annotations

import dataclasses
import difflib

from d2sd_jax.spec_decode import speculative

# SpecSettings fields that are not knobs: the generation settings, the method and the drafters'
# configs come from elsewhere. Every other field is a knob: one line of the decode config's `spec`
# group, one keyword of Decoder.generate; nothing else needs to know it.
NOT_KNOBS = ('generation', 'method', 'drafter1', 'drafter2')
SPEC_KNOBS = tuple(f.name for f in dataclasses.fields(speculative.SpecSettings)
                   if f.name not in NOT_KNOBS)

# The fields train.py reads (configs/drafter1.py, configs/drafter2.py).
TRAIN_FIELDS = {
    'kind': None, 'target': None, 'dtype': None, 'workdir': None, 'init_from': None,
    'drafter': {'gamma', 'n_layers', 'd_model', 'n_heads', 'n_kv_heads', 'head_dim', 'd_ff',
                'feature_layers', 'rope_base', 'norm_eps', 'qk_norm', 'head_vocab',
                'mask_token_id'},
    'data': {'source', 'path', 'tfds_dir', 'tfds_name', 'tfds_split', 'text_field', 'prefetch',
             'seq_len', 'eval_fraction', 'holdout', 'features_dir', 'corpus_path', 'corpus_windows'},
    'train': {'batch_size', 'anchors_per_seq', 'steps', 'lr', 'warmup', 'weight_decay', 'clip',
              'seed', 'precompute_features', 'compute_dtype', 'grad_accum', 'remat',
              'distinct_anchors'},
    'loss': {'decay', 'beta', 'tau', 'reveal', 'soft', 'soft_k', 'prefix_prior', 'block_norm',
             'cuts_from'},
    'mesh': {'data', 'model'}, 'distributed': None,
    'log_every': None, 'eval_every': None, 'save_every': None, 'keep': None,
    'progress_bar': None,
}

# The fields decode.py reads besides decode/options.py's Options (which holds the request's
# fields, and makes decode.py's whole list: options.DECODE_FIELDS).
RUN_FIELDS = {
    'target': None, 'dtype': None, 'drafter1': None, 'drafter2': None, 'prompt': None,
    'prompts_file': None, 'output': None, 'mesh': {'data', 'model'}, 'distributed': None,
}


def check_fields(config, schema: dict, what: str) -> None:
  """Raises ValueError naming every field of `config` that `schema` does not know."""
  unknown = []
  for key in config.keys():
    if key not in schema:
      unknown.append((key, list(schema)))
    elif isinstance(schema[key], set):
      sub = config[key]
      if not hasattr(sub, 'keys'):
        raise ValueError(f'{key} must be a group of fields ({", ".join(sorted(schema[key]))}), '
                         f'not {sub!r}')
      unknown += [(f'{key}.{k}', [f'{key}.{s}' for s in schema[key]])
                  for k in sub.keys() if k not in schema[key]]
  if unknown:
    lines = []
    for name, known in unknown:
      close = difflib.get_close_matches(name, known, n=1)
      lines.append(f'{name}' + (f' (did you mean {close[0]}?)' if close else ''))
    raise ValueError(f'unknown {what} config field(s): {"; ".join(lines)}. Remove or rename '
                     'them; the documented fields are in configs/')


def closest(name: str, schema: dict) -> str | None:
  """The known field a wrong dotted `name` most likely means: the same name in another group
  (`gamma` -> `spec.gamma`), else the closest spelling; None when nothing is close."""
  known = [k for k, v in schema.items() if not isinstance(v, set)] + [
      f'{k}.{s}' for k, v in schema.items() if isinstance(v, set) for s in sorted(v)]
  leaf = name.split('.')[-1]
  same = [k for k in known if k.split('.')[-1] == leaf and k != name]
  if same:
    return same[0]
  close = difflib.get_close_matches(name, known, n=1)
  return close[0] if close else None
