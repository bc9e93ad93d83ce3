"""The blocks a training step trains on: anchors in the response region, each block's visible
prefix and its loss weights (drafter 1: the anchor alone; drafter 2: a prefix-length prior, or
the first rejection of drafter 1's chain), and which tokens a block may not propose."""
import jax
import jax.numpy as jnp

from d2sd_jax.train import losses


def sample_blocks(key, label_mask_BxL, config, gamma: int, evaluate: bool = False):
  """Anchors at positions whose next token is a label (response region), + prefix lengths and
  loss weights for this drafter kind; partly revealed blocks (loss.reveal) in training only:
  held-out figures measure the fully masked blocks of one-step decoding. Returns (anchors,
  prefix, weights, reveal, forbid): forbid is set by at_chain_cuts only."""
  B, L = label_mask_BxL.shape
  A = config.train.anchors_per_seq
  k_anchor, k_prefix = jax.random.split(key)
  ok = jnp.concatenate([label_mask_BxL[:, 1:], jnp.zeros((B, 1), bool)], axis=1)
  if config.train.get('distinct_anchors', False):
    anchors, valid_BxA = losses.distinct_anchors(k_anchor, ok, A)
  else:  # drawn with replacement
    logits = jnp.where(ok, 0.0, -jnp.inf)
    anchors = jax.random.categorical(k_anchor, logits[:, None, :], axis=-1, shape=(B, A))
    valid_BxA = jnp.ones((B, A), bool)
  if config.kind == 'drafter1':
    prefix = jnp.zeros((B, A), jnp.int32)
    weights = losses.vp_weights(jnp.zeros((1,), jnp.int32), gamma, config.loss.decay)
    weights = jnp.broadcast_to(weights, (B, A, gamma))
  else:
    prior = losses.vp_prefix_prior(gamma, config.loss.beta, config.loss.get('prefix_prior', ''))
    prefix = jax.random.choice(k_prefix, gamma - 1, (B, A), p=prior).astype(jnp.int32)
    weights = losses.vp_weights(prefix.reshape(-1), gamma, config.loss.tau,
                                config.loss.get('block_norm', True)).reshape(B, A, gamma)
  weights = weights * valid_BxA[..., None]
  reveal = None
  if config.loss.get('reveal', 0.0) > 0 and not evaluate:  # partly unmasked (multi-step)
    reveal = losses.random_reveal(jax.random.fold_in(key, 7), (B, A, gamma), prefix,
                                  config.loss.reveal)
  return anchors.astype(jnp.int32), prefix, weights, reveal, None


def at_chain_cuts(blocks, chain, tparams, tcfg, feats, tokens, label_mask, label_ids, config,
                  key, evaluate: bool = False):
  """Drafter 2's blocks moved to where drafter 1's chain (chain = (its config, its params)) is
  first rejected at each anchor: the prefix is the accepted drafts, the chain's rejected token
  is forbidden at the first re-drafted position (decoding's redraft='exclude'), and a block
  whose chain is accepted whole (no branch needed) carries no loss. These are the only blocks
  whose re-draft can add tokens at decode time: a branch cut earlier re-drafts a token the
  chain had right, one cut later keeps a wrong one.

  loss.second_pass = f: a fraction f of the blocks (where one fits) start one token later, the
  true token after the cut given and nothing forbidden: the block a branch's second pass
  drafts (spec.branch_passes=2) once its first re-drafted token is right."""
  anchors, _, weights, _, _ = blocks
  cdcfg, cparams = chain
  G = cdcfg.gamma
  cut_BxA, chain_token_BxA = losses.chain_cuts(cparams, cdcfg, tparams, tcfg,
                                            feats.astype(jnp.float32), tokens, label_mask,
                                            anchors, label_ids)
  prefix = jnp.minimum(cut_BxA, G - 2)
  second = jnp.zeros_like(cut_BxA, bool)
  if config.loss.get('second_pass', 0.0) > 0 and not evaluate:  # (held-out loss: at the cut)
    second = (jax.random.uniform(jax.random.fold_in(key, 11), cut_BxA.shape) <
              config.loss.second_pass) & (cut_BxA < G - 2)
    prefix = prefix + second
  in_use = (jnp.sum(weights, -1) > 0) & (cut_BxA < G - 1)
  weights = losses.vp_weights(prefix.reshape(-1), G, config.loss.tau,
                              config.loss.get('block_norm', True)).reshape(weights.shape)
  weights = weights * in_use[..., None]
  forbid = jnp.where((jnp.arange(G) == prefix[..., None] + 1) & ~second[..., None],
                     chain_token_BxA[..., None], -1)
  reveal = None
  if config.loss.get('reveal', 0.0) > 0 and not evaluate:
    reveal = losses.random_reveal(jax.random.fold_in(key, 7), weights.shape, prefix,
                                  config.loss.reveal)
  return anchors, prefix, weights, reveal, forbid
