"""The functional target: cached decoding, tree verification, features, batching, dtypes."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from d2sd_jax.models import attention as A
from d2sd_jax.models import target as M


@functools.partial(jax.jit, static_argnums=(0,))
def full_logits(cfg, params, tokens_BxT):
  """Plain causal forward over whole sequences with a fresh cache (the reference)."""
  B, T = tokens_BxT.shape
  cache = M.init_cache(cfg, B, T)
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  h, _, _ = M.forward(params, cfg, tokens_BxT, pos, cache, jnp.zeros((B,), jnp.int32))
  return M.logits(params, cfg, h)


def test_cached_decoding_matches_full_forward(tiny):
  cfg, params = tiny
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 12), 0, cfg.vocab_size)
  ref = full_logits(cfg, params, tokens)
  # Prefill 5 tokens, then feed one token at a time through the cache.
  cache = M.init_cache(cfg, 2, 16)
  h, cache, _ = M.forward(params, cfg, tokens[:, :5], jnp.broadcast_to(jnp.arange(5), (2, 5)),
                          cache, jnp.zeros((2,), jnp.int32))
  got = [M.logits(params, cfg, h)]

  @jax.jit
  def step(cache, token_Bx1, cache_len_B):
    h, cache, _ = M.forward(params, cfg, token_Bx1, cache_len_B[:, None], cache, cache_len_B)
    return M.logits(params, cfg, h), cache

  for t in range(5, 12):
    logits, cache = step(cache, tokens[:, t:t + 1], jnp.full((2,), t, jnp.int32))
    got.append(logits)
  np.testing.assert_allclose(jnp.concatenate(got, axis=1), ref, rtol=1e-4, atol=1e-4)


def random_tree(rng, n):
  """parents[i] < i (or -1 for a root), the ancestor-or-self mask and depths."""
  parents = np.array([-1] + [int(rng.integers(-1, i)) for i in range(1, n)])
  anc = np.eye(n, dtype=bool)
  depth = np.zeros(n, int)
  for i in range(n):
    if parents[i] >= 0:
      anc[i] |= anc[parents[i]]
      depth[i] = depth[parents[i]] + 1
  return parents, anc, depth


def root_path(parents, i):
  path = []
  while i >= 0:
    path.append(i)
    i = parents[i]
  return path[::-1]


def test_tree_verification_matches_each_root_path(tiny):
  cfg, params = tiny
  rng = np.random.default_rng(0)
  ctx_lens = [7, 4]  # two rows with different committed lengths
  n = 10
  ctx = rng.integers(0, cfg.vocab_size, (2, 7))
  trees = [random_tree(rng, n) for _ in range(2)]
  nodes = rng.integers(0, cfg.vocab_size, (2, n))
  cache = M.init_cache(cfg, 2, 32)
  # Stale junk past each row's context must never be attended to.
  cache = jax.tree.map(lambda x: x + 100.0, cache)
  h, cache, _ = M.forward(params, cfg, jnp.asarray(ctx), jnp.broadcast_to(jnp.arange(7), (2, 7)),
                          cache, jnp.zeros((2,), jnp.int32))
  cache_len = jnp.asarray(ctx_lens, jnp.int32)
  positions = jnp.asarray([ctx_lens[b] + trees[b][2] for b in range(2)])
  tree_mask = jnp.asarray(np.stack([trees[b][1] for b in range(2)]))
  h, _, _ = M.forward(params, cfg, jnp.asarray(nodes), positions, cache, cache_len, tree_mask)
  tree_logits = M.logits(params, cfg, h)
  for b in range(2):
    for i in range(n):
      seq = list(ctx[b, :ctx_lens[b]]) + [nodes[b, j] for j in root_path(trees[b][0], i)]
      padded = seq + [0] * (20 - len(seq))  # causal: the padding after it changes nothing
      ref = full_logits(cfg, params, jnp.asarray([padded]))[0, len(seq) - 1]
      # float32 summation order differs between the two programs. Its error scales with the
      # activations (the residual stream reaches ~400 here), not with each logit: 2e-5 of the
      # row's largest logit (10-18) on one CPU, so 1e-4 of it. A wrong mask or position moves
      # the logits by 0.3 of it and more.
      np.testing.assert_allclose(tree_logits[b, i], ref, rtol=0,
                                 atol=1e-4 * float(jnp.max(jnp.abs(ref))),
                                 err_msg=f'row {b} node {i}')


def test_right_padded_batch_matches_single_rows(tiny):
  cfg, params = tiny
  rng = np.random.default_rng(1)
  lens = [9, 3, 6]
  tokens = rng.integers(0, cfg.vocab_size, (3, 9))
  h, _, _ = M.forward(params, cfg, jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(9), (3, 9)),
                      M.init_cache(cfg, 3, 16), jnp.zeros((3,), jnp.int32))
  batched = M.logits(params, cfg, h)
  for b, n in enumerate(lens):
    ref = full_logits(cfg, params, jnp.asarray(tokens[b:b + 1, :n]))[0]
    np.testing.assert_allclose(batched[b, :n], ref, rtol=1e-4, atol=1e-4)


def test_feature_layers_are_the_residual_stream(tiny):
  cfg, params = tiny
  tokens = jnp.asarray([[3, 5, 7, 11]])
  pos = jnp.arange(4)[None]
  _, _, feats = M.forward(params, cfg, tokens, pos, M.init_cache(cfg, 1, 8), jnp.zeros(1, jnp.int32),
                          feature_layers=(0, 2, 1))
  assert feats.shape == (1, 4, 3, cfg.d_model)
  np.testing.assert_allclose(feats[:, :, 0], params['embed'][tokens])
  # Layer 2 is the last layer: its output, normalised, is the final hidden state.
  h, _, _ = M.forward(params, cfg, tokens, pos, M.init_cache(cfg, 1, 8), jnp.zeros(1, jnp.int32))
  np.testing.assert_allclose(M.rms_norm(feats[:, :, 1], params['final_norm'], cfg.norm_eps), h,
                             rtol=1e-4, atol=1e-4)


def test_bfloat16_tracks_float32(tiny):
  # The default init scale: the context-sensitive tiny model's large activations make bfloat16
  # rounding chaotic, which says nothing about the bfloat16 code path.
  cfg, _ = tiny
  params = M.init_params(cfg, jax.random.PRNGKey(0))
  cfg16 = M.ModelConfig(**{**cfg.__dict__, 'dtype': 'bfloat16'})  # a distinct static config
  params16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  tokens = jnp.asarray([[1, 2, 3, 4, 5, 6]])
  ref = full_logits(cfg, params, tokens)
  got = full_logits(cfg16, params16, tokens)
  assert got.dtype == jnp.float32
  assert float(jnp.max(jnp.abs(got - ref))) < 0.1 * float(jnp.max(jnp.abs(ref)))


def test_invalid_model_config():
  with pytest.raises(ValueError, match='multiple of n_kv_heads'):
    M.ModelConfig(vocab_size=8, d_model=8, n_layers=1, n_heads=3, n_kv_heads=2, head_dim=4, d_ff=8)
  with pytest.raises(ValueError, match='dtype'):
    M.ModelConfig(vocab_size=8, d_model=8, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=4,
                  d_ff=8, dtype='float16')


def _attention_inputs(key, B=2, T=12, H=4, Hkv=2, hd=8, S=10, dtype=jnp.float32):
  ks = jax.random.split(key, 5)
  q = jax.random.normal(ks[0], (B, T, H, hd))
  k_new, v_new = (jax.random.normal(k, (B, Hkv, T, hd)).astype(dtype) for k in ks[1:3])
  kv = {'k': jax.random.normal(ks[3], (B, Hkv, S, hd)).astype(dtype),
        'v': jax.random.normal(ks[4], (B, Hkv, S, hd)).astype(dtype)}
  return q, k_new, v_new, kv


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_blockwise_attention_equals_the_dense_block_diagonal_mask(dtype):
  """block_size=G computes exactly what a dense block-diagonal [T, T] mask gives (per-position
  context lengths, as training's anchors make them), without that mask; also with a bfloat16
  cache, compiled (XLA:CPU refuses bfloat16 x bfloat16 -> float32 dots, so none may appear)."""
  B, T, G, S = 2, 12, 4, 10
  q, k_new, v_new, kv = _attention_inputs(jax.random.PRNGKey(0), B=B, T=T, S=S, dtype=dtype)
  ctx_len_BxT = jax.random.randint(jax.random.PRNGKey(1), (B, T), 1, S + 1)
  ctx_mask = jnp.arange(S)[None, None, :] < ctx_len_BxT[..., None]
  block_of = jnp.arange(T) // G
  dense = jnp.broadcast_to(block_of[:, None] == block_of[None, :], (B, T, T))
  ref = jax.jit(A.attention)(q, k_new, v_new, kv, ctx_mask, dense)
  got = jax.jit(A.attention, static_argnums=(6,))(q, k_new, v_new, kv, ctx_mask, None, G)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
  # a wrong block size is a different law (the test can tell)
  other = A.attention(q, k_new, v_new, kv, ctx_mask, None, block_size=T // 2 if G != T // 2 else 2)
  assert np.abs(np.asarray(other) - np.asarray(ref)).max() > 1e-3


def test_context_windows():
  assert A.MIN_WINDOW == 256
  assert A.context_windows(640) == (256, 512, 640)
  assert A.context_windows(2048) == (256, 512, 1024, 2048)
  assert A.context_windows(256) == (256,) and A.context_windows(100) == (100,)


@pytest.mark.parametrize('form', ['tree', 'blocks', 'per_token_context'])
@pytest.mark.parametrize('ctx_lens', [(3, 2), (3, 6), (8, 2), (9, 1), (17, 4), (20, 20)])
def test_attention_reads_the_smallest_window_holding_every_rows_context(monkeypatch, form,
                                                                        ctx_lens):
  """With windows (4, 8, 16, 20) over 20 slots, attention reads only the first W slots, W the
  smallest window holding every row's context: NaN past W changes nothing (a NaN value read
  under a zero probability would give NaN), and the result equals the whole cache's."""
  monkeypatch.setattr(A, 'MIN_WINDOW', 4)
  B, T, G, S = 2, 8, 4, 20
  assert A.context_windows(S) == (4, 8, 16, 20)
  q, k_new, v_new, kv = _attention_inputs(jax.random.PRNGKey(5), B=B, T=T, S=S)
  lens = jnp.asarray(ctx_lens)
  if form == 'per_token_context':  # [B, T, S]: token t sees one slot less than the row's context
    ctx_mask = jnp.arange(S)[None, None, :] < (lens[:, None] - (jnp.arange(T) % 2))[..., None]
  else:
    ctx_mask = jnp.arange(S)[None, :] < lens[:, None]
  tree = None if form == 'blocks' else M.causal_mask(B, T)
  block = G if form == 'blocks' else None
  W = min(w for w in (4, 8, 16, 20) if w >= max(ctx_lens))
  poisoned = {n: x.at[:, :, W:].set(jnp.nan) for n, x in kv.items()}
  got = jax.jit(A.attention, static_argnums=(6,))(q, k_new, v_new, poisoned, ctx_mask, tree,
                                                   block)
  whole = A._attend_window(S, q, k_new, v_new, kv,  # pylint: disable=protected-access
                           ctx_mask if ctx_mask.ndim == 3 else ctx_mask[:, None], tree, block)
  np.testing.assert_allclose(got, whole, rtol=1e-5, atol=1e-6)
  if W > 4:  # the next smaller window would drop context: the comparison can tell
    smaller = max(w for w in (4, 8, 16, 20) if w < W)
    cut = A._attend_window(smaller, q, k_new, v_new, kv,  # pylint: disable=protected-access
                           ctx_mask if ctx_mask.ndim == 3 else ctx_mask[:, None], tree, block)
    assert np.abs(np.asarray(cut) - np.asarray(whole)).max() > 1e-3


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_fresh_attention_equals_causal_attention_over_an_empty_cache(dtype):
  """fresh=True (jax.nn.dot_product_attention, causal among the new tokens) = the general form
  with every cache slot masked out."""
  B, T, S = 2, 12, 16
  q, k_new, v_new, kv = _attention_inputs(jax.random.PRNGKey(2), B=B, T=T, S=S, dtype=dtype)
  ref = A.attention(q, k_new, v_new, kv, jnp.zeros((B, S), bool), M.causal_mask(B, T))
  got = A.attention(q, k_new, v_new, kv, jnp.zeros((B, S), bool), None, fresh=True)
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  np.testing.assert_allclose(got, ref, rtol=tol, atol=tol)


def test_prefill_through_fresh_attention_equals_the_general_form(tiny):
  """forward(fresh=True) writes the same cache and gives the same hidden states and features."""
  cfg, params = tiny
  tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 9), 0, cfg.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(9), (2, 9))
  outs = [M.forward(params, cfg, tokens, pos, M.init_cache(cfg, 2, 16), jnp.zeros((2,), jnp.int32),
                    feature_layers=(0, 1, 2), fresh=fresh) for fresh in (False, True)]
  # Two programs (a different attention): float32 rounding relative to each array's scale (the
  # features reach ~400), 1.2e-6 of it at most on one CPU. Attention that is not causal, or a
  # cache slot left unwritten, is off by a good part of the scale.
  for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(a))))


def test_columns_for_covers_the_few_row_products_on_a_cpu():
  assert jax.default_backend() == 'cpu'
  lo, hi = M.COLUMN_ROWS
  assert [M.columns_for(n) for n in (1, lo, 8, hi, hi + 1)] == [False, True, True, True, False]


@pytest.mark.parametrize('tied', [True, False])
def test_column_products_change_only_the_summation_order(tiny, tied, monkeypatch):
  """`linear`'s column form (a few rows on a CPU): a verified tree and a prefill give the row
  form's logits, cache and features; a one-row step is the same program, bit for bit."""
  cfg = dataclasses.replace(tiny[0], tie_embeddings=tied)
  params = M.init_params(cfg, jax.random.PRNGKey(3), scale=1.2)
  assert ('lm_head' in params) == (not tied)
  rng = np.random.default_rng(2)
  ctx = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 6)))
  _, anc, depth = random_tree(rng, 7)
  nodes = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 7)))

  def run(p):
    h, cache, _ = M.forward(p, cfg, ctx, jnp.broadcast_to(jnp.arange(6), (2, 6)),
                            M.init_cache(cfg, 2, 16), jnp.zeros((2,), jnp.int32))
    six = jnp.full((2,), 6, jnp.int32)
    tree_h, tree_cache, feats = M.forward(
        p, cfg, nodes, six[:, None] + jnp.asarray(depth)[None], cache, six,
        jnp.broadcast_to(jnp.asarray(anc), (2, 7, 7)), feature_layers=(1, 2))
    return M.logits(p, cfg, h), M.logits(p, cfg, tree_h), tree_cache, feats, cache

  def step(p, cache):  # one row: an AR step
    six = jnp.full((1,), 6, jnp.int32)
    h, _, _ = M.forward(p, cfg, nodes[:1, :1], six[:, None], cache, six)
    return M.logits(p, cfg, h)

  outs, steps, shared = {}, {}, None
  for name, rows in (('columns', M.COLUMN_ROWS), ('rows', (2, 0))):
    monkeypatch.setattr(M, 'COLUMN_ROWS', rows)
    jax.clear_caches()  # `run` is traced again under the new COLUMN_ROWS
    # Counted in the program lowered for this CPU (linear's platform choice resolved there):
    # qkv, o, gate/up and down per layer, and the LM head: for the prefill and for the tree
    barriers = jax.jit(run).lower(params).as_text().count('optimization_barrier')
    assert barriers == (2 * (4 * cfg.n_layers + 1) if name == 'columns' else 0), barriers
    outs[name] = jax.jit(run)(params)
    if shared is None:  # one cache for both steps: each run's own prefill differs in rounding
      shared = [{k: v[:1] for k, v in kv.items()} for kv in outs[name][4]]
    steps[name] = (str(jax.make_jaxpr(step)(params, shared)), jax.jit(step)(params, shared))
  for a, b in zip(jax.tree.leaves(outs['columns'][:4]), jax.tree.leaves(outs['rows'][:4])):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
  # One row is outside COLUMN_ROWS either way: the step traces to one program, which gives the
  # same logits on the same cache.
  assert steps['columns'][0] == steps['rows'][0]
  np.testing.assert_array_equal(steps['columns'][1], steps['rows'][1])
