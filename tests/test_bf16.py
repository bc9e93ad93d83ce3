"""bfloat16 end to end on the real target: shipped drafters load for a bfloat16 target (the
fingerprint does not depend on dtype) and draft in bfloat16, and greedy D²SD reproduces bfloat16
AR token for token (see Precision in d2sd_jax/models/target.py)."""
import jax.numpy as jnp

import d2sd_jax
from d2sd_jax.formats import checkpoints
from d2sd_jax.formats import loaders

# Not from the training data (stdlib docstrings, HumanEval excluded): a chat request, code to
# continue, and prose. With bfloat16 activations (the previous numerics) greedy D²SD left
# bfloat16 AR at tokens 10 and 45 of the last two.
PROMPTS = ['Write a Python function that returns the n-th Fibonacci number.',
           'def merge_sorted(a, b):\n    """Merge two sorted lists into one sorted list."""\n',
           'Explain what a hash table is in two sentences.']


def test_fingerprint_is_the_same_in_float32_and_bfloat16(tiny_folder):
  for source in ('smollm2', tiny_folder):
    f32, bf16 = loaders.load_target(source, 'float32'), loaders.load_target(source, 'bfloat16')
    assert bf16.params['embed'].dtype == jnp.bfloat16
    assert checkpoints.target_fingerprint(f32) == checkpoints.target_fingerprint(bf16)
    # and it still tells weights apart: one changed value of the hashed rows
    changed = dict(f32.params, embed=f32.params['embed'].at[3, 5].add(1e-3))
    assert checkpoints.params_fingerprint(f32.cfg, changed) != checkpoints.target_fingerprint(f32)
  # the in-memory fallback agrees with what the float32 loader records
  assert checkpoints.params_fingerprint(f32.cfg, f32.params) == f32.fingerprint


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
