"""bfloat16 end to end: drafters load for a bfloat16 target (the fingerprint does not depend on
dtype) and draft in bfloat16, and greedy D²SD reproduces bfloat16 AR token for token (see
Precision in d2sd_jax/models/target.py): on the tiny target with trained tiny drafters, and (slow)
on the real target with the shipped drafters. It spans loading (formats/), the target's precision
(models/target.py) and the loop; its subject is the loop's output."""
import dataclasses

import jax
import jax.numpy as jnp
import pytest

import d2sd_jax
from d2sd_jax.formats import checkpoints
from d2sd_jax.formats import loaders
from d2sd_jax.spec_decode import ar as AR
from d2sd_jax.spec_decode import speculative as SP
from tests.helpers import loop_checks as H
from tests.helpers import tiny_drafters

# Not from the training data (stdlib docstrings, HumanEval excluded): a chat request, code to
# continue, and prose. With bfloat16 activations (the previous numerics) greedy D²SD left
# bfloat16 AR at tokens 10 and 45 of the last two.
PROMPTS = ['Write a Python function that returns the n-th Fibonacci number.',
           'def merge_sorted(a, b):\n    """Merge two sorted lists into one sorted list."""\n',
           'Explain what a hash table is in two sentences.']


@pytest.mark.parametrize('source', [None, pytest.param('smollm2', marks=pytest.mark.slow)])
def test_fingerprint_is_the_same_in_float32_and_bfloat16(tiny_folder, source):
  for source in [source or tiny_folder]:
    f32, bf16 = loaders.load_target(source, 'float32'), loaders.load_target(source, 'bfloat16')
    assert bf16.params['embed'].dtype == jnp.bfloat16
    assert checkpoints.target_fingerprint(f32) == checkpoints.target_fingerprint(bf16)
    # and it still tells weights apart: one changed value of the hashed rows
    changed = dict(f32.params, embed=f32.params['embed'].at[3, 5].add(1e-3))
    assert checkpoints.params_fingerprint(f32.cfg, changed) != checkpoints.target_fingerprint(f32)
  # the in-memory fallback agrees with what the float32 loader records
  assert checkpoints.params_fingerprint(f32.cfg, f32.params) == f32.fingerprint


def _bf16(tree):
  return jax.tree.map(lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating)
                      else x, tree)


def test_bfloat16_greedy_speculative_equals_bfloat16_ar_on_the_tiny_target(tiny):
  """The tiny target and its trained drafters stored in bfloat16: greedy D²SD (drafts accepted)
  equals bfloat16 AR."""
  cfg, params = tiny
  trained = tiny_drafters.trained_bundle(tiny)
  cfg16 = dataclasses.replace(cfg, dtype='bfloat16')
  d1, d2 = (dataclasses.replace(c, dtype='bfloat16')
            for c in (tiny_drafters.DCFG, tiny_drafters.DCFG2))
  bundle = _bf16(trained)
  assert bundle['target']['embed'].dtype == bundle['drafter1']['fc'].dtype == jnp.bfloat16
  spec = SP.SpecSettings(AR.GenerationSettings(max_new_tokens=14, eos_ids=(), pad_id=0),
                         method='d2sd', gamma=5, drafter1=d1, drafter2=d2, n_branches=3)
  ar, sp, state = H.run_both(cfg16, SP.prepare(bundle, cfg16), tiny_drafters.PROMPTS, spec)
  assert sp == ar
  # bfloat16 is not float32
  assert ar != H.ar_outputs(cfg, params, tiny_drafters.PROMPTS, spec.generation)
  tokens = sum(len(row) - 1 for row in sp)  # each row's first token comes from the prefill
  assert int(state.cycles_B.sum()) < tokens  # drafts were accepted


@pytest.mark.slow
def test_bfloat16_greedy_speculative_equals_bfloat16_ar():
  dec = d2sd_jax.load('smollm2', drafter1='drafters/smollm2-drafter1',
                      drafter2='drafters/smollm2-drafter2', dtype='bfloat16')
  assert dec.target.params['layers'][0]['wqkv'].dtype == jnp.bfloat16
  for dcfg, params in dec.drafters.values():
    assert dcfg.dtype == 'bfloat16' and params['fc'].dtype == jnp.bfloat16
  ar = dec.generate(PROMPTS, 48, method='ar')
  spec = dec.generate(PROMPTS, 48, method='d2sd')
  assert spec.stats['tau'] > 1.0  # drafts were accepted
  assert [len(x) for x in ar.ids] == [48] * 3
  for a, b, text in zip(ar.ids, spec.ids, spec.texts):
    assert list(a) == list(b), text
