"""DFlash drafter folders (z-lab's `*-DFlash` releases, the `dflash` package) as our drafter 1.

A DFlash folder is a Hugging Face folder: config.json (a Qwen3 config plus `block_size` and
`dflash_config.{mask_token_id, target_layer_ids}`) and safetensors (one file or a sharded index)
holding `layers.{i}.*` (Qwen3 decoder layers), `fc`, `hidden_norm` and `norm`. Its drafter is
drafter.py's architecture (the reference is `dflash/model.py`); the correspondences:

  DFlash                                   ours
  block_size                               gamma
  target_layer_ids[j]                      feature_layers[j] = target_layer_ids[j] + 1. DFlash
                                           reads HF hidden_states[id + 1] (hidden_states[0] is
                                           the embedding output); ours are numbered like
                                           hidden_states themselves
  q_norm / k_norm in every layer           qk_norm=True (model.qkv_projection; context keys too)
  fc, hidden_norm, norm                    fc, fc_norm, final_norm
  the target's embedding of mask_token_id  mask_embed (ours is a free vector: an export needs a
                                           token whose target embedding it is)
  the target's whole LM head               head_vocab=0
  rope_theta; rms_norm_eps of every norm   rope_base; norm_eps
  output_multiplier (scales the logits)    folded into final_norm (the head is linear)

What DFlash can hold that we cannot run is refused by name: DFlash-2 models (convolutions, a
candidate selector), logit soft-capping, an input embedding scale, causal or sliding-window
drafter layers, attention biases, RoPE scaling, and a layer id of n_target - 1 (HF's last hidden
state comes after the final norm, our features do not). An export refuses what DFlash cannot
hold: no q/k norms, a width other than the target's, a head_vocab subset (unless asked), a mask
embedding that is no token's target embedding (unless a token is named).

A DFlash folder records no fingerprint of its target: what it says (vocab_size, hidden_size,
num_target_layers, the folder name) is checked against the target instead. Folders we export
also carry our fingerprint (`d2sd_target`), checked like a checkpoint's.

  python scripts/dflash.py import HF_FOLDER OUT --target TARGET   # -> Orbax drafter
  python scripts/dflash.py export DRAFTER HF_FOLDER --target TARGET
`drafters.load_drafter` (decode.py, notebooks) also reads a DFlash folder directly.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

from d2sd_jax.formats import checkpoints as ckpt
from d2sd_jax.models import drafter as drafter_lib
from d2sd_jax.formats import loaders
from d2sd_jax.models import target as model_lib
from d2sd_jax.models import sharding

CONFIG_FILE = 'config.json'
WEIGHTS_FILE = 'model.safetensors'
OFFSET = 1  # our feature layer = DFlash target layer id + OFFSET
# A DFlash layer's tensors: short name -> name inside `layers.{i}.` (HF's Qwen3 layer; our
# layer packs q/k/v into wqkv and gate/up into w_gate_up: see `_layer_from_hf`).
LAYER_NAMES = {
    'input_layernorm': 'input_layernorm.weight',
    'post_attention_layernorm': 'post_attention_layernorm.weight',
    'q_proj': 'self_attn.q_proj.weight', 'k_proj': 'self_attn.k_proj.weight',
    'v_proj': 'self_attn.v_proj.weight', 'o_proj': 'self_attn.o_proj.weight',
    'q_norm': 'self_attn.q_norm.weight', 'k_norm': 'self_attn.k_norm.weight',
    'gate_proj': 'mlp.gate_proj.weight', 'up_proj': 'mlp.up_proj.weight',
    'down_proj': 'mlp.down_proj.weight',
}
TOP_NAMES = {'fc': 'fc.weight', 'fc_norm': 'hidden_norm.weight', 'final_norm': 'norm.weight'}
REQUIRED = ('hidden_size', 'num_hidden_layers', 'num_attention_heads', 'num_key_value_heads',
            'head_dim', 'intermediate_size', 'vocab_size')


def is_dflash_folder(path: str) -> bool:
  """A Hugging Face folder (config.json) rather than an Orbax checkpoint: ours never hold one."""
  return os.path.isfile(os.path.join(path, CONFIG_FILE))


def read_config(path: str) -> dict:
  file = os.path.join(path, CONFIG_FILE)
  try:
    with open(file) as f:
      config = json.load(f)
  except FileNotFoundError as e:
    raise FileNotFoundError(f'{file} not found: a DFlash drafter folder holds config.json and '
                            'model.safetensors') from e
  except json.JSONDecodeError as e:
    raise ValueError(f'{file} is not valid JSON ({e}): download the folder again') from e
  if not isinstance(config.get('dflash_config'), dict):
    raise ValueError(f'{file} has no dflash_config: {path} is not a DFlash drafter (a Hugging '
                     'Face model folder is a target: pass it as the target, not as a drafter)')
  missing = [k for k in REQUIRED if k not in config]
  if missing:
    raise ValueError(f'{file} lacks {", ".join(missing)}: not a complete DFlash config')
  return config


def _value(config: dict, name: str, default=None):
  """DFlash's own lookup: dflash_config first, then the top level."""
  return config['dflash_config'].get(name, config.get(name, default))


def default_layer_ids(n_target_layers: int, n_draft_layers: int) -> list[int]:
  """DFlash's choice when a config names no target_layer_ids: evenly from 1 to n - 3."""
  if n_draft_layers == 1:
    return [n_target_layers // 2]
  span = n_target_layers - 4
  return [round(1 + i * span / (n_draft_layers - 1)) for i in range(n_draft_layers)]


def _refuse_unsupported(config: dict, where: str) -> None:
  dflash = config['dflash_config']
  if 'DFlash2DraftModel' in (config.get('architectures') or []) or any(
      k in dflash for k in ('conv_kernel_size', 'selector_rank')):
    raise ValueError(f'{where} is a DFlash-2 drafter (convolutions, candidate selector): only '
                     'DFlash (DFlashDraftModel) drafters convert')
  softcap = _value(config, 'final_logit_softcapping')
  problems = {
      'final_logit_softcapping': softcap is not None and float(softcap) > 0,
      'input_embedding_scale': float(_value(config, 'input_embedding_scale', 1.0)) != 1.0,
      'is_causal': bool(config.get('is_causal')),
      'layer_types (sliding-window layers)': any(
          t != 'full_attention' for t in config.get('layer_types') or []) or (
              not config.get('layer_types') and bool(config.get('use_sliding_window'))),
      'attention_bias': bool(config.get('attention_bias')),
      'hidden_act': config.get('hidden_act', 'silu') != 'silu',
  }
  rope = {**(config.get('rope_scaling') or {}), **(config.get('rope_parameters') or {})}
  problems['rope scaling'] = rope.get('rope_type', rope.get('type', 'default')) != 'default'
  problems['partial_rotary_factor'] = float(rope.get('partial_rotary_factor', 1.0)) != 1.0
  bad = [k for k, v in problems.items() if v]
  if bad:
    raise ValueError(f'{where} uses {", ".join(bad)}, which our drafter does not implement: it '
                     'cannot be converted')


def drafter_config(config: dict, where: str = 'the DFlash config') -> drafter_lib.DrafterConfig:
  """Our DrafterConfig for a DFlash config.json (read_config's dict)."""
  _refuse_unsupported(config, where)
  n_layers = int(config['num_hidden_layers'])
  ids = _value(config, 'target_layer_ids')
  if ids is None:
    if config.get('num_target_layers') is None:
      raise ValueError(f'{where} names neither dflash_config.target_layer_ids nor '
                       'num_target_layers: the target layers it reads are unknown')
    ids = default_layer_ids(int(config['num_target_layers']), n_layers)
  rope = {**(config.get('rope_scaling') or {}), **(config.get('rope_parameters') or {})}
  return drafter_lib.DrafterConfig(
      gamma=int(_value(config, 'block_size', 16)), n_layers=n_layers,
      d_model=int(config['hidden_size']), n_heads=int(config['num_attention_heads']),
      n_kv_heads=int(config['num_key_value_heads']), head_dim=int(config['head_dim']),
      d_ff=int(config['intermediate_size']),
      feature_layers=tuple(int(i) + OFFSET for i in ids),
      rope_base=float(config.get('rope_theta', rope.get('rope_theta', 10000.0))),
      norm_eps=float(config.get('rms_norm_eps', 1e-6)),
      confidence_temperature=float(_value(config, 'd2sd_confidence_temperature', 1.0)),
      head_vocab=0, qk_norm=True)


def target_name(config: dict, path: str) -> str:
  """What a folder says its target is: ours records it; z-lab names folders TARGET-DFlash-*."""
  recorded = (config.get('d2sd_target') or {}).get('name')
  if recorded:
    return recorded
  match = re.match(r'(.+?)-DFlash', os.path.basename(os.path.normpath(path)))
  return match.group(1) if match else 'unknown'


def check_target(config: dict, dcfg: drafter_lib.DrafterConfig, path: str, target) -> None:
  """Refuses a target the folder was not made for, naming the mismatch and the fix."""
  tcfg = target.cfg
  name = target_name(config, path)
  fix = (f'load it with the target it was trained for ({name})' if name != 'unknown' else
         'load it with the target it was trained for') + ', or use a drafter made for this target'
  said = {'vocab_size': (int(config['vocab_size']), tcfg.vocab_size),
          'hidden_size': (int(config['hidden_size']), tcfg.d_model)}
  if config.get('num_target_layers') is not None:
    said['num_target_layers'] = (int(config['num_target_layers']), tcfg.n_layers)
  bad = [f'{k}={ours} but the target has {theirs}' for k, (ours, theirs) in said.items()
         if ours != theirs]
  if bad:
    raise ValueError(f'DFlash drafter {path} does not fit target {target.source}: its config '
                     f'says {"; ".join(bad)}: {fix}')
  recorded = (config.get('d2sd_target') or {}).get('fingerprint')
  if recorded and recorded != ckpt.target_fingerprint(target):
    raise ValueError(f'DFlash drafter {path} was exported for target {name!r} (fingerprint '
                     f'{recorded}), not for {target.source} (fingerprint '
                     f'{ckpt.target_fingerprint(target)}): {fix}')
  mask = _value(config, 'mask_token_id')
  if mask is None or not 0 <= int(mask) < tcfg.vocab_size:
    raise ValueError(f'DFlash drafter {path}: dflash_config.mask_token_id={mask} is not a token '
                     f'of the target (0..{tcfg.vocab_size - 1}): the folder is incomplete')
  ids = [i - OFFSET for i in dcfg.feature_layers]
  bad_ids = [i for i in ids if not -1 <= i <= tcfg.n_layers - 2]
  if bad_ids:
    raise ValueError(
        f'DFlash drafter {path}: target_layer_ids {bad_ids} are outside -1..'
        f'{tcfg.n_layers - 2} for a {tcfg.n_layers}-layer target (id n-1 would read the '
        'final-norm output, which our target features do not provide)')


# ----------------------------------------------------------------------------------------------
# Tensors


def _layer_from_hf(w: dict, lcfg: model_lib.ModelConfig) -> dict:
  """Hugging Face layer tensors (LAYER_NAMES keys, [out, in]) -> our layer dict (models/target.py)."""
  Hkv, Hg, hd, D = lcfg.n_kv_heads, lcfg.group, lcfg.head_dim, lcfg.d_model
  return {
      'attn_norm': w['input_layernorm'], 'mlp_norm': w['post_attention_layernorm'],
      # KV head j serves query heads j*Hg .. j*Hg+Hg-1 (HF's repeat_kv): group them per KV head.
      'wqkv': np.concatenate([w['q_proj'].reshape(Hkv, Hg, hd, D),
                              w['k_proj'].reshape(Hkv, 1, hd, D),
                              w['v_proj'].reshape(Hkv, 1, hd, D)], axis=1),
      'wo': w['o_proj'], 'q_norm': w['q_norm'], 'k_norm': w['k_norm'],
      'w_gate_up': np.stack([w['gate_proj'], w['up_proj']]), 'w_down': w['down_proj'],
  }


def _layer_to_hf(lp: dict, lcfg: model_lib.ModelConfig) -> dict:
  """The inverse of `_layer_from_hf`."""
  Hg, D = lcfg.group, lcfg.d_model
  wqkv = np.asarray(lp['wqkv'])
  return {
      'input_layernorm': lp['attn_norm'], 'post_attention_layernorm': lp['mlp_norm'],
      'q_proj': wqkv[:, :Hg].reshape(-1, D), 'k_proj': wqkv[:, Hg].reshape(-1, D),
      'v_proj': wqkv[:, Hg + 1].reshape(-1, D), 'o_proj': lp['wo'],
      'q_norm': lp['q_norm'], 'k_norm': lp['k_norm'],
      'gate_proj': lp['w_gate_up'][0], 'up_proj': lp['w_gate_up'][1], 'down_proj': lp['w_down'],
  }


def _tensor_reader(path: str):
  """read(name) -> that tensor in its stored dtype (bfloat16 stays bfloat16), one open file at a
  time (a drafter is converted tensor by tensor: host memory stays about one layer). Names go
  without a leading 'model.' (some exports keep the base-model prefix)."""
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  where = {name.removeprefix('model.'): (file, name) for name, file in
           loaders._safetensors_index(path).items()}  # pylint: disable=protected-access
  handles = {}

  def read(name: str) -> np.ndarray:
    if name not in where:
      raise ValueError(f'DFlash drafter {path} lacks tensor {name!r} (incomplete download?)')
    file, stored_name = where[name]
    try:
      if file not in handles:
        handles.clear()
        handles[file] = safe_open(file, framework='np')
      return handles[file].get_tensor(stored_name)
    except Exception as e:
      raise ValueError(f'cannot read {stored_name!r} from {file}: {e} (corrupt or truncated '
                       'file? download it again)') from e

  return read


def load_folder(path: str, target, dtype: str = 'float32', mesh=None):
  """(DrafterConfig, params, metadata) of a DFlash folder, as `drafters.load_drafter` returns
  them for our checkpoints (params in `dtype`)."""
  path = os.path.abspath(path)
  config = read_config(path)
  dcfg = dataclasses.replace(drafter_config(config, os.path.join(path, CONFIG_FILE)), dtype=dtype)
  check_target(config, dcfg, path, target)
  read = _tensor_reader(path)
  as_param = lambda x: jnp.asarray(np.asarray(x, np.float32), dtype)
  lcfg = dcfg.layer_config(target.cfg.vocab_size)
  layers = []
  for i in range(dcfg.n_layers):
    w = {k: np.asarray(read(f'layers.{i}.{n}'), np.float32) for k, n in LAYER_NAMES.items()}
    try:
      lp = _layer_from_hf(w, lcfg)
    except ValueError as e:  # a reshape that does not fit
      raise ValueError(f'DFlash drafter {path}: the tensors of layer {i} do not match its '
                       f'config.json ({e})') from e
    layers.append({k: as_param(x) for k, x in lp.items()})
  stored = str(read(TOP_NAMES['fc']).dtype)
  params = {k: as_param(read(n)) for k, n in TOP_NAMES.items()}
  multiplier = float(_value(config, 'output_multiplier', 1.0))
  if multiplier != 1.0:
    params['final_norm'] = as_param(np.asarray(read(TOP_NAMES['final_norm']), np.float32) *
                                    multiplier)
  mask_id = int(_value(config, 'mask_token_id'))
  params['mask_embed'] = as_param(target.params['embed'][mask_id])
  params['layers'] = layers
  shapes = lambda tree: {jax.tree_util.keystr(k): tuple(np.shape(x))
                         for k, x in jax.tree_util.tree_leaves_with_path(tree)}
  want = shapes(jax.eval_shape(lambda: drafter_lib.init_params(dcfg, target.cfg,
                                                               jax.random.PRNGKey(0))))
  got = shapes(params)
  bad = [f'{k}: {got.get(k)} (config: {want.get(k)})' for k in sorted(want.keys() | got.keys())
         if want.get(k) != got.get(k)]
  if bad:
    raise ValueError(f'DFlash drafter {path}: tensor shapes do not match its config.json: '
                     f'{"; ".join(bad[:3])}')
  if mesh is not None:
    params = jax.device_put(params, sharding.drafter_shardings(mesh, params))
  meta = {'kind': 'drafter1', 'format': 'dflash', 'drafter': dataclasses.asdict(dcfg),
          'target': target_name(config, path),
          'target_arch': {k: config.get(k) for k in ('vocab_size', 'hidden_size',
                                                     'num_target_layers')},
          'target_fingerprint': (config.get('d2sd_target') or {}).get('fingerprint'),
          'param_dtype': stored,
          'dflash': {'folder': path, 'mask_token_id': mask_id,
                     'target_layer_ids': [i - OFFSET for i in dcfg.feature_layers]}}
  return dcfg, params, meta


def import_drafter(path: str, out: str, target, target_source: str, dtype: str | None = None):
  """A DFlash folder -> our drafter checkpoint (Orbax, parameters in `dtype`, default the
  folder's), tied to `target` by its fingerprint like any drafter we train."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  dcfg, params, meta = load_folder(path, target)
  dtype = dtype or meta['param_dtype']
  meta = {**ckpt.checkpoint_metadata('drafter1', target_source, target, dcfg),
          'param_dtype': dtype, 'dflash': meta['dflash']}
  mngr = ckpt.manager(out, keep=1)
  mngr.save(0, args=ocp.args.Composite(
      params=ocp.args.StandardSave(jax.tree.map(lambda x: x.astype(dtype), params)),
      meta=ocp.args.JsonSave(meta)), force=True)
  mngr.wait_until_finished()
  return dcfg


# ----------------------------------------------------------------------------------------------
# Export


def mask_token_of(params: dict, target, stored_dtype: str = 'float32',
                  hint: int | None = None) -> int | None:
  """The token whose target embedding is the drafter's mask embedding (as stored: compared in
  `stored_dtype`), preferring `hint`; None when there is none."""
  embed_VxD = np.asarray(jnp.asarray(target.params['embed']).astype(stored_dtype), np.float32)
  mask_D = np.asarray(jnp.asarray(params['mask_embed']).astype(stored_dtype), np.float32)
  same_V = np.all(embed_VxD == mask_D, axis=1)
  if hint is not None and 0 <= hint < same_V.size and same_V[hint]:
    return int(hint)
  hits = np.flatnonzero(same_V)
  return int(hits[0]) if hits.size else None


def check_exportable(dcfg: drafter_lib.DrafterConfig, params: dict, tcfg: model_lib.ModelConfig,
                     full_head: bool = False) -> None:
  """What a DFlash folder cannot hold, refused with the reason and the way out."""
  if not dcfg.qk_norm:
    raise ValueError('this drafter has no q/k norms (qk_norm=False, as our SmolLM2 drafters): '
                     'DFlash layers always normalise queries and keys, so it cannot be written '
                     'as a DFlash folder; only drafters with qk_norm=True (such as imported '
                     'DFlash drafters, fine-tuned or not) export')
  if 'in_proj' in params:
    raise ValueError(f'this drafter is {dcfg.d_model} wide and the target {tcfg.d_model}: DFlash '
                     'drafters have the target\'s width (no in/out projections), so it cannot be '
                     'exported')
  if dcfg.head_vocab and not full_head:
    raise ValueError(f'this drafter predicts only {dcfg.head_vocab} of the target\'s '
                     f'{tcfg.vocab_size} tokens (head_vocab={dcfg.head_vocab}), and a DFlash '
                     'drafter scores the target\'s whole LM head: pass full_head=True '
                     '(--full-head) to export it anyway (its drafts may then be tokens outside '
                     'the head it was trained on), or export a drafter with head_vocab=0')
  last = [l for l in dcfg.feature_layers if l >= tcfg.n_layers]
  if last:
    raise ValueError(f'feature layer(s) {last} read the last layer\'s output, which DFlash would '
                     'take after the final norm (HF hidden_states[-1]): this drafter cannot be '
                     'exported exactly')


def save_folder(dcfg: drafter_lib.DrafterConfig, params: dict, target, out: str,
                mask_token_id: int | None = None, full_head: bool = False,
                dtype: str = 'float32', target_source: str | None = None,
                stored_dtype: str = 'float32', mask_hint: int | None = None) -> dict:
  """Writes drafter parameters as a DFlash folder (config.json + model.safetensors, tensors in
  `dtype`). mask_token_id: the token whose target embedding replaces the drafter's mask
  embedding (default: the token it already equals, found in the target's embedding).
  Returns what was written: {'mask_token_id', 'mask_embed_max_diff', 'target_layer_ids'}."""
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  tcfg = target.cfg
  check_exportable(dcfg, params, tcfg, full_head)
  if mask_token_id is None:
    mask_token_id = mask_token_of(params, target, stored_dtype, mask_hint)
    if mask_token_id is None:
      raise ValueError(
          'the drafter\'s mask embedding is its own learned vector, not the target\'s embedding '
          'of any token, and a DFlash folder stores only a mask_token_id (the target\'s '
          'embedding of it is used): pass mask_token_id=ID (--mask-token-id ID) to use the '
          'target\'s embedding of token ID instead; this changes the drafter\'s input, so '
          'measure its acceptance after')
  if not 0 <= mask_token_id < tcfg.vocab_size:
    raise ValueError(f'mask_token_id={mask_token_id} is not a token of the target '
                     f'(0..{tcfg.vocab_size - 1})')
  diff = float(np.max(np.abs(np.asarray(params['mask_embed'], np.float32) -
                             np.asarray(target.params['embed'][mask_token_id], np.float32))))
  lcfg = dcfg.layer_config(tcfg.vocab_size)
  tensors = {n: params[k] for k, n in TOP_NAMES.items()}
  for i, lp in enumerate(params['layers']):
    tensors.update({f'layers.{i}.{LAYER_NAMES[k]}': x for k, x in _layer_to_hf(lp, lcfg).items()})
  tensors = {n: np.ascontiguousarray(np.asarray(jnp.asarray(x, jnp.float32).astype(dtype)))
             for n, x in tensors.items()}
  ids = [l - OFFSET for l in dcfg.feature_layers]
  config = {
      'architectures': ['DFlashDraftModel'], 'model_type': 'qwen3', 'dtype': dtype,
      'vocab_size': tcfg.vocab_size, 'hidden_size': dcfg.d_model,
      'intermediate_size': dcfg.d_ff, 'num_hidden_layers': dcfg.n_layers,
      'num_attention_heads': dcfg.n_heads, 'num_key_value_heads': dcfg.n_kv_heads,
      'head_dim': dcfg.head_dim, 'hidden_act': 'silu', 'rms_norm_eps': dcfg.norm_eps,
      # transformers < 5 reads rope_theta, >= 5 rope_parameters
      'rope_theta': dcfg.rope_base,
      'rope_parameters': {'rope_type': 'default', 'rope_theta': dcfg.rope_base},
      'max_position_embeddings': tcfg.max_position, 'attention_bias': False,
      'attention_dropout': 0.0, 'tie_word_embeddings': False, 'use_sliding_window': False,
      'sliding_window': None, 'layer_types': ['full_attention'] * dcfg.n_layers,
      'num_target_layers': tcfg.n_layers, 'block_size': dcfg.gamma,
      'dflash_config': {'mask_token_id': int(mask_token_id), 'target_layer_ids': ids,
                        # ours, read back on import (DFlash ignores keys it does not know)
                        'd2sd_confidence_temperature': dcfg.confidence_temperature},
      'd2sd_target': {'name': target_source or target.source,
                      'fingerprint': ckpt.target_fingerprint(target)},
  }
  os.makedirs(out, exist_ok=True)
  save_file(tensors, os.path.join(out, WEIGHTS_FILE), metadata={'format': 'pt'})
  with open(os.path.join(out, CONFIG_FILE), 'w') as f:
    json.dump(config, f, indent=2)
    f.write('\n')
  return {'mask_token_id': int(mask_token_id), 'mask_embed_max_diff': diff,
          'target_layer_ids': ids}


def export_drafter(path: str, out: str, target, mask_token_id: int | None = None,
                   full_head: bool = False, dtype: str | None = None,
                   target_source: str | None = None) -> dict:
  """Our drafter (a train.py workdir, an exported drafter, or a DFlash folder) -> a DFlash
  folder the reference code loads; tensors in `dtype` (default: as the drafter is stored)."""
  dcfg, params, meta = (load_folder(path, target) if is_dflash_folder(path) else
                        ckpt.load_checkpoint(path, target))
  stored = meta.get('param_dtype', 'float32')
  return save_folder(dcfg, params, target, out, mask_token_id, full_head, dtype or stored,
                     target_source or meta.get('target'), stored,
                     (meta.get('dflash') or {}).get('mask_token_id'))
