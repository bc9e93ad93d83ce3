"""Prompt lookup replayed on the host (d2sd_jax/spec_decode/replay.py) against the programs:
the proposal of lookup.lookup, and the cycles of the pld decode loop."""

import collections

import jax
import jax.numpy as jnp
import numpy as np

from d2sd_jax.spec_decode import ar as AR
from d2sd_jax.spec_decode import lookup as lookup_lib
from d2sd_jax.spec_decode import replay
from d2sd_jax.spec_decode import speculative as SP
from tests.helpers import loop_checks as H
from tests.helpers.tiny_drafters import PROMPTS


def test_lookup_proposal_is_drafting_pld_rule():
  """replay.lookup_proposal (plain Python) proposes what lookup.lookup proposes, on
  random sequences of a 4-token alphabet (matches of every length, repeats, no match)."""
  rng = np.random.default_rng(0)
  State = collections.namedtuple('State', 'seq_BxL seq_len_B')
  Settings = collections.namedtuple('Settings', 'gamma ngram_max')
  settings = Settings(5, 3)
  L = 24
  lens = rng.integers(1, L, 64)
  seqs = rng.integers(0, 4, (64, L))
  draft, valid, matched = jax.jit(lookup_lib.lookup, static_argnums=0)(
      settings, State(jnp.asarray(seqs, jnp.int32), jnp.asarray(lens, jnp.int32)))
  kinds = set()
  for b in range(64):
    tokens, n = replay.lookup_proposal(seqs[b, :lens[b]].tolist(), 5, 3)
    got = [int(t) for t, v in zip(draft[b], valid[b]) if v]
    assert (got, int(matched[b])) == (tokens, n), b
    kinds.add(n)
  assert kinds == {0, 1, 2, 3}  # every case happened


def test_lookup_cycles_counts_the_cycles_pld_takes(tiny):
  """replay.lookup_cycles, from the prompts and completions alone, gives the cycles the pld program
  ran on the tiny target (greedy, rows ending at the limit), with proposals accepted (so a
  wrong acceptance count or commit length shows)."""
  cfg, params = tiny
  spec = SP.SpecSettings(AR.GenerationSettings(max_new_tokens=24, eos_ids=(), pad_id=0),
                         method='pld', gamma=5, ngram_max=2)
  outs, counts = H.run_cycles(cfg, {'target': params}, spec, PROMPTS, check_caches=False)
  assert counts['accepted'] > 0, counts
  assert sum(replay.lookup_cycles(p, o, 5, 2) for p, o in zip(PROMPTS, outs)) == counts['cycles']
  assert replay.lookup_cycles([1, 2], [3], 5, 2) == 0  # the prefill's token alone: no cycle
