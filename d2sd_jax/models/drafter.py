"""The diffusion drafter (one architecture; drafter 1 and drafter 2 differ only in training).

A block of gamma positions [anchor, t_1 .. t_l, MASK ...] is denoised in one bidirectional pass.
The drafter is conditioned on the target: hidden states of `feature_layers` for the committed
context are concatenated, projected (linear + RMSNorm) and turned into extra keys/values in every
drafter layer, which the block attends to like a KV prefix (DFlash). Token embedding and LM head
are the target's (frozen, not part of the drafter's parameters); the mask embedding is the
drafter's own.

Drafter parameters (a plain pytree):
  fc [W, n_feat * D_target], fc_norm [W], mask_embed [D_target], final_norm [W],
  layers: list of target-style layer dicts (see model.py), width W,
  in_proj [W, D_target], out_proj [D_target, W]   (only when W != D_target)
  head_ids [N] int32   (only when head_vocab = N > 0: the drafter predicts only these tokens,
                        the rows of the target's head it uses; fixed, chosen from the training
                        data by `choose_head_ids`, not trained)
The context K/V cache has the target cache's layout: per layer {'k', 'v'}: [B, KVH, S, hd].
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from d2sd_jax.kernels import partition
from d2sd_jax.models import target as model_lib
from d2sd_jax.models import sampling as sampling_lib


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
  gamma: int = 16  # block length: anchor + gamma-1 drafted positions
  n_layers: int = 2
  d_model: int = 576  # width W; a width other than the target's adds in/out projections
  n_heads: int = 9
  n_kv_heads: int = 3
  head_dim: int = 64
  d_ff: int = 1536
  feature_layers: tuple[int, ...] = (1, 10, 20, 29)  # target hidden states, HF numbering
  rope_base: float = 100000.0
  norm_eps: float = 1e-5
  dtype: str = 'float32'
  confidence_temperature: float = 1.0  # c = max softmax(logits / T), T fitted on held-out data
  head_vocab: int = 0  # 0: the target's whole vocabulary; N: only N tokens (a cheaper head)
  qk_norm: bool = False  # per-head RMSNorm of queries and keys (Qwen3 layers, DFlash drafters)
  # Best-first trees' reliability curves, fitted on held-out prompts with this drafter
  # (scripts/calibrate_nodes.py; the drafter folder's node_calibration.json): ((proposer,
  # ((estimates, accepted rates) per depth group)), ...) for the proposers the drafter scores
  # (drafter 1: its own nodes and prompt lookup's; drafter 2: its re-drafts). Empty: raw scores.
  node_calibration: tuple = ()

  def __post_init__(self):
    for name in ('n_layers', 'd_model', 'n_heads', 'n_kv_heads', 'head_dim', 'd_ff'):
      if getattr(self, name) < 1:
        raise ValueError(f'drafter.{name}={getattr(self, name)} must be >= 1')
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f'drafter.n_heads={self.n_heads} must be a multiple of drafter.n_kv_heads='
                       f'{self.n_kv_heads}')
    if self.head_dim % 2:
      raise ValueError(f'drafter.head_dim={self.head_dim} must be even (RoPE)')
    if self.gamma < 2:
      raise ValueError(f'gamma={self.gamma} must be >= 2 (the anchor plus one drafted token)')
    if not self.feature_layers:
      raise ValueError('feature_layers must name at least one target layer')
    if self.head_vocab < 0:
      raise ValueError(f'head_vocab={self.head_vocab} must be 0 (whole vocabulary) or > 0')

  def layer_config(self, vocab_size: int) -> model_lib.ModelConfig:
    return model_lib.ModelConfig(
        vocab_size=vocab_size, d_model=self.d_model, n_layers=self.n_layers,
        n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim,
        d_ff=self.d_ff, rope_base=self.rope_base, norm_eps=self.norm_eps,
        qk_norm=self.qk_norm, dtype=self.dtype)

  def check_target(self, tcfg: model_lib.ModelConfig) -> None:
    bad = [i for i in self.feature_layers if not 0 <= i <= tcfg.n_layers]
    if bad:
      raise ValueError(f'feature_layers {bad} outside the target\'s 0..{tcfg.n_layers} hidden '
                       'states: pick layers the target has')
    if self.head_vocab > tcfg.vocab_size:
      raise ValueError(f'head_vocab={self.head_vocab} exceeds the target\'s vocabulary of '
                       f'{tcfg.vocab_size}: use at most that, or 0 for all of it')


def init_params(dcfg: DrafterConfig, tcfg: model_lib.ModelConfig, key: jax.Array) -> dict:
  dcfg.check_target(tcfg)
  lcfg = dcfg.layer_config(tcfg.vocab_size)
  k_layers, k_fc, k_mask, k_in, k_out = jax.random.split(key, 5)
  layers = model_lib.init_params(lcfg, k_layers, scale=0.1)['layers']
  for lp in layers:  # start as a near-identity residual stack
    for name in ('attn_norm', 'mlp_norm', 'q_norm', 'k_norm'):
      if name in lp:
        lp[name] = jnp.ones_like(lp[name])
  W, Dt, F = dcfg.d_model, tcfg.d_model, len(dcfg.feature_layers) * tcfg.d_model
  dt = lcfg.jnp_dtype
  params = {
      'fc': (jax.random.normal(k_fc, (W, F)) * F**-0.5).astype(dt),
      'fc_norm': jnp.ones((W,), dt),
      'mask_embed': (jax.random.normal(k_mask, (Dt,)) * 0.02).astype(dt),
      'final_norm': jnp.ones((W,), dt),
      'layers': layers,
  }
  if dcfg.head_vocab:
    params['head_ids'] = jnp.arange(dcfg.head_vocab, dtype=jnp.int32)  # see choose_head_ids
  if W != Dt:
    params['in_proj'] = (jax.random.normal(k_in, (W, Dt)) * Dt**-0.5).astype(dt)
    params['out_proj'] = (jax.random.normal(k_out, (Dt, W)) * W**-0.5).astype(dt)
  return params


def choose_head_ids(response_counts_V, prompt_counts_V, n: int) -> jax.Array:
  """The drafter's n head tokens, ascending: the most frequent in the training responses (what
  it must predict), then in the prompts (what responses copy), then the lowest ids (BPE ids
  run roughly from frequent to rare)."""
  resp, prompt = jnp.asarray(response_counts_V), jnp.asarray(prompt_counts_V)
  order = jnp.lexsort((jnp.arange(resp.shape[0]), -prompt, -resp))
  return jnp.sort(order[:n]).astype(jnp.int32)


def split_fixed(dparams: dict, frozen: tuple[str, ...] = ()) -> tuple[dict, dict]:
  """(trainable, fixed) parts of drafter parameters: head_ids is data, not a weight; `frozen`
  names more top-level parameters kept as they are (a DFlash drafter's mask_embed: the
  target's embedding of its mask token, which its export names)."""
  keep = ('head_ids',) + tuple(frozen)
  fixed = {k: v for k, v in dparams.items() if k in keep}
  return {k: v for k, v in dparams.items() if k not in keep}, fixed


def for_decoding(dparams: dict, tparams: dict, tcfg: model_lib.ModelConfig) -> dict:
  """Drafter parameters with what decoding derives from them computed once, not every pass:
  the head's rows of the target's output matrix, gathered (`head_rows`, [n, D]; the gather
  alone was half of D2SD's drafting time on a CPU), and each layer's key and value rows of
  wqkv (`wkv`, [out, in]: the context needs no queries). Training keeps the plain parameters
  (the head follows the target's weights). Idempotent."""
  out = dict(dparams)
  if 'wkv' not in dparams['layers'][0]:
    # wqkv is [Hkv, Hg + 2, hd, D]: the last two of axis 1 are each KV head's key and value.
    out['layers'] = [dict(lp, wkv=lp['wqkv'][:, -2:].reshape(-1, lp['wqkv'].shape[-1]))
                     for lp in dparams['layers']]
  if 'head_ids' in dparams and 'head_rows' not in dparams:
    head_VxD = tparams['embed'] if tcfg.tie_embeddings else tparams['lm_head']
    out['head_rows'] = head_VxD[dparams['head_ids']]
  return out


def head_index(dparams: dict, tokens, vocab_size: int):
  """Where each token sits in the drafter's head (-1: the head cannot predict it)."""
  if 'head_ids' not in dparams:
    return tokens
  ids = dparams['head_ids']
  inverse = jnp.full((vocab_size,), -1, jnp.int32).at[ids].set(
      jnp.arange(ids.shape[0], dtype=jnp.int32))
  return inverse[tokens]


def init_context_cache(dcfg: DrafterConfig, batch: int, max_len: int) -> model_lib.Cache:
  return model_lib.init_cache(dcfg.layer_config(1), batch, max_len)


def context_kv(dparams, dcfg: DrafterConfig, features_BxNxF, positions_BxN):
  """Per-layer keys/values [B, KVH, N, hd] of context tokens from their target features."""
  lcfg = dcfg.layer_config(1)
  h_BxNxW = model_lib.rms_norm(
      model_lib.linear(features_BxNxF.astype(jnp.float32), dparams['fc']),
      dparams['fc_norm'], dcfg.norm_eps)
  out = []
  for lp in dparams['layers']:
    _, k, v = model_lib.qkv_projection(lcfg, lp, h_BxNxW, positions_BxN, keys_values_only=True)
    out.append({'k': k.transpose(0, 2, 1, 3), 'v': v.transpose(0, 2, 1, 3)})
  return out


def write_context(cache, dparams, dcfg: DrafterConfig, features_BxNxF, positions_BxN, start_B):
  """Appends N context tokens (their target features) at slots start_B .. start_B+N-1."""
  kvs = context_kv(dparams, dcfg, features_BxNxF, positions_BxN)
  return [{'k': model_lib.write_rows(c['k'], kv['k'], start_B),
           'v': model_lib.write_rows(c['v'], kv['v'], start_B)} for c, kv in zip(cache, kvs)]


def features_of(hidden_features_BxNxLxD):
  """Target features as the drafter takes them: the chosen layers concatenated."""
  B, N, L, D = hidden_features_BxNxLxD.shape
  return hidden_features_BxNxLxD.reshape(B, N, L * D)


def forward(dparams, dcfg: DrafterConfig, tparams, tcfg: model_lib.ModelConfig, tokens_BxQ,
            is_mask_BxQ, positions_BxQ, ctx_cache, ctx_mask, block_mask_BxQxQ,
            head_only: bool = False, remat: bool = False, block_size: int | None = None):
  """Logits [B, Q, V] (float32) for Q block positions (one or several blocks side by side).
  With a head_vocab subset they are -inf outside it; head_only=True returns [B, Q, N], the
  logits of the head's N tokens only (training and denoising: no vocabulary-sized tensors;
  without a subset N = V).

  ctx_mask: context slots each position may attend to: [B] lengths (the first ctx_mask[b]
  slots, decoding's case), [B, S] or [B, Q, S] (`model.attention`);
  block_mask_BxQxQ: which block positions see each other (all-ones within a block: the
  denoising is bidirectional); or None with block_size=G: consecutive blocks of G positions,
  bidirectional within each, computed block by block (`model.attention`: no [Q, Q] mask, work
  and memory grow as Q·G, not Q²). remat=True recomputes each layer's activations in the backward
  pass instead of keeping them (training memory for compute).
  """
  lcfg = dcfg.layer_config(tcfg.vocab_size)
  x_BxQxD = tparams['embed'][tokens_BxQ].astype(jnp.float32)  # float32 residual (model.py)
  x_BxQxD = jnp.where(is_mask_BxQ[..., None], dparams['mask_embed'].astype(x_BxQxD.dtype), x_BxQxD)
  if 'in_proj' in dparams:
    x_BxQxD = jnp.einsum('bqd,wd->bqw', x_BxQxD, dparams['in_proj'])
  layer = functools.partial(model_lib.layer, block_size=block_size)
  if remat:
    layer = jax.checkpoint(layer, static_argnums=(0,))
  for lp, kv in zip(dparams['layers'], ctx_cache):
    x_BxQxD, _ = layer(lcfg, x_BxQxD, lp, kv, positions_BxQ, ctx_mask, block_mask_BxQxQ)
  x_BxQxD = partition.whole_width(x_BxQxD)  # (as target.forward's)
  h = model_lib.rms_norm(x_BxQxD, dparams['final_norm'], dcfg.norm_eps)
  if 'out_proj' in dparams:
    h = jnp.einsum('bqw,dw->bqd', h, dparams['out_proj'])
  if 'head_ids' not in dparams:
    return model_lib.logits(tparams, tcfg, h)
  if 'head_rows' in dparams:  # `for_decoding`: the head's rows gathered once
    sub = model_lib.linear(h, dparams['head_rows'])
  else:
    head_VxD = tparams['embed'] if tcfg.tie_embeddings else tparams['lm_head']
    sub = jnp.einsum('bqd,nd->bqn', h, head_VxD[dparams['head_ids']]).astype(jnp.float32)
  if head_only:
    return sub
  full = jnp.full(sub.shape[:2] + (tcfg.vocab_size,), -jnp.inf, jnp.float32)
  return full.at[:, :, dparams['head_ids']].set(sub)


def denoise(dparams, dcfg: DrafterConfig, tparams, tcfg, tokens_BxQ, is_mask_BxQ, positions_BxQ,
            ctx_cache, ctx_mask, steps: int = 1, order: str = 'confidence', forbid_BxQ=None,
            topk: int = 0):
  """Fills the masked positions of Q / gamma blocks per row (side by side, each bidirectional
  within itself, all seeing the same context) in `steps` denoising passes.

  steps=1: one parallel pass. steps>1: each pass commits, in every block, the next ceil(M/steps)
  of its M masked positions, the most confident ones (`order='confidence'`) or the leftmost ones
  (`'left_to_right'`), and the next pass sees them. Confidence-ordered drafts are exact only as
  point masses (the verifier must treat them so); left-to-right ones come with their true
  conditionals.

  forbid_BxQ: a token id each position may not draft (-1: none); its probability is removed
  and the rest renormalised (the D2SD branches use it to never repeat the chain's token).

  Returns (tokens [B, Q], confidence [B, Q] = max prob when drafted (1 for given tokens),
  probs [B, Q, V] = the distribution each position was drafted from (one-hot for given tokens)).
  With topk = k > 0, also (log-probs [B, Q, k], token ids [B, Q, k]): each position's k likeliest
  tokens under its calibrated distribution softmax(logits / confidence_temperature), best first
  (a given token: itself with log-prob 0, then -inf); DDTree's per-position marginals.
  """
  if order not in ('confidence', 'left_to_right'):
    raise ValueError(f"order={order!r}: use 'confidence' or 'left_to_right'")
  if steps < 1:
    raise ValueError(f'steps={steps} must be >= 1')
  B, Q = tokens_BxQ.shape
  G = dcfg.gamma
  if Q % G:
    raise ValueError(f'{Q} block positions are not a whole number of gamma={G} blocks')
  nb = Q // G
  V = tcfg.vocab_size
  probs_out = jax.nn.one_hot(tokens_BxQ, V, dtype=jnp.float32)
  conf_out = jnp.ones((B, Q), jnp.float32)
  per_step = -(-jnp.sum(is_mask_BxQ.reshape(B, nb, G), axis=2) // steps)  # [B, nb], ceil
  # Work on the head's N tokens only (N = V without a head subset): every other token has
  # probability 0, and vocabulary-wide passes over [B, Q, V] cost the drafter more than its
  # layers. The full distribution is built only where a caller reads it (dflash_resample).
  head_ids = dparams.get('head_ids') if dparams is not None else None
  if forbid_BxQ is not None:
    forbid_BxQ = jnp.where(forbid_BxQ >= 0, head_index(dparams, forbid_BxQ, V), -1)
  tokens, is_mask = tokens_BxQ, is_mask_BxQ
  if topk:
    top_logp_out = jnp.where(jnp.arange(topk) == 0, 0.0, -jnp.inf) * jnp.ones((B, Q, 1))
    top_ids_out = jnp.broadcast_to(tokens_BxQ[..., None], (B, Q, topk)).astype(jnp.int32)
  for _ in range(steps):
    logits = forward(dparams, dcfg, tparams, tcfg, tokens, is_mask, positions_BxQ, ctx_cache,
                     ctx_mask, None, head_only=True, block_size=G)  # [B, Q, N]
    N = logits.shape[-1]
    if forbid_BxQ is not None:
      logits = jnp.where(jnp.arange(N) == forbid_BxQ[..., None], -jnp.inf, logits)
    probs = jax.nn.softmax(logits, axis=-1)
    if head_ids is not None:
      probs = jnp.zeros((B, Q, V), jnp.float32).at[:, :, head_ids].set(probs)
    # max softmax(logits / T) and the argmax, in one reduction where it is fused (TPU, GPU)
    conf, pred = sampling_lib.confidence_and_argmax(logits, dcfg.confidence_temperature)
    if head_ids is not None:
      pred = head_ids[pred]
    if steps == 1:
      pick = is_mask
    else:
      score = conf if order == 'confidence' else -jnp.tile(jnp.arange(G, dtype=jnp.float32), nb)
      score = jnp.where(is_mask, jnp.broadcast_to(score, (B, Q)), -jnp.inf).reshape(B, nb, G)
      rank = jnp.argsort(jnp.argsort(-score, axis=2), axis=2)  # 0 = best, within each block
      pick = is_mask & (rank < per_step[..., None]).reshape(B, Q)
    tokens = jnp.where(pick, pred, tokens)
    if topk:
      logp_k, ids_k = jax.lax.top_k(jax.nn.log_softmax(logits / dcfg.confidence_temperature),
                                    min(topk, N))
      ids_k = ids_k if head_ids is None else head_ids[ids_k]
      if topk > N:  # fewer tokens than asked for: the rest are impossible
        logp_k = jnp.pad(logp_k, ((0, 0), (0, 0), (0, topk - N)), constant_values=-jnp.inf)
        ids_k = jnp.pad(ids_k, ((0, 0), (0, 0), (0, topk - N)))
      top_logp_out = jnp.where(pick[..., None], logp_k, top_logp_out)
      top_ids_out = jnp.where(pick[..., None], ids_k.astype(jnp.int32), top_ids_out)
    conf_out = jnp.where(pick, conf, conf_out)
    probs_out = jnp.where(pick[..., None], probs, probs_out)
    is_mask = is_mask & ~pick
  if topk:
    return tokens, conf_out, probs_out, (top_logp_out, top_ids_out)
  return tokens, conf_out, probs_out
