"""Decoding's attention as one Pallas kernel on TPUs (d2sd_jax/kernels/cached.py): through
Pallas' interpreter on this CPU it equals the XLA form (`attention._attend_windows`) for token
trees and for drafter blocks, over caches of several blocks with rows of different prefix
lengths; programs compiled for a TPU take it, CPU programs do not, and over a mesh it compiles
split per device."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from d2sd_jax.kernels import cached
from d2sd_jax.models import attention as A
from d2sd_jax.models import target as model_lib
from d2sd_jax.perf import compiled as C
from tests.perf.test_compiled import LEAN, LEAN_DRAFTER, tpu_devices

# pylint: disable=protected-access
kernel_form, xla_form = cached.attention, A._attend_windows

# S = 1040 slots: blocks of 208, five of them. Lengths: mid-block, none, all, exactly one block
# (a kernel that also reads slot `length`, or skips the block holding the last slot, or stops
# one block early, differs), and one slot.
LENGTHS = (300, 0, 1040, 208, 1)


def _inputs(T, H, Hkv, dtype, seed):
  ks = jax.random.split(jax.random.key(seed), 6)
  B, S, hd = len(LENGTHS), 1040, 32
  dt = jnp.dtype(dtype)
  q = jax.random.normal(ks[0], (B, T, H, hd))
  k_new = jax.random.normal(ks[1], (B, Hkv, T, hd)).astype(dt)
  v_new = jax.random.normal(ks[2], (B, Hkv, T, hd)).astype(dt)
  kv = {'k': jax.random.normal(ks[3], (B, Hkv, S, hd)).astype(dt),
        'v': jax.random.normal(ks[4], (B, Hkv, S, hd)).astype(dt)}
  return q, k_new, v_new, kv, jnp.asarray(LENGTHS), ks[5]


@pytest.mark.parametrize('H,Hkv,dtype', [(6, 2, 'float32'), (4, 4, 'bfloat16')])
def test_kernel_equals_the_xla_form_on_token_trees(H, Hkv, dtype):
  """A random token tree per row (each node sees itself and a random subset of the others)."""
  assert cached.block_for(1040) == 208
  T = 7
  q, k_new, v_new, kv, lens, key = _inputs(T, H, Hkv, dtype, seed=H)
  tree = jax.random.bernoulli(key, 0.5, (len(LENGTHS), T, T)) | jnp.eye(T, dtype=bool)
  got = kernel_form(q, k_new, v_new, kv, lens, tree, interpret=True)
  want = xla_form(q, k_new, v_new, kv, lens, tree)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
  # the row with no context sees only new tokens: a kernel ignoring the tree mask differs there
  only_new = xla_form(q, k_new, v_new, kv, lens, jnp.ones_like(tree))
  assert float(jnp.max(jnp.abs(only_new[1] - want[1]))) > 1e-2


def test_kernel_equals_the_xla_form_for_one_new_token():
  """An AR step: one new token per row, grouped heads. Its scores take their own form
  (`cached.new_token_scores`: Mosaic does not lower a product against one key row); a form
  summing over the wrong axis or leaving the new token out of the softmax differs."""
  q, k_new, v_new, kv, lens, _ = _inputs(1, 6, 2, 'bfloat16', seed=7)
  tree = jnp.ones((len(LENGTHS), 1, 1), bool)
  got = kernel_form(q, k_new, v_new, kv, lens, tree, interpret=True)
  want = xla_form(q, k_new, v_new, kv, lens, tree)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_kernel_equals_the_xla_form_on_drafter_blocks():
  """Three bidirectional blocks of 4 side by side (drafter 2's re-drafts), grouped heads."""
  q, k_new, v_new, kv, lens, _ = _inputs(12, 4, 2, 'float32', seed=3)
  got = kernel_form(q, k_new, v_new, kv, lens, None, block_size=4, interpret=True)
  want = xla_form(q, k_new, v_new, kv, lens, None, block_size=4)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_lengths_equal_the_prefix_mask_they_stand_for():
  """`attention` with lengths [B] equals it with the bool mask arange(S) < lengths (the XLA
  form; the kernel form above)."""
  q, k_new, v_new, kv, lens, _ = _inputs(5, 4, 2, 'float32', seed=5)
  tree = model_lib.causal_mask(len(LENGTHS), 5)
  mask = jnp.arange(1040)[None] < lens[:, None]
  np.testing.assert_array_equal(
      np.asarray(A.attention(q, k_new, v_new, kv, lens, tree)),
      np.asarray(A.attention(q, k_new, v_new, kv, mask, tree)))


def _cycle(devices, mesh_spec, method='dflash'):
  mesh = C.mesh_of(devices, mesh_spec)
  prefill, step = C.decode_programs(LEAN, {'drafter1': LEAN_DRAFTER}, [method], mesh, batch=1,
                                    context=64, max_new_tokens=32, loops=False)
  prefill_row, compiled = C.compile_program(prefill, C.chip_of(devices), mesh.size)
  state = C._placed(prefill.abstract_output(), compiled.output_shardings)
  step.args = step.args[:3] + (state,)
  return C.compile_program(step, C.chip_of(devices), mesh.size)


def test_tpu_cycles_take_the_kernel_and_cpu_programs_do_not():
  """A dflash cycle compiled for a v5p chip calls the kernels (fused.py's attention half and
  MLP) in every layer of the target's verification and the drafter's pass; the same cycle
  lowered for the CPU has no custom call (a choice made by the host's jax.default_backend()
  would give the TPU program the XLA forms)."""
  row, compiled = _cycle(tpu_devices('v5p:1x1x1'), 'data=1,model=1')
  calls = compiled.as_text().count('custom_call_target="tpu_custom_call"')
  assert calls >= 2 * (LEAN.n_layers + LEAN_DRAFTER.n_layers), calls
  assert row['bytes_per_device'] <= 1.1 * row['ideal_bytes_per_device']
  prefill, step = C.decode_programs(LEAN, {'drafter1': LEAN_DRAFTER}, ['dflash'],
                                    C.sharding.make_mesh(1, 1), batch=1, context=64,
                                    max_new_tokens=32, loops=False)
  step.args = step.args[:3] + (prefill.abstract_output(),)
  assert 'tpu_custom_call' not in step.lower().as_text()

def test_kernel_compiles_split_over_a_mesh():
  """On v5e:2x2 with a model axis of 2: the cycle compiles (a Mosaic call left to XLA's
  partitioner does not), gathering no weight."""
  row, compiled = _cycle(tpu_devices('v5e:2x2'), 'data=1,model=2')
  assert compiled.as_text().count('custom_call_target="tpu_custom_call"') >= LEAN.n_layers
  assert not row['collectives']['weight_gathers']
