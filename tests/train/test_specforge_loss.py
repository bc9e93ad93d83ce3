"""Drafter 1's training loss against SpecForge's DFlash loss on one fixed batch.

tests/fixtures/specforge_dflash_loss.npz was written by scripts/make_specforge_fixtures.py with
torch and the `specforge` 0.2.0 wheel: its `OnlineDFlashModel` (loss_type "dflash") around its
`DFlashDraftModel`, holding the tiny DFlash drafter and target of tests/fixtures/dflash_tiny/, on
2 sequences with 4 fixed anchors each, at loss_decay_gamma 0 (no decay), 4 and 1. Nothing here
needs torch. SpecForge 0.2.0 has no variable-prefix objective, so drafter 2's loss has no
counterpart there.

The two losses are the same function of the batch once one documented difference is mapped:
  - SpecForge weights position k of a block by exp(-(k-1)/gamma) and divides the weighted CE sum
    by the sum of the weights. Ours (losses.vp_weights) first normalises each block's weights
    to sum 1 over its masked positions, i.e. divides them by Z = sum_{k=1}^{G-1}
    exp(-(k-1)/gamma), the same constant for every block of drafter 1. The constant cancels in
    the loss; our reported weight sum is SpecForge's divided by Z.
  - SpecForge's "no decay" (gamma None or <= 0) is our loss.decay = inf.
Everything else coincides and is asserted: the features, the context each block sees (the
target states before its anchor), the in-block attention, the block logits, the labels (block
position k predicts the token at anchor + k), which positions carry loss (not the anchor, not
past the sequence end, not where the loss mask is 0), and the accuracy.

A per-block constant factor on the weights is invisible to both losses: exp(-k/gamma) in place of
exp(-(k-1)/gamma) gives the same loss, gradient and metrics, so no test can (or should) tell it
apart. Caught: a decay of another shape or scale, drafter 1 weighted by loss.tau, unnormalised
block weights, labels shifted to the next token, the anchor masked, the anchor's own state in
its context, the loss mask ignored, positions past the sequence end kept.
"""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from d2sd_jax.formats import loaders
from d2sd_jax.formats.drafters import load_drafter
from d2sd_jax.train import blocks, features, losses

from tests.conftest import ROOT
sys.path.insert(0, os.path.join(ROOT, 'configs'))
import drafter1 as drafter1_config  # pylint: disable=wrong-import-position

TINY = os.path.join(ROOT, 'tests', 'fixtures', 'dflash_tiny')
FIXTURE = os.path.join(ROOT, 'tests', 'fixtures', 'specforge_dflash_loss.npz')
TOL = dict(rtol=1e-4, atol=1e-4)  # float32, torch vs XLA (different summation orders)
LOSS_TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope='module')
def ref():
  with np.load(FIXTURE) as f:
    return dict(f)


@pytest.fixture(scope='module')
def models():
  target = loaders.load_hf(os.path.join(TINY, 'target'))
  dcfg, dparams, _ = load_drafter(os.path.join(TINY, 'drafter'), target)
  return target, dcfg, dparams


def our_blocks(ref, gamma, G):
  """Prefix lengths and weights as train.py makes them for drafter 1 at loss.decay = gamma
  (SpecForge's gamma 0, no decay, is decay = inf), on the fixture's anchors."""
  c = drafter1_config.get_config()
  c.train.anchors_per_seq = ref['anchors'].shape[1]
  c.loss.decay = float(gamma) if gamma > 0 else float('inf')
  _, prefix, weights, reveal, forbid = blocks.sample_blocks(
      jax.random.PRNGKey(0), jnp.asarray(ref['loss_mask'] > 0.5), c, G)
  assert reveal is None and forbid is None
  return jnp.asarray(ref['anchors']), prefix, weights


def test_features_are_specforge_drafter_input(models, ref):
  target, dcfg, _ = models
  feats = features.target_features(target.params, target.cfg, dcfg, jnp.asarray(ref['input_ids']))
  np.testing.assert_allclose(feats, ref['hidden_states'], **TOL)


def test_block_logits_match_specforge_training_forward(models, ref):
  """The training-time forward (all anchors of a sequence side by side) gives SpecForge's block
  logits: same context per block, same in-block attention, same positions and mask input."""
  target, dcfg, dparams = models
  G = dcfg.gamma
  anchors, prefix, _ = our_blocks(ref, 4.0, G)
  seq = jnp.asarray(ref['input_ids'])
  feats = jnp.asarray(ref['hidden_states'])
  tokens, is_mask, positions, _ = losses.block_inputs(seq, anchors, prefix, G)
  logits = losses.block_logits(dparams, dcfg, target.params, target.cfg, feats, tokens, is_mask,
                               positions, anchors, head_only=True)
  np.testing.assert_allclose(np.asarray(logits).reshape(ref['logits'].shape), ref['logits'],
                             **TOL)


@pytest.mark.parametrize('i', range(3), ids=['no-decay', 'gamma4', 'gamma1'])
def test_drafter1_loss_equals_specforge_dflash_loss(models, ref, i):
  target, dcfg, dparams = models
  G, gamma = dcfg.gamma, float(ref['gammas'][i])
  anchors, prefix, weights = our_blocks(ref, gamma, G)
  loss, m = losses.drafter_loss(dparams, dcfg, target.params, target.cfg,
                                jnp.asarray(ref['input_ids']), jnp.asarray(ref['hidden_states']),
                                jnp.asarray(ref['loss_mask'] > 0.5), anchors, prefix, weights)
  np.testing.assert_allclose(float(loss), ref['loss'][i], **LOSS_TOL)
  # Our blocks' weights sum to 1 over their masked positions: SpecForge's weight sum / Z.
  k = np.arange(1, G)
  Z = np.sum(np.exp(-(k - 1) / gamma)) if gamma > 0 else G - 1.0
  np.testing.assert_allclose(float(m['weight']) * Z, ref['loss_den'][i], **LOSS_TOL)
  # The same positions carry loss, and the top-1 agreement is SpecForge's accuracy.
  supervised = ref['weight_mask'] > 0
  np.testing.assert_array_equal(m['count_by_pos'], supervised.sum((0, 1)))
  correct = np.sum(np.asarray(m['acc_by_pos']) * np.asarray(m['count_by_pos']))
  np.testing.assert_allclose(correct / supervised.sum(), ref['accuracy'][i], **LOSS_TOL)

