"""A decoding layer's attention half and MLP as Pallas TPU kernels (kernels/fused.py): through
Pallas' interpreter on this CPU they equal the XLA form (`target.layer`'s), alone and in a whole
layer verifying a token tree over a cache, with rows of different lengths; a TPU layer takes
them (and a CPU program does not), and over a model-parallel mesh they compile split, the MLP's
partial sums reduced, no weight gathered."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from d2sd_jax.kernels import fused
from d2sd_jax.models import attention as A
from d2sd_jax.models import target as model_lib
from d2sd_jax.perf import compiled as C
from d2sd_jax.perf import hlo
from tests.perf.test_compiled import LEAN, tpu_devices

# pylint: disable=protected-access
BASE = model_lib.ModelConfig(vocab_size=64, d_model=256, n_layers=1, n_heads=6, n_kv_heads=2,
                             head_dim=128, d_ff=1024, rope_base=500.0)
CONFIGS = {  # Qwen3 (q/k norms), Qwen2 (q/k/v biases), Llama (neither, scaled RoPE)
    'qwen3': dataclasses.replace(BASE, qk_norm=True),
    'qwen2': dataclasses.replace(BASE, qkv_bias=True),
    'llama': dataclasses.replace(BASE, rope_freq_factors=tuple(np.linspace(1, 8, 64))),
}


def _as_tpu_rounds(x, dtype):
  """What a TPU's default-precision matmul makes of a float32 input to a `dtype` weight."""
  return x.astype(dtype).astype(jnp.float32)


def _layer(cfg, dtype, seed=0):
  cfg = dataclasses.replace(cfg, dtype=dtype)
  lp = model_lib.init_params(cfg, jax.random.key(seed))['layers'][0]
  ks = jax.random.split(jax.random.key(seed + 1), 2)
  x = 3.0 * jax.random.normal(ks[0], (2, 12, cfg.d_model))
  positions = jnp.arange(12)[None] + jnp.array([[5], [300]])
  return cfg, lp, x, positions


@pytest.mark.parametrize('name', sorted(CONFIGS))
@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_attention_kernel_equals_the_xla_attention_half(name, dtype):
  """The attention half in one kernel (norm, q/k/v, q/k norms, RoPE, attention over a cache of
  two rows' lengths plus a token tree): its output and the new keys and values against
  norm -> qkv_projection -> attention.attention, inputs rounded as the TPU rounds them. A kernel
  with RoPE's halves rotated the wrong way, a q/k norm on the wrong axis or with the other's
  weight, the bias dropped, the query scale missing or the cache read past a row's length
  differs."""
  cfg, lp, x, positions = _layer(CONFIGS[name], dtype)
  if 'q_norm' in lp:  # distinct q and k norm weights: swapping them must show
    lp = dict(lp, k_norm=lp['k_norm'] * 1.7)
  B, T, _ = x.shape
  Hkv, hd = cfg.n_kv_heads, cfg.head_dim
  ks = jax.random.split(jax.random.key(11), 3)
  S = 320
  kv = {'k': jax.random.normal(ks[0], (B, Hkv, S, hd)),
        'v': jax.random.normal(ks[1], (B, Hkv, S, hd))}
  lengths = positions[:, 0]  # 5 and 300 cached tokens; slots past them hold noise
  tree = jax.random.bernoulli(ks[2], 0.4, (B, T, T)) | jnp.eye(T, dtype=bool)
  h = _as_tpu_rounds(model_lib.rms_norm(x, lp['attn_norm'], cfg.norm_eps), lp['wqkv'].dtype)
  q, k, v = model_lib.qkv_projection(cfg, lp, h, positions)
  k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
  want = A.attention(q, k, v, kv, lengths, tree)
  got, got_k, got_v = fused.attention(x, lp, positions, kv, lengths, tree, eps=cfg.norm_eps,
                                      rope_base=cfg.rope_base,
                                      rope_freq_factors=cfg.rope_freq_factors, interpret=True)
  heads = lambda a: a.reshape(B, T, Hkv, hd).transpose(0, 2, 1, 3)
  for g, w in ((got, want), (heads(got_k), k), (heads(got_v), v)):
    np.testing.assert_allclose(g, w, rtol=0, atol=2e-5 * float(jnp.abs(w).max()))


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_mlp_kernel_equals_the_xla_mlp(dtype):
  """x + w_down(SiLU(gate) * up) over norm(x), F = 1024 in two halves of two 256-column tiles
  (a kernel that skipped a tile, added a half twice, or left out the residual differs)."""
  cfg, lp, x, _ = _layer(CONFIGS['llama'], dtype)
  wdt = lp['w_gate_up'].dtype
  h = _as_tpu_rounds(model_lib.rms_norm(x, lp['mlp_norm'], cfg.norm_eps), wdt)
  gate_up = model_lib.linear(h, model_lib.as_matrix(lp, 'w_gate_up')).reshape(2, 12, 2, -1)
  act = _as_tpu_rounds(jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1], wdt)
  want = x + model_lib.linear(act, lp['w_down'])
  got = fused.mlp(x, lp, eps=cfg.norm_eps, interpret=True)
  mlp_part = float(jnp.abs(want - x).max())
  np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * mlp_part)
  with_tile = dict(lp, w_down=lp['w_down'].at[:, 700].mul(0.0))  # one column of the 3rd tile
  assert float(jnp.abs(fused.mlp(x, with_tile, eps=cfg.norm_eps, interpret=True) - got).max()) > (
      1e-3 * mlp_part)


@pytest.mark.parametrize('name', sorted(CONFIGS))
def test_kernel_layer_equals_the_xla_layer_on_a_token_tree(name):
  """One layer verifying a random token tree after cached contexts of 37 and 250 tokens
  (float32 weights): the residual stream out and the cache with the tree's K/V written at each
  row's length, the slots before untouched; read-only (new_kv_only, as verification runs), the
  same residual stream and the tree's K/V returned, equal to what the write put in the cache."""
  cfg, lp, x, _ = _layer(CONFIGS[name], 'float32', seed=3)
  B, T = x.shape[:2]
  ks = jax.random.split(jax.random.key(7), 3)
  S = 320
  kv = {'k': jax.random.normal(ks[0], (B, cfg.n_kv_heads, S, cfg.head_dim)),
        'v': jax.random.normal(ks[1], (B, cfg.n_kv_heads, S, cfg.head_dim))}
  lengths = jnp.array([37, 250])
  tree = jax.random.bernoulli(ks[2], 0.4, (B, T, T)) | jnp.eye(T, dtype=bool)
  positions = lengths[:, None] + jnp.arange(T)
  want_x, want_kv = model_lib._layer_xla(cfg, x, lp, kv, positions, lengths, tree, lengths)
  got_x, got_kv = model_lib._layer_kernels(cfg, x, lp, kv, positions, lengths, tree, lengths,
                                           interpret=True)
  np.testing.assert_allclose(got_x, want_x, rtol=0, atol=2e-5 * float(jnp.abs(want_x).max()))
  for name_ in ('k', 'v'):
    np.testing.assert_allclose(got_kv[name_], want_kv[name_], rtol=0, atol=1e-4)
  assert float(jnp.abs(got_kv['k'][0, :, 37:37 + T] - kv['k'][0, :, 37:37 + T]).max()) > 0.1
  for form, kw in ((model_lib._layer_xla, {}), (model_lib._layer_kernels, {'interpret': True})):
    ro_x, new = form(cfg, x, lp, kv, positions, lengths, tree, lengths, new_kv_only=True, **kw)
    np.testing.assert_allclose(ro_x, want_x, rtol=0, atol=2e-5 * float(jnp.abs(want_x).max()))
    for name_ in ('k', 'v'):  # token by token: [B, T, Hkv, hd] (XLA) or [B, T, Hkv·hd]
      assert new[name_].shape[:2] == (B, T) and new[name_].size == B * T * cfg.n_kv_heads * (
          cfg.head_dim)
      got = new[name_].reshape(B, T, cfg.n_kv_heads, cfg.head_dim).transpose(0, 2, 1, 3)
      for b, n in enumerate((37, 250)):
        np.testing.assert_allclose(got[b], want_kv[name_][b, :, n:n + T], rtol=0, atol=1e-4)


def test_fits_needs_lane_dense_heads_and_rows_that_fit_vmem():
  assert fused.fits(76, 128, 12288) and fused.fits(fused.MAX_ROWS, 128, 1024)
  assert not fused.fits(fused.MAX_ROWS + 1, 128, 1024)  # a prefill block
  # Qwen3-8B's width: a d2sd cycle of 8 rows (80 nodes each) fits; 1,000 rows (16 MB of
  # float32 rows, over MAX_ROW_BYTES) do not, although 1,000 <= MAX_ROWS
  assert fused.fits(8 * 80, 128, 12288, 4096) and not fused.fits(1000, 128, 12288, 4096)
  assert not fused.fits(8, 64, 1536)  # SmolLM2's 64-wide heads
  assert not fused.fits(8, 128, 1000)  # F not in two halves of 128-column tiles


def _layer_program(devices, mesh_spec, T=8, **changes):
  """One LEAN layer (with `changes`) verifying T tokens, compiled for `devices` over a mesh."""
  mesh = C.mesh_of(devices, mesh_spec)
  cfg = dataclasses.replace(LEAN, n_layers=1, **changes)
  lp = C.target_params(cfg, mesh)['layers'][0]
  kv = jax.eval_shape(lambda: model_lib.init_cache(cfg, 1, 256))[0]
  spec = jax.sharding.NamedSharding(mesh, C.sharding.spec_for(kv['k'].shape, (
      'batch', 'kv_heads'), mesh))
  kv = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=spec), kv)
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  S = lambda shape, dt=jnp.float32: jax.ShapeDtypeStruct(shape, dt, sharding=rep)
  tree = jnp.tril(jnp.ones((1, T, T), bool))
  fn = lambda params, kv_, x, pos, n: model_lib.layer(cfg, x, params, kv_, pos, n, tree, n)
  with C.sharding.tracing_under(mesh):
    lowered = jax.jit(fn).lower(lp, kv, S((1, T, cfg.d_model)), S((1, T), jnp.int32),
                                S((1,), jnp.int32))
  return lowered


def test_tpu_layers_take_the_kernels_and_cpu_layers_do_not():
  """Compiled for a v5p chip a decoding layer is two Mosaic calls (its attention half, MLP);
  lowered for the CPU it has none (a choice made from the host's jax.default_backend() would
  give the TPU program the XLA form)."""
  text = _layer_program(tpu_devices('v5p:1x1x1'), 'data=1,model=1').compile().as_text()
  assert text.count('custom_call_target="tpu_custom_call"') == 2
  cpu = _layer_program(jax.devices('cpu'), 'data=1,model=1').as_text()
  assert 'tpu_custom_call' not in cpu


def test_kernels_compile_split_over_a_model_parallel_mesh():
  """On v5e:2x2 with a model axis of 4: each device's MLP kernel holds a quarter of F, their
  sums are reduced (an all-reduce of the rows' activations) and no weight is gathered."""
  compiled = _layer_program(tpu_devices('v5e:2x2'), 'data=1,model=4').compile()
  text = compiled.as_text()
  assert text.count('custom_call_target="tpu_custom_call"') >= 2
  coll = hlo.collectives(text)
  assert not coll['weight_gathers'], coll
  assert coll['by_kind']['all-reduce']['count'] >= 1, coll


def test_kernels_split_the_residual_stream_where_the_model_axis_splits_the_layer():
  """On v5e:2x2 with a model axis of 4 and 4 KV heads, a layer verifying 8 tokens keeps its
  residual stream split over its width (`fused.residual_split`, 256 of 1,024 columns per
  device): the output projection's and the MLP's float32 partial sums are reduce-scattered
  (the compiler keeps them: it turned a reduce-scatter over the tokens, 2 per device, into an
  all-reduce and a slice), the normed rows all-gathered in bfloat16 (the weights' dtype), the
  rows never all-reduced, no weight gathered. With 2 KV heads (not split 4 ways) the layer
  all-reduces its rows as before. (tests/helpers/sharded_checks.py split_residual checks the
  values.)"""
  devices = tpu_devices('v5e:2x2')
  text = _layer_program(devices, 'data=1,model=4', n_heads=8, n_kv_heads=4).compile().as_text()
  coll = hlo.collectives(text)
  assert not coll['weight_gathers'], coll
  assert len(re.findall(r'f32\[1,8,256\]\S* reduce-scatter', text)) == 2, coll
  assert len(re.findall(r'bf16\[1,8,1024\]\S* all-gather', text)) == 2, coll
  assert not re.search(r'f32\[1,8,1024\]\S* all-reduce', text), coll
  text = _layer_program(devices, 'data=1,model=4').compile().as_text()
  coll = hlo.collectives(text)
  assert 'reduce-scatter' not in coll['by_kind'], coll
  assert len(re.findall(r'f32\[1,8,1024\]\S* all-reduce', text)) == 2, coll
