"""Cost model and throughput model (tiny target: cheap; a roofline check at Qwen3-8B's shapes
from lowered programs only). method='auto': tests/decode/test_autoconfig.py."""
import dataclasses

import jax
import numpy as np
import pytest

from d2sd_jax.perf import costmodel
from d2sd_jax.models import drafter as D
from d2sd_jax.spec_decode import ar as AR
from d2sd_jax.spec_decode import speculative as SP
from d2sd_jax.perf import throughput

# ----------------------------------------------------------------------------------------------
# Throughput formulas against brute force


def test_chain_tau_and_histogram_round_trip():
  a = np.array([0.9, 0.7, 0.5, 0.2])
  # The exact histogram of accepted drafts of that chain: n drafts accepted, then a rejection.
  hist = np.array([np.prod(a[:n]) * (1 - a[n]) for n in range(4)] + [np.prod(a)])
  assert abs(hist.sum() - 1) < 1e-12
  expected = sum(n * h for n, h in enumerate(hist)) + 1
  assert abs(throughput.chain_tau(a) - expected) < 1e-12
  assert abs(throughput.tau_from_histogram(hist * 1000) - expected) < 1e-9
  np.testing.assert_allclose(throughput.acceptance_from_histogram(hist), a, rtol=1e-9)
  with pytest.raises(ValueError, match='empty'):
    throughput.tau_from_histogram([0, 0])


def test_branched_tau_by_enumeration():
  """Enumerate every outcome of a 4-draft chain with branches at cuts {0, 2}: the chain stops
  after i drafts; a branch at cut i then accepts m of its drafts with probabilities b_j."""
  c = np.array([0.8, 0.6, 0.5, 0.3])
  b = np.array([0.4, 0.7, 0.6, 0.5])
  cuts = [0, 2]
  tau = 0.0
  for i in range(5):  # drafts the chain accepts
    p_i = np.prod(c[:i]) * ((1 - c[i]) if i < 4 else 1.0)
    extra = 0.0
    if i in cuts and i < 4:
      room = 4 - i
      for m in range(room + 1):
        p_m = np.prod(b[:m]) * ((1 - b[m]) if m < room else 1.0)
        extra += p_m * m
    tau += p_i * (1 + i + extra)
  assert abs(throughput.branched_tau(c, cuts, b) - tau) < 1e-12


def test_leniency_and_effort_seeds():
  a = np.array([0.5, 0.2])
  np.testing.assert_allclose(throughput.lenient(a, 0.0), a)
  np.testing.assert_allclose(throughput.lenient(a, 1.0), [1, 1])
  # One point-mass draft x ~ the drafter's argmax: P(accept) = E[λ + (1-λ) p(x)].
  p_x, lam = 0.3, 0.4
  assert abs(throughput.lenient([p_x], lam)[0] - (lam + (1 - lam) * p_x)) < 1e-12
  np.testing.assert_allclose(throughput.with_effort(a, 1, 0.5), a)
  np.testing.assert_allclose(throughput.with_effort(a, 3, 0.5), 1 - (1 - a) * 0.25)
  assert throughput.tokens_per_s(3.0, 0.05, batch=2) == 120.0


# ----------------------------------------------------------------------------------------------
# Measured costs (tiny target) and their cache


TDCFG = D.DrafterConfig(gamma=4, n_layers=1, d_model=32, n_heads=4, n_kv_heads=2, head_dim=8,
                        d_ff=48, feature_layers=(0, 2), rope_base=10000.0, norm_eps=1e-6)


def test_measured_costs_are_cached_and_interpolated(tiny, cost_cache, monkeypatch):
  cfg, params = tiny
  bundle = {'target': params, 'drafter1': D.init_params(TDCFG, cfg, jax.random.PRNGKey(1))}
  gen = AR.GenerationSettings(max_new_tokens=4, eos_ids=(), pad_id=0)
  specs = [SP.SpecSettings(gen, method='dflash', gamma=4, drafter1=TDCFG),
           SP.SpecSettings(gen, method='pld', gamma=4)]
  costs = costmodel.measure(bundle, cfg, specs, context=24, sizes=(2, 8), repeats=2,
                            log=lambda *_: None)
  assert costs.ar_step > 0 and all(v > 0 for v in costs.draft.values())
  assert set(costs.verify) == {2, 8} and len(list(cost_cache.iterdir())) == 1
  mid = costs.at('verify', 5)
  assert abs(mid - (costs.verify[2] + costs.verify[8]) / 2) < 1e-12
  # Whole cycles were timed inside the loop for each configuration; the parts give the rest.
  assert set(costs.cycles) == {costmodel.cycle_key(s) for s in specs}
  assert costs.cycle(specs[0]) == costs.cycles[costmodel.cycle_key(specs[0])] > 0
  parts = dataclasses.replace(costs, cycles={})
  assert abs(parts.cycle(specs[0]) - (costs.draft[costmodel.draft_key(specs[0])] +
                                      costs.at('verify', 4) + costs.at('accept', 4))) < 1e-12
  # A second call reads the cache: nothing is timed again.
  monkeypatch.setattr(costmodel, '_medians_s', lambda *a: pytest.fail('measured again'))
  again = costmodel.measure(bundle, cfg, specs, context=24, sizes=(2, 8), repeats=2)
  assert again == costs


def test_programs_are_timed_in_turns_and_each_takes_its_median(monkeypatch):
  """One warm run of each, then rounds of one run of every program (a drift of the machine's
  speed then weighs on every figure alike); each figure is the median of its own runs."""
  clock, calls = [0.0], []
  monkeypatch.setattr(costmodel.time, 'perf_counter', lambda: clock[0])

  def program(name, seconds):
    def run():
      calls.append(name)
      clock[0] += seconds.pop(0)
    return run

  timed = {'a': program('a', [9.0, 1.0, 5.0, 1.5]), 'b': program('b', [9.0, 2.0, 2.5, 7.0])}
  assert costmodel._medians_s(timed, 3) == {'a': 1.5, 'b': 2.5}  # pylint: disable=protected-access
  assert calls == ['a', 'b'] * 4


@pytest.mark.slow  # (lowering at 8B shapes: the tiny roofline tests stay in the default tier)
def test_roofline_prediction_at_qwen3_8b_shapes():
  """From lowered programs only: an 8B bf16 target's AR step on an H200 is bound by reading
  its ~16.4 GB of weights, and a 16-node verification does ~16x the FLOPs of one token."""
  tcfg = costmodel.TARGETS['qwen3-8b']
  chip = costmodel.CHIPS['h200']
  costs = costmodel.predict(tcfg, chip, [], context=256, sizes=(16,))
  n_params = 8.19e9  # Qwen3-8B's published parameter count (embedding and head untied)
  kv = 2 * 36 * 8 * 128 * 256 * 2
  expected = (2 * n_params + kv) / (chip.bandwidth * chip.bw_eff) + chip.launch_s
  assert abs(costs.ar_step - expected) / expected < 0.03
  assert costs.verify[16] >= costs.ar_step * 0.999  # memory-bound: no cheaper than one step


def test_roofline_draft_reads_only_the_drafters_head_rows():
  """A drafter with an N-token head reads N rows of the LM head per pass (decoding gathers them
  once), not the whole vocabulary: at Qwen3-8B's shapes a drafter pass is memory-bound, so its
  predicted time follows the bytes, and the difference is exactly the rows it skips."""
  tcfg = costmodel.TARGETS['qwen3-8b']
  chip = costmodel.CHIPS['h200']
  gen = AR.GenerationSettings(max_new_tokens=8, eos_ids=(), pad_id=0)
  full = costmodel.paper_drafter(tcfg)
  small = dataclasses.replace(full, head_vocab=8192)
  specs = [SP.SpecSettings(gen, method='dflash', gamma=16, drafter1=d) for d in (full, small)]
  draft = [costmodel.predict(tcfg, chip, [s], context=256, sizes=(16,)).draft[
      costmodel.draft_key(s)] for s in specs]
  skipped = (tcfg.vocab_size - 8192) * tcfg.d_model * 2  # bfloat16 rows
  assert abs((draft[0] - draft[1]) - skipped / (chip.bandwidth * chip.bw_eff)) < 0.02 * (
      draft[0] - draft[1])


def test_roofline_prices_each_branch_pass_as_one_more_drafter_pass():
  """spec.branch_passes=2 is a cost key of its own, and at Qwen3-8B's shapes (memory-bound
  drafter passes) it costs one more pass of drafter 2: as much as d2sd's one pass of drafter 2
  adds to dflash's pass of drafter 1 (both the paper's drafter)."""
  tcfg = costmodel.TARGETS['qwen3-8b']
  chip = costmodel.CHIPS['h200']
  gen = AR.GenerationSettings(max_new_tokens=8, eos_ids=(), pad_id=0)
  d = costmodel.paper_drafter(tcfg)
  dflash = SP.SpecSettings(gen, method='dflash', gamma=16, drafter1=d)
  one = SP.SpecSettings(gen, method='d2sd', gamma=16, n_branches=4, drafter1=d, drafter2=d)
  two = dataclasses.replace(one, branch_passes=2)
  assert len({costmodel.draft_key(s) for s in (dflash, one, two)}) == 3
  draft = costmodel.predict(tcfg, chip, [dflash, one, two], context=256, sizes=(16,)).draft
  added = draft[costmodel.draft_key(two)] - draft[costmodel.draft_key(one)]
  first = draft[costmodel.draft_key(one)] - draft[costmodel.draft_key(dflash)]
  assert added > 0 and abs(added - first) < 0.05 * first, (added, first)
