"""RoPE scaling (Llama 3.1 'llama3', 'linear') against transformers, from HF folders and GGUF
(d2sd_jax/formats/loaders.py reads it; models/target.py applies it).

The fixture (scripts/make_reference_fixtures.py --only llama3_rope) is a tiny Llama whose
pretraining context (64) is shorter than the 80 positions it is checked at, with frequencies on
every side of the llama3 band, so a wrong band edge or interpolation shows in the logits.
"""
import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from d2sd_jax.formats import loaders
from d2sd_jax.models import target as M
from tests.conftest import FIXTURES

LLAMA3 = os.path.join(FIXTURES, 'hf_tiny', 'llama3_rope')


def reference():
  return np.load(os.path.join(LLAMA3, 'reference.npz'))


def logits_of(target, ids_BxT):
  ids_BxT = jnp.asarray(ids_BxT)
  B, T = ids_BxT.shape
  h, _, _ = M.forward(target.params, target.cfg, ids_BxT,
                      jnp.broadcast_to(jnp.arange(T), (B, T)), M.init_cache(target.cfg, B, T),
                      jnp.zeros((B,), jnp.int32))
  return np.asarray(M.logits(target.params, target.cfg, h))


def with_rope(tmp_path, rope_parameters, name='ckpt'):
  """The llama3 fixture's weights under another rope_parameters."""
  folder = tmp_path / name
  shutil.copytree(LLAMA3, folder)
  config = json.loads((folder / 'config.json').read_text())
  (folder / 'config.json').write_text(json.dumps({**config, 'rope_parameters': rope_parameters}))
  return str(folder)


def test_llama3_rope_matches_transformers():
  target = loaders.load_target(LLAMA3)
  ref = reference()
  cfg = target.cfg
  inv_freq_h = (cfg.rope_base ** (-np.arange(0, cfg.head_dim, 2) / cfg.head_dim) /
                np.asarray(cfg.rope_freq_factors))
  np.testing.assert_allclose(inv_freq_h, ref['inv_freq'], rtol=1e-6)
  logits = logits_of(target, ref['input_ids'])
  np.testing.assert_allclose(logits, ref['logits'], rtol=1e-4, atol=1e-4)
  # The test bites: the same weights under plain RoPE are far off.
  plain = dataclasses.replace(target, cfg=dataclasses.replace(cfg, rope_freq_factors=None))
  assert np.abs(logits_of(plain, ref['input_ids']) - ref['logits']).max() > 0.5


def test_linear_rope_matches_transformers(tmp_path):
  ref = reference()
  target = loaders.load_target(with_rope(tmp_path, {'rope_type': 'linear', 'rope_theta': 1e4,
                                                    'factor': 4.0}))
  assert target.cfg.rope_freq_factors == (4.0,) * 8
  np.testing.assert_allclose(logits_of(target, ref['input_ids']), ref['logits_linear'],
                             rtol=1e-4, atol=1e-4)


def test_transformers_4_config_layout_gives_the_same_config():
  """transformers < 5 writes rope_theta at the top level and the scaling as rope_scaling
  (with 'type' in the oldest files); >= 5 writes one rope_parameters dict."""
  with open(os.path.join(LLAMA3, 'config.json')) as f:
    config = json.load(f)
  scaling = dict(config.pop('rope_parameters'))
  theta = scaling.pop('rope_theta')
  old = {**config, 'rope_theta': theta, 'rope_scaling': {**scaling, 'type': scaling.pop(
      'rope_type')}}
  assert (loaders.hf_model_config(old, 'float32') ==
          loaders.load_target(LLAMA3).cfg)


@pytest.mark.parametrize('rope,match', [
    ({'rope_type': 'yarn', 'factor': 4.0}, "rope type 'yarn' is not supported"),
    ({'rope_type': 'dynamic', 'factor': 2.0}, "rope type 'dynamic' is not supported"),
    ({'rope_type': 'longrope', 'short_factor': [1.0] * 8}, "rope type 'longrope' is not"),
    ({'rope_type': 'llama3', 'factor': 8.0, 'high_freq_factor': 4.0,
      'original_max_position_embeddings': 64}, "'llama3' needs low_freq_factor"),
    ({'rope_type': 'default', 'partial_rotary_factor': 0.5}, 'partial_rotary_factor'),
])
def test_unsupported_rope_is_refused_by_name(tmp_path, rope, match):
  with pytest.raises(ValueError, match=match):
    loaders.load_target(with_rope(tmp_path, {'rope_theta': 1e4, **rope}))


def test_scaled_config_is_static_and_survives_json():
  """The factors live in ModelConfig as a tuple: hashable (a static jit argument, one compiled
  program per scaling) and restored from a JSON list (Decoder.save). Plain RoPE leaves them
  out of the architecture, so fingerprints recorded before the field existed still match."""
  cfg = loaders.load_target(LLAMA3).cfg
  again = M.ModelConfig(**json.loads(json.dumps(dataclasses.asdict(cfg))))
  assert again == cfg and hash(again) == hash(cfg)
  plain = dataclasses.replace(cfg, rope_freq_factors=None)
  assert hash(plain) != hash(cfg)
  assert 'rope_freq_factors' not in loaders.architecture(plain)
  assert loaders.architecture(cfg)['rope_freq_factors'] == cfg.rope_freq_factors
  with pytest.raises(ValueError, match='one per rotated pair'):
    dataclasses.replace(cfg, rope_freq_factors=(1.0, 2.0))
  x = jnp.ones((1, 3, 1, cfg.head_dim))
  pos = jnp.arange(3)[None]
  rope = jax.jit(lambda x, c: M.rope(x, pos, c.rope_base, c.rope_freq_factors),
                 static_argnums=1)
  assert not np.allclose(rope(x, cfg), rope(x, plain))


# ----------------------------------------------------------------------------------------------
# GGUF: llama.cpp's converter stores llama3 scaling as a `rope_freqs` tensor of divisors.


def _permute_for_llama_cpp(w_out_in, n_heads):
  """Hugging Face rotate-half rows -> llama.cpp's interleaved pairs (the loader undoes it)."""
  out = w_out_in.shape[0]
  return (w_out_in.reshape(n_heads, 2, out // n_heads // 2, *w_out_in.shape[1:])
          .swapaxes(1, 2).reshape(w_out_in.shape))


def write_gguf(path, rope_freqs=None, scaling=None):
  """The llama3 fixture's weights as a float32 llama GGUF."""
  import gguf  # pylint: disable=import-outside-toplevel
  with open(os.path.join(LLAMA3, 'config.json')) as f:
    config = json.load(f)
  tensors = load_file(os.path.join(LLAMA3, 'model.safetensors'))
  n_heads, n_kv = config['num_attention_heads'], config['num_key_value_heads']
  w = gguf.GGUFWriter(str(path), 'llama')
  w.add_block_count(config['num_hidden_layers'])
  w.add_context_length(config['max_position_embeddings'])
  w.add_embedding_length(config['hidden_size'])
  w.add_feed_forward_length(config['intermediate_size'])
  w.add_head_count(n_heads)
  w.add_head_count_kv(n_kv)
  w.add_rope_dimension_count(config['head_dim'])
  w.add_rope_freq_base(config['rope_parameters']['rope_theta'])
  w.add_layer_norm_rms_eps(config['rms_norm_eps'])
  if scaling is not None:
    w.add_rope_scaling_type(scaling[0])
    w.add_rope_scaling_factor(scaling[1])
  w.add_tokenizer_model('gpt2')
  w.add_token_list(['a', 'b', 'ab'] + [f'<t{i}>' for i in range(3, config['vocab_size'])])
  w.add_token_merges(['a b'])
  w.add_eos_token_id(0)
  w.add_tensor('token_embd.weight', tensors['model.embed_tokens.weight'])
  w.add_tensor('output_norm.weight', tensors['model.norm.weight'])
  w.add_tensor('output.weight', tensors['lm_head.weight'])
  if rope_freqs is not None:
    w.add_tensor('rope_freqs.weight', np.asarray(rope_freqs, np.float32))
  names = {'attn_q': 'self_attn.q_proj', 'attn_k': 'self_attn.k_proj',
           'attn_v': 'self_attn.v_proj', 'attn_output': 'self_attn.o_proj',
           'ffn_gate': 'mlp.gate_proj', 'ffn_up': 'mlp.up_proj', 'ffn_down': 'mlp.down_proj',
           'attn_norm': 'input_layernorm', 'ffn_norm': 'post_attention_layernorm'}
  for i in range(config['num_hidden_layers']):
    for ours, hf in names.items():
      x = tensors[f'model.layers.{i}.{hf}.weight']
      if ours in ('attn_q', 'attn_k'):
        x = _permute_for_llama_cpp(x, n_heads if ours == 'attn_q' else n_kv)
      w.add_tensor(f'blk.{i}.{ours}.weight', x)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return str(path)


def test_gguf_llama3_rope_freqs_match_transformers(tmp_path):
  ref = reference()
  hd = ref['inv_freq'].shape[0] * 2
  # The divisors llama.cpp would store, taken from transformers' own scaled frequencies.
  rope_freqs = 1e4 ** (-np.arange(0, hd, 2) / hd) / ref['inv_freq'].astype(np.float64)
  target = loaders.load_target(write_gguf(tmp_path / 'llama3.gguf', rope_freqs))
  np.testing.assert_allclose(logits_of(target, ref['input_ids']), ref['logits'],
                             rtol=1e-4, atol=1e-4)


def test_gguf_linear_scaling_and_unsupported_types(tmp_path):
  import gguf  # pylint: disable=import-outside-toplevel
  ref = reference()
  linear = loaders.load_target(write_gguf(tmp_path / 'linear.gguf',
                                          scaling=(gguf.RopeScalingType.LINEAR, 4.0)))
  np.testing.assert_allclose(logits_of(linear, ref['input_ids']), ref['logits_linear'],
                             rtol=1e-4, atol=1e-4)
  plain = loaders.load_target(write_gguf(tmp_path / 'plain.gguf'))
  assert plain.cfg.rope_freq_factors is None
  with pytest.raises(ValueError, match="GGUF rope scaling type 'yarn' is not supported"):
    loaders.load_target(write_gguf(tmp_path / 'yarn.gguf',
                                   scaling=(gguf.RopeScalingType.YARN, 4.0)))
