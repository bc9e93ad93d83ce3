"""Checks that need 8 (virtual) devices; tests/models/test_sharding.py runs each in its own
process:

  python tests/helpers/sharded_checks.py rules|train|decode|kernels [tiny_folder distill_dir workdir]

XLA_FLAGS must be set before JAX starts, hence a separate process per check.
"""
import os
import re
import sys

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                           ' --xla_force_host_platform_device_count=8')

import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position
from jax.sharding import PartitionSpec as P  # pylint: disable=wrong-import-position

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.conftest import TINY, tiny_params  # pylint: disable=wrong-import-position
from tests.helpers import loop_checks  # pylint: disable=wrong-import-position
from tests.helpers import tiny_drafters  # pylint: disable=wrong-import-position

from d2sd_jax.spec_decode import ar as AR  # pylint: disable=wrong-import-position
from d2sd_jax.models import sharding  # pylint: disable=wrong-import-position
from d2sd_jax.spec_decode import speculative as SP  # pylint: disable=wrong-import-position


def check_rules():
  """TINY: vocab 64, 2 KV heads of 4 query heads x 8 dims, d_ff 48, width 32."""
  assert len(jax.devices()) == 8
  params = tiny_params()
  for (data, model), wqkv in (((2, 4), P()), ((4, 2), P('model'))):
    mesh = sharding.make_mesh(data, model)
    got = sharding.describe(params, sharding.target_shardings(mesh, params))
    expected = {
        "['embed']": P('model', None),  # vocab-parallel: 64 % model == 0
        "['final_norm']": P(None),
        "['layers'][0]['attn_norm']": P(None),
        "['layers'][0]['mlp_norm']": P(None),
        # 2 KV heads split over model=2, replicated over model=4 (4 does not divide 2)
        "['layers'][0]['wqkv']": P(*wqkv, None, None, None) if wqkv else P(None, None, None,
                                                                             None),
        "['layers'][0]['wo']": P(None, 'model'),  # 4 heads x 8 = 32 columns
        "['layers'][0]['w_gate_up']": P(None, 'model', None),  # d_ff 48
        "['layers'][0]['w_down']": P(None, 'model'),
    }
    for name, spec in expected.items():
      assert got[name] == str(spec), (data, model, name, got[name], spec)
  dparams = tiny_drafters.bundle_for((TINY, params))['drafter1']
  mesh = sharding.make_mesh(2, 4)
  got = sharding.describe(dparams, sharding.drafter_shardings(mesh, dparams))
  assert got["['fc']"] == str(P(None, 'model')), got["['fc']"]  # 2 x 32 feature columns
  assert got["['mask_embed']"] == str(P(None))
  for bad, match in (((3, 3), 'does not fit the 8 devices'), ((-1, -1), 'both be -1'),
                     ((-1, 3), 'does not fit')):
    try:
      sharding.make_mesh(*bad)
    except ValueError as e:
      assert match in str(e), (bad, e)
    else:
      raise AssertionError(f'mesh {bad} was accepted')
  try:
    sharding.check_batch(sharding.make_mesh(4, 2), 6)
  except ValueError as e:
    assert 'train.batch_size=6 is not divisible by mesh.data=4' in str(e), e
  else:
    raise AssertionError('batch 6 on mesh.data=4 was accepted')


def check_train(tiny_folder, distill_dir, workdir):
  """The same tiny run on one device and on 2x4 / 4x2 meshes: same losses and parameters."""
  from tests.train import test_training  # pylint: disable=import-outside-toplevel
  from d2sd_jax.train import training  # pylint: disable=import-outside-toplevel
  out = {}
  for data, model in ((1, 1), (2, 4), (4, 2)):
    c = test_training.tiny_config(tiny_folder, distill_dir, os.path.join(workdir, f'{data}x{model}'),
                                  steps=4)
    c.train.batch_size = 4
    c.mesh.update(data=data, model=model)
    out[(data, model)] = training.run(c)
  ref = out[(1, 1)]
  for key in ((2, 4), (4, 2)):
    np.testing.assert_allclose(out[key]['loss'], ref['loss'], rtol=1e-5)
    for x, y in zip(jax.tree.leaves(ref['params']), jax.tree.leaves(out[key]['params'])):
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-4)
  wqkv = out[(4, 2)]['params']['layers'][0]['wqkv']
  spec = tuple(wqkv.sharding.spec) + (None,) * (wqkv.ndim - len(wqkv.sharding.spec))
  assert spec == ('model', None, None, None), spec  # the trained drafter stays split


def check_decode():
  """d2sd generation with target and drafters split over a 2x4 mesh = unsharded, token for
  token; the whole generation is still one while_loop program."""
  params = tiny_params()
  bundle = tiny_drafters.trained_bundle((TINY, params))  # drafts are accepted, on branches too
  spec = SP.SpecSettings(AR.GenerationSettings(max_new_tokens=20, eos_ids=(), pad_id=0),
                         method='d2sd', gamma=5, n_branches=2, drafter1=tiny_drafters.DCFG,
                         drafter2=tiny_drafters.DCFG2)
  ar, plain, _ = loop_checks.run_both(TINY, bundle, tiny_drafters.PROMPTS, spec)
  mesh = sharding.make_mesh(2, 4)
  sharded = {'target': jax.device_put(params, sharding.target_shardings(mesh, params))}
  for name in ('drafter1', 'drafter2'):
    sharded[name] = jax.device_put(bundle[name], sharding.drafter_shardings(mesh, bundle[name]))
  assert sharded['target']['embed'].sharding.spec == P('model', None)
  ar2, split, state = loop_checks.run_both(TINY, sharded, tiny_drafters.PROMPTS, spec)
  assert split == plain == ar, (split, plain, ar)
  assert ar2 == ar
  assert int(state.accepted_hist_BxC[:, 1:].sum()) >= int(state.cycles_B.sum()) // 2


def check_kernels():
  """The TPU layer kernels' mesh forms through Pallas' interpreter on a 2x4 mesh: the MLP with
  F split over 'model' (the residual inside the first shard's sum, the sums reduced) and the
  output projection with E split (the residual inside the first shard's product) equal one
  device's, and a kernel that kept the residual on every shard, or on none, would not."""
  from d2sd_jax.kernels import fused  # pylint: disable=import-outside-toplevel
  D, F, E = 256, 1024, 512
  ks = jax.random.split(jax.random.key(0), 5)
  x = 3.0 * jax.random.normal(ks[0], (2, 8, D))
  lp = {'mlp_norm': 1.0 + 0.1 * jax.random.normal(ks[1], (D,)),
        'w_gate_up': 0.05 * jax.random.normal(ks[2], (2, F, D)),
        'w_down': 0.05 * jax.random.normal(ks[3], (D, F))}
  attn = jax.random.normal(ks[4], (2, 8, E))
  wo = 0.05 * jax.random.normal(ks[1], (D, E))
  want_mlp = fused.mlp(x, lp, eps=1e-6, interpret=True)
  want_out = fused.out_projection(x, attn, wo)
  mesh = sharding.make_mesh(2, 4)
  put = lambda a, *spec: jax.device_put(a, jax.sharding.NamedSharding(mesh, P(*spec)))
  split = {'mlp_norm': put(lp['mlp_norm']), 'w_gate_up': put(lp['w_gate_up'], None, 'model'),
           'w_down': put(lp['w_down'], None, 'model')}
  with sharding.tracing_under(mesh):
    got_mlp = jax.jit(lambda x_, p_: fused.mlp(x_, p_, eps=1e-6, interpret=True))(
        put(x, 'data'), split)
    got_out = jax.jit(fused.out_projection)(put(x, 'data'), put(attn, 'data', None, 'model'),
                                            put(wo, None, 'model'))
  scale = float(jnp.abs(want_mlp - x).max())
  np.testing.assert_allclose(got_mlp, want_mlp, rtol=0, atol=1e-5 * scale)
  np.testing.assert_allclose(got_out, want_out, rtol=0, atol=1e-5 * float(jnp.abs(want_out).max()))
  assert float(jnp.abs(got_mlp - x).max()) > 0.1 * scale  # the MLP's part is there


def check_split_residual():
  """A verification pass (forward with write_cache=False, two layers) through the TPU layer
  kernels in Pallas' interpreter, on one device and on a 2x4 mesh with the residual stream
  split over its width (`fused.residual_split`: 512 columns, 128 per device): the same logits,
  new K/V and features, and the program takes the split form: a float32 reduce-scatter per
  output projection and MLP, the normed rows all-gathered, the rows never all-reduced. A layer
  that added the residual on every shard, normed each device's columns by their own mean
  square, or gathered the columns out of order would differ."""
  from d2sd_jax.models import target as model_lib  # pylint: disable=import-outside-toplevel
  cfg = model_lib.ModelConfig(vocab_size=64, d_model=512, n_layers=2, n_heads=8, n_kv_heads=4,
                              head_dim=128, d_ff=1024, rope_base=500.0, qk_norm=True)
  params = model_lib.init_params(cfg, jax.random.key(0))
  B, T, S = 2, 8, 128
  ks = jax.random.split(jax.random.key(1), 4)
  cache = [{'k': jax.random.normal(k1, (B, cfg.n_kv_heads, S, cfg.head_dim)),
            'v': jax.random.normal(k2, (B, cfg.n_kv_heads, S, cfg.head_dim))}
           for k1, k2 in (jax.random.split(ks[0]), jax.random.split(ks[1]))]
  lengths = jnp.array([37, 90])
  tokens = jax.random.randint(ks[2], (B, T), 0, cfg.vocab_size)
  tree = jax.random.bernoulli(ks[3], 0.4, (B, T, T)) | jnp.eye(T, dtype=bool)
  positions = lengths[:, None] + jnp.arange(T)

  def kernel_layer(cfg_, x, lp, kv, pos, ctx, tree_, write_start_B=None, block_size=None,
                   fresh=False, new_kv_only=False):
    assert not fresh
    return model_lib._layer_kernels(  # pylint: disable=protected-access
        cfg_, x, lp, kv, pos, ctx, tree_, write_start_B, block_size, interpret=True,
        new_kv_only=new_kv_only)

  def verify(p, c):
    hidden, new_kv, feats = model_lib.forward(p, cfg, tokens, positions, c, lengths, tree,
                                              feature_layers=(1, 2), write_cache=False)
    return model_lib.logits(p, cfg, hidden), new_kv, feats

  model_lib.layer = kernel_layer  # the TPU form on this CPU
  want = jax.jit(verify)(params, cache)
  mesh = sharding.make_mesh(2, 4)
  split = jax.device_put(params, sharding.target_shardings(mesh, params))
  kv_spec = jax.sharding.NamedSharding(mesh, sharding.spec_for(cache[0]['k'].shape,
                                                               ('batch', 'kv_heads'), mesh))
  split_cache = jax.device_put(cache, kv_spec)
  with sharding.tracing_under(mesh):
    program = jax.jit(verify).lower(split, split_cache).compile()
    got = program(split, split_cache)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=0, atol=2e-5 * float(jnp.abs(w).max()))
  from d2sd_jax.perf import hlo  # pylint: disable=import-outside-toplevel
  text = program.as_text()
  coll = hlo.collectives(text)['by_kind']
  # per layer two reduce-scatters of the partial sums, [1 row per data shard, 8 tokens, 128
  # columns], and two all-gathers of the normed rows, in the weights' dtype (float32 here;
  # bfloat16 on a TPU: tests/kernels/test_fused.py), then one of the stream, whole before the
  # final norm (`partition.whole_width`); the rows are never all-reduced
  assert len(re.findall(r'f32\[1,8,128\]\S* reduce-scatter', text)) == 2 * cfg.n_layers, coll
  assert len(re.findall(r'f32\[1,8,512\]\S* all-gather', text)) == 2 * cfg.n_layers + 1, coll
  assert not re.search(r'f32\[1,8,512\]\S* all-reduce', text), coll


def _rss_bytes(field: str) -> int:
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith(field + ':'):
        return int(line.split()[1]) * 1024
  raise RuntimeError(f'{field} not in /proc/self/status')


def check_load(folder):
  """A bfloat16 checkpoint (written by test_sharding.write_wide_checkpoint) loaded onto a 1x8
  mesh: each device holds about 1/8 of the bytes, and the host memory the load adds at its peak
  stays below the checkpoint's float32 size (no float32 copy, no whole model on one device)."""
  from d2sd_jax.formats import checkpoints  # pylint: disable=import-outside-toplevel
  from d2sd_jax.formats import loaders
  import json  # pylint: disable=import-outside-toplevel
  with open(os.path.join(folder, 'config.json')) as f:
    n_params = json.load(f)['n_params']
  mesh = sharding.make_mesh(1, 8)
  base = _rss_bytes('VmRSS')
  try:  # reset the peak (VmHWM) to the current RSS, so it measures the load alone
    with open('/proc/self/clear_refs', 'w') as f:
      f.write('5')
  except OSError:
    pass
  target = loaders.load_target(folder, 'bfloat16', mesh)
  jax.block_until_ready(target.params)
  peak = _rss_bytes('VmHWM') - base
  per_device = {d: 0 for d in jax.devices()}
  for x in jax.tree.leaves(target.params):
    assert x.dtype == jax.numpy.bfloat16, x.dtype
    for shard in x.addressable_shards:
      per_device[shard.device] += shard.data.nbytes
  total = sum(x.nbytes for x in jax.tree.leaves(target.params))
  float32_bytes = 4 * n_params
  print(json.dumps({'params': n_params, 'float32_bytes': float32_bytes, 'bf16_bytes': total,
                    'max_device_bytes': max(per_device.values()),
                    'min_device_bytes': min(per_device.values()),
                    'peak_host_bytes_during_load': peak}))
  assert total == 2 * n_params
  assert max(per_device.values()) <= 1.02 * total / 8, per_device  # replicated norms: ~0.1 %
  assert min(per_device.values()) >= 0.98 * total / 8, per_device
  assert peak < float32_bytes, (peak, float32_bytes)
  # Same values and identity as an ordinary float32 load, once measured.
  fp = checkpoints.target_fingerprint(target)
  reference = loaders.load_target(folder, 'float32')
  assert checkpoints.target_fingerprint(reference) == fp
  for a, b in zip(jax.tree.leaves(target.params), jax.tree.leaves(reference.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b).astype(a.dtype))


if __name__ == '__main__':
  name, args = sys.argv[1], sys.argv[2:]
  {'rules': check_rules, 'train': check_train, 'decode': check_decode,
   'load': check_load, 'kernels': check_kernels,
   'split_residual': check_split_residual}[name](*args)
  print(f'ok {name}')
