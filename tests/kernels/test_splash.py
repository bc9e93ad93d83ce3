"""Splash attention for the fresh (prefill / teacher) attention of TPU programs
(d2sd_jax/kernels/splash.py): the kernel, run on this CPU by Pallas' interpreter, equals the
einsum form; programs compiled for a TPU take it, programs for the CPU do not, and over a mesh it
compiles split per device (shard_map) with no weight gathered."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from d2sd_jax.kernels import splash
from d2sd_jax.models import attention as A
from d2sd_jax.models import target as model_lib
from d2sd_jax.perf import compiled as C
from tests.perf.test_compiled import tpu_devices


@pytest.mark.parametrize('T,H,Hkv,dtype', [(200, 4, 2, 'float32'), (256, 2, 2, 'float32'),
                                           (130, 4, 1, 'bfloat16')])
def test_splash_equals_the_einsum_in_interpret_mode(T, H, Hkv, dtype):
  """Causal attention of 2 rows: T not a multiple of the 128 tile (padded) or one whole tile,
  grouped query heads (2 or 4 per KV head), float32 and bfloat16 (v's dtype, as decoding's
  caches). A kernel padded at the front, mapping query heads to the wrong KV head, or missing
  the 1/sqrt(hd) scale differs by O(1)."""
  ks = jax.random.split(jax.random.key(T + H), 3)
  hd = 64
  dt = jnp.dtype(dtype)
  q = jax.random.normal(ks[0], (2, T, H, hd)).astype(dt)
  k = jax.random.normal(ks[1], (2, Hkv, T, hd)).astype(dt)
  v = jax.random.normal(ks[2], (2, Hkv, T, hd)).astype(dt)
  got = splash.causal(q, k, v, interpret=True)
  want = A._fresh_einsum(  # pylint: disable=protected-access
      q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32))
  assert got.shape == want.shape and got.dtype == dt
  # float32: summation order only; bfloat16: the kernel's bf16 probabilities and output
  tol = 2e-5 if dtype == 'float32' else 3e-2
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=tol, rtol=tol)
  # the first query sees only the first key: its output is v[0] exactly (up to the dtype)
  np.testing.assert_allclose(np.asarray(got[:, 0, 0], np.float32),
                             np.asarray(v[:, 0, 0], np.float32), atol=tol)


def test_block_sizes():
  assert [splash.block_for(n) for n in (128, 256, 384, 512, 640, 1024, 1536)] == [
      128, 256, 384, 512, 128, 512, 512]


TINY = model_lib.ModelConfig(vocab_size=512, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2,
                             head_dim=128, d_ff=512, dtype='bfloat16')  # (lane-dense heads)


def _prefill_text(devices, tcfg, mesh_spec, compile_it: bool):
  mesh = C.mesh_of(devices, mesh_spec)
  prefill = C.decode_programs(tcfg, {}, ['ar'], mesh, batch=2, context=200,
                              max_new_tokens=16, loops=False)[0]
  if not compile_it:
    return prefill.lower().as_text(), None
  row, compiled = C.compile_program(prefill, C.chip_of(devices), mesh.size)
  return compiled.as_text(), row


def test_fresh_attention_takes_splash_in_tpu_programs_only():
  """The same prefill lowered for the CPU uses the einsum (no custom call), lowered and compiled
  for a v5p chip calls the Pallas kernel once per layer: the choice follows the compile target
  (a choice by the host's jax.default_backend() would give the TPU program the einsum)."""
  cpu = jax.jit(lambda p, tok: model_lib.forward(
      p, TINY, tok, jnp.broadcast_to(jnp.arange(200), (2, 200)), model_lib.init_cache(TINY, 2, 256),
      jnp.zeros((2,), jnp.int32), fresh=True)[0]).lower(
          jax.eval_shape(lambda: model_lib.init_params(TINY, jax.random.PRNGKey(0))),
          jax.ShapeDtypeStruct((2, 200), jnp.int32)).as_text()
  assert 'tpu_custom_call' not in cpu and 'splash' not in cpu
  text, row = _prefill_text(tpu_devices('v5p:1x1x1'), TINY, 'data=1,model=1', compile_it=True)
  assert text.count('custom_call_target="tpu_custom_call"') == TINY.n_layers
  assert row['compiled'] and row['memory_bytes_per_device'] > 0


def test_splash_compiles_split_over_a_model_parallel_mesh():
  """On v5e:2x2 with data 2 x model 2 (rows and KV heads split), the prefill compiles (a
  Mosaic call left to XLA's partitioner does not) and gathers no weight."""
  text, row = _prefill_text(tpu_devices('v5e:2x2'), TINY, 'data=2,model=2', compile_it=True)
  assert text.count('custom_call_target="tpu_custom_call"') == TINY.n_layers
  assert not row['collectives']['weight_gathers']
  # Each device runs the kernel on its own row and KV head: the kernel's output is the 2 query
  # heads of that KV head over 256 padded tokens (unsplit it would be [4, 256, 128] per row)
  calls = [line for line in text.split('\n') if 'custom_call_target="tpu_custom_call"' in line]
  assert all('[2,256,128]' in line.split(' custom-call(')[0] for line in calls), calls[0][:300]


def test_narrow_heads_keep_the_xla_form_on_tpus():
  """Heads of 64 (SmolLM2's) fill half of each kernel tile: TPU programs keep the XLA forms
  for them (`attention.lane_dense`), in the prefill and in a decode step."""
  narrow = dataclasses.replace(TINY, head_dim=64)
  text, _ = _prefill_text(tpu_devices('v5p:1x1x1'), narrow, 'data=1,model=1', compile_it=False)
  assert 'tpu_custom_call' not in text
  assert not A.lane_dense(64) and A.lane_dense(128) and A.lane_dense(256)
