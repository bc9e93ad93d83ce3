"""Configs from their schemas, and the start-up checks of their fields.

Each command's config has one schema: dataclasses whose fields carry the name, the default and
(in a comment) the meaning of every field (train.py: `train.schema.TrainConfig`; decode.py:
`decode.options.Options`, `decode.options.Run` and SpecSettings' knobs). `as_config` turns a
schema into the ConfigDict a config file returns, and `schema_fields` into the field list
`check_fields` refuses unknown fields by: a config file written by hand (or copied from an older
version) can carry a misspelt field that would otherwise be ignored silently.
"""
from __future__ import annotations

import dataclasses
import difflib
import typing

import ml_collections
from ml_collections.config_dict import placeholder

from d2sd_jax.spec_decode import speculative


@dataclasses.dataclass(frozen=True)
class Mesh:
  """The device mesh (train.py and decode.py): `models.sharding.make_mesh`."""
  data: int = -1  # data-parallel axis (-1: all devices not used by model)
  model: int = 1  # tensor-parallel axis: weights split by sharding.RULES (-1: all not in data)


def _field_type(hint):
  """The type a None-default field holds (`int | None` -> int, `tuple[int, ...] | None` ->
  tuple): what its placeholder accepts from a flag."""
  args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
  return typing.get_origin(args[0]) or args[0]


def as_config(schema) -> ml_collections.ConfigDict:
  """A schema dataclass instance as a ConfigDict: one entry a field, a nested dataclass as a
  group; a None field as a placeholder of its type, so that a flag can still set it."""
  hints = typing.get_type_hints(type(schema))
  out = ml_collections.ConfigDict()
  for f in dataclasses.fields(schema):
    value = getattr(schema, f.name)
    if dataclasses.is_dataclass(value):
      out[f.name] = as_config(value)
    elif value is None:
      out[f.name] = placeholder(_field_type(hints[f.name]))
    else:
      out[f.name] = value
  return out


def schema_fields(schema_cls) -> dict:
  """{field: None, group: {its fields}} of a schema dataclass (what check_fields takes)."""
  hints = typing.get_type_hints(schema_cls)
  return {f.name: ({g.name for g in dataclasses.fields(hints[f.name])}
                   if isinstance(hints[f.name], type) and dataclasses.is_dataclass(hints[f.name])
                   else None)
          for f in dataclasses.fields(schema_cls)}

# SpecSettings fields that are not knobs: the generation settings, the method and the drafters'
# configs come from elsewhere. Every other field is a knob: one line of the decode config's `spec`
# group, one keyword of Decoder.generate; nothing else needs to know it.
NOT_KNOBS = ('generation', 'method', 'drafter1', 'drafter2')
SPEC_KNOBS = tuple(f.name for f in dataclasses.fields(speculative.SpecSettings)
                   if f.name not in NOT_KNOBS)

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
