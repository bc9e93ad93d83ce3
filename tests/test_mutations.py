"""Mutation suite (slow tier): known-bad changes to the speculative core, each applied to a copy
of its module, must make a check of the test run fail.

A mutation replaces one exact piece of source (which must still exist, so the suite follows the
code), executes the changed module under its own name, and points the real module's functions
(and its method registry) at the changed ones for the duration of one check. JAX's caches are
cleared around it so that every program is traced again with the broken code.
"""
import inspect
import types

import jax
import pytest

from d2sd_jax.models import drafter as drafter_lib
from d2sd_jax.spec_decode import drafting
from d2sd_jax.spec_decode import speculative as SP
from d2sd_jax.spec_decode import tree as tree_lib
from tests.helpers import loop_checks as H
from tests.helpers import tiny_drafters
from tests.spec_decode import test_acceptance

pytestmark = pytest.mark.slow  # (16 mutants, each compiling its checks again: about a minute)


def apply_mutation(monkeypatch, module, old: str, new: str):
  source = inspect.getsource(module)
  assert source.count(old) == 1, f'{module.__name__} no longer contains {old!r}: update the mutant'
  mutant = types.ModuleType(module.__name__)
  mutant.__file__ = module.__file__
  code = compile(source.replace(old, new), module.__file__, 'exec')
  exec(code, mutant.__dict__)  # pylint: disable=exec-used
  for name, obj in vars(mutant).items():
    if inspect.isfunction(obj) and obj.__module__ == module.__name__:
      monkeypatch.setattr(module, name, obj)
  if hasattr(mutant, 'REGISTRY'):
    monkeypatch.setattr(module, 'REGISTRY', mutant.REGISTRY)
  jax.clear_caches()


MUTATIONS = {
    # The target cache takes the tree's first K/V in node order, not the accepted path's:
    # only visible when a path through a branch is accepted.
    'compaction in node order': (
        SP, 'path_kv=path_rows(v.new_kv, path_BxC,',
        'path_kv=path_rows(v.new_kv, jnp.broadcast_to(jnp.arange(C), path_BxC.shape),',
        'oracle_tree'),
    'drafter contexts not extended': (
        SP, 'draft_caches = _write_drafter_context(params, settings, draft_caches,',
        'draft_caches = draft_caches or (params, settings, draft_caches,',
        'oracle_tree'),
    # EOS honoured only when it is the bonus token, not inside the accepted drafts.
    'ignore EOS inside a cycle': (
        SP, 'is_eos_BxC = ar.is_eos(new_BxC, gen.eos_ids) & (j <= n_acc)',
        'is_eos_BxC = ar.is_eos(new_BxC, gen.eos_ids) & (j == n_acc)', 'eos'),
    'zero drafter 2': (
        drafting, "return _redrafted(params, cfg, settings, state, 'drafter2')",
        "return _redrafted({**params, 'drafter2': jax.tree.map(jnp.zeros_like, "
        "params['drafter2'])}, cfg, settings, state, 'drafter2')", 'd2sd_tree'),
    'drafter 1 instead of drafter 2': (
        drafting, "return _redrafted(params, cfg, settings, state, 'drafter2')",
        "return _redrafted(params, cfg, settings, state, 'drafter1')", 'd2sd_tree'),
    'r(i) without (1 - c_{i+1})': (
        drafting, 'log_r = log_prefix + jnp.log1p(-c)', 'log_r = log_prefix + 0 * c',
        'branch_points'),
    'r(i) off by one': (
        drafting, 'log_r = log_prefix + jnp.log1p(-c)',
        'log_r = jnp.cumsum(jnp.log(c), 1) + jnp.log1p(-jnp.roll(c, -1, 1))', 'branch_points'),
    'branches may repeat the chain token': (
        drafting, 'jnp.where(k == cut_BxK[..., None] + 1, chain_BxG[:, None], -1) if forbid',
        'None if forbid', 'reachable'),
    'merged twins kept': (
        drafting, 'keep_BxK[:, k] & ~jnp.any(twin, axis=1)', 'keep_BxK[:, k]', 'merged_cuts'),
    'bonus drawn from p, not the residual': (
        tree_lib, 'bonus = sampling_lib.draw(u_bonus_B, jnp.log(r_BxV))',
        'bonus = sampling_lib.draw(u_bonus_B, jnp.log(p_BxTxV[jnp.arange(B), node]))',
        'sibling_law'),
    # The point-mass walk keeps only the mass its rejected children took; the bonus must still
    # be drawn without their tokens.
    'bonus keeps rejected point-mass siblings': (
        tree_lib, 'jnp.where(tried_BxT, tree.tokens_BxT, -1))',
        'jnp.where(tried_BxT & False, tree.tokens_BxT, -1))', 'lenient_siblings_law'),
    # Verification must sample from the target's law under the user's settings, as AR does.
    'sample-and-match ignores the temperature': (
        tree_lib, 'lambda k, lg: sampling_lib.sample(k, lg, settings)',
        'lambda k, lg: sampling_lib.sample(k, lg, sampling_lib.SamplingSettings('
        'float(settings.temperature > 0), settings.top_k, settings.top_p))', 'duplicate_law_T0.6'),
    'recursive rejection ignores top-p': (
        tree_lib, 'p_BxTxV = sampling_lib.probs(target_logits_BxTxV, settings)',
        'p_BxTxV = sampling_lib.probs(target_logits_BxTxV, sampling_lib.SamplingSettings('
        'settings.temperature, settings.top_k))', 'sibling_law_p0.8'),
    # Multi-step denoising commits the least confident positions first.
    'denoising unmasks the least confident first': (
        drafter_lib, "score = conf if order == 'confidence' else",
        "score = -conf if order == 'confidence' else", 'denoise_order'),
    # Every row drafts after the longest row's context (positions and visible context slots).
    "drafting from the longest row's context": (
        drafting, 'positions = jnp.broadcast_to(state.cache_len_B[:, None, None] + jnp.arange(G), '
        '(B, K, G))\n  out = drafter_lib.denoise(\n      params[name], getattr(settings, name), '
        "params['target'], cfg,\n      tokens_BxKxG.reshape(B, K * G), is_mask_BxKxG.reshape(B, "
        'K * G),\n      positions.reshape(B, K * G), state.draft_caches[name], '
        '_context(settings, state, name),',
        'longest_B = jnp.broadcast_to(jnp.max(state.cache_len_B), state.cache_len_B.shape)\n'
        '  positions = jnp.broadcast_to(longest_B[:, None, None] + jnp.arange(G), (B, K, G))\n'
        '  out = drafter_lib.denoise(\n      params[name], getattr(settings, name), '
        "params['target'], cfg,\n      tokens_BxKxG.reshape(B, K * G), is_mask_BxKxG.reshape(B, "
        'K * G),\n      positions.reshape(B, K * G), state.draft_caches[name], longest_B,',
        'rows_alone'),
    'sample-and-match descends into a duplicate sibling': (
        tree_lib, 'match = reachable(tree) & (tree.tokens_BxT == y_at_parent)',
        'match = tree.valid_BxT & (tree.tokens_BxT == y_at_parent)', 'duplicate_law'),
}


@pytest.fixture(scope='module')
def trained(tiny):
  return tiny_drafters.trained_bundle(tiny)


def run_check(kind, tiny, trained):
  """The very checks the other test files run (and pass) on the real code."""
  if kind == 'oracle_tree':
    H.check_oracle_tree(tiny, trained)
  elif kind == 'eos':
    H.check_eos_inside_accepted_path(tiny, trained)
  elif kind == 'd2sd_tree':
    H.check_d2sd_tree_is_drafter2(tiny, trained)
  elif kind == 'branch_points':
    H.check_branch_points()
  elif kind == 'merged_cuts':
    H.check_merged_cuts()
  elif kind == 'reachable':
    H.check_every_verified_node_reachable(tiny, trained)
  elif kind == 'sibling_law':
    test_acceptance.check_sibling_laws_exact()
  elif kind == 'duplicate_law':
    test_acceptance.check_sample_and_match_exact()
  elif kind == 'duplicate_law_T0.6':
    test_acceptance.check_sample_and_match_exact(
        settings=test_acceptance.USER_SAMPLINGS['T0.6-k4'])
  elif kind == 'sibling_law_p0.8':
    test_acceptance.check_sibling_laws_exact(settings=test_acceptance.USER_SAMPLINGS['T1-p0.8'])
  elif kind == 'denoise_order':
    H.check_denoise_confidence_order(tiny, trained)
  elif kind == 'rows_alone':
    H.check_rows_draft_as_alone(tiny, trained)
  elif kind == 'lenient_siblings_law':
    test_acceptance.check_lenient_siblings_law()
  else:
    raise ValueError(kind)


@pytest.mark.parametrize('name', sorted(MUTATIONS))
def test_mutation_is_caught(name, tiny, trained, monkeypatch):
  module, old, new, kind = MUTATIONS[name]
  apply_mutation(monkeypatch, module, old, new)
  try:
    with pytest.raises(AssertionError):
      run_check(kind, tiny, trained)
  finally:
    monkeypatch.undo()
    jax.clear_caches()
