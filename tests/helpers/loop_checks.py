"""Running and checking the speculative loop: AR and speculative outputs side by side
(`run_both`), the loop one cycle at a time with every cache checked against a fresh prefill
(`run_cycles`, `assert_caches_fresh`), an oracle tree drafter, and whole checks against direct
references.

The check_* functions are whole checks (they raise AssertionError when the code is wrong): the
tests call them, and tests/test_mutations.py calls them again on deliberately broken copies of
the code to show that each one catches the bug it is there for.
"""
import jax
import jax.numpy as jnp
import numpy as np

from d2sd_jax.models import drafter as D
from d2sd_jax.spec_decode import ar as AR
from d2sd_jax.spec_decode import drafting
from d2sd_jax.spec_decode import lookup as lookup_lib
from d2sd_jax.spec_decode import speculative as SP
from d2sd_jax.spec_decode import tree as tree_lib
from tests.helpers.programs import fresh_prefill, jitted
from tests.helpers.tiny_drafters import DCFG, DCFG2, PROMPTS


def ar_outputs(cfg, target_params, prompts, gen: AR.GenerationSettings, seed=0):
  block, lens = AR.pad_prompts(prompts, gen.pad_id, bucket=8)
  ar = jitted()[0](target_params, cfg, gen, block, lens, AR.row_keys(seed, range(len(prompts))),
                   block.shape[1] + gen.max_new_tokens)
  return [ar.out_BxN[b, :ar.num_out_B[b]].tolist() for b in range(len(prompts))]


def run_both(cfg, params, prompts, spec, seed=0):
  """AR tokens and speculative tokens for the same prompts and row keys."""
  _, init, loop, _ = jitted()
  block, lens = AR.pad_prompts(prompts, spec.generation.pad_id, bucket=8)
  keys = AR.row_keys(seed, range(len(prompts)))
  target_params = params['target'] if 'target' in params else params
  ar_out = ar_outputs(cfg, target_params, prompts, spec.generation, seed)
  bundle = params if isinstance(params, dict) and 'target' in params else {'target': params}
  state = init(bundle, cfg, spec, block, lens, keys, SP.cache_size_needed(block.shape[1], spec))
  state = loop(bundle, cfg, spec, state)
  n = spec.generation.max_new_tokens
  sp_out = [SP.generated(state, n)[b, :state.num_out_B[b]].tolist() for b in range(len(prompts))]
  return ar_out, sp_out, state


def _stage_programs():
  """Fresh jitted stages (not cached across calls: a mutated module must be traced anew)."""
  return (jax.jit(SP.init_state, static_argnames=('cfg', 'settings', 'cache_size')),
          jax.jit(SP.draft, static_argnames=('cfg', 'settings')),
          jax.jit(SP.verify, static_argnames=('cfg', 'settings')),
          jax.jit(SP.accept, static_argnames=('settings',)),
          jax.jit(SP.commit, static_argnames=('settings',)))


def assert_caches_fresh(cfg, bundle, spec, state):
  """The target cache and every drafter's context equal a fresh prefill of the committed
  tokens (first cache_len slots), and the sequence buffer holds nothing past them."""
  layers = tuple(sorted({0, cfg.n_layers} | set(spec.feature_layers)))
  # Different programs: float32 rounding relative to the caches' scale (their values reach ~17,
  # the drafters' ~3; the features behind them ~400): up to 2e-5 of it on one CPU, so 1e-4 of
  # it. A slot holding another token's K/V, or none, is off by a good part of the scale.
  close = lambda got, want, msg: np.testing.assert_allclose(
      got, want, rtol=0, atol=1e-4 * float(np.max(np.abs(np.asarray(want)), initial=0.0)),
      err_msg=msg)
  for b in range(state.seq_BxL.shape[0]):
    n = int(state.cache_len_B[b])
    assert n == int(state.seq_len_B[b]) - 1
    assert all(t == spec.generation.pad_id for t in state.seq_BxL[b, n + 1:].tolist())
    # The whole buffer (one shape, one program): a causal prefill's first n slots only see
    # the first n tokens.
    ref_cache, feats = fresh_prefill(cfg, bundle['target'], state.seq_BxL[b:b + 1], layers)
    for layer, ref_layer in zip(state.cache, ref_cache):
      for kv in ('k', 'v'):
        close(layer[kv][b, :, :n], ref_layer[kv][0, :, :n], f'target cache, row {b}')
    for name in spec.drafters:
      dcfg = getattr(spec, name)
      idx = [layers.index(i) for i in dcfg.feature_layers]
      ref = D.context_kv(bundle[name], dcfg, D.features_of(feats[:, :n, idx]), jnp.arange(n)[None])
      for layer, ref_layer in zip(state.draft_caches[name], ref):
        for kv in ('k', 'v'):
          close(layer[kv][b, :, :n], ref_layer[kv][0], f'{name} context, row {b}')


def run_cycles(cfg, bundle, spec, prompts, seed=0, check_caches=True, on_cycle=None):
  """The speculative loop one cycle at a time (the same stage functions spec_step chains).
  Checks the caches after every cycle; returns (outputs per row, counters): cycles, accepted
  drafts, and `branch_accepts`: row-cycles whose accepted path left drafter 1's chain (any
  node of index >= gamma, the layout of drafting.pack_tree)."""
  init, draft, verify, accept, commit = _stage_programs()
  block, lens = AR.pad_prompts(prompts, spec.generation.pad_id, bucket=8)
  state = init(bundle, cfg, spec, block, lens, AR.row_keys(seed, range(len(prompts))),
               SP.cache_size_needed(block.shape[1], spec))
  counts = {'cycles': 0, 'accepted': 0, 'branch_accepts': 0}
  while not bool(state.done_B.all()):
    live = ~np.asarray(state.done_B)
    tree = draft(bundle, cfg, spec, state)
    verified = verify(bundle, cfg, spec, state, tree)
    acc = accept(spec, tree, verified, state.cycle_keys[1])
    new_state = commit(bundle, spec, state, tree, verified, acc)
    n_acc = np.asarray(acc.accept_len_B)
    on_path = np.arange(acc.path_BxC.shape[1])[None] <= n_acc[:, None]
    left_chain = np.any(on_path & (np.asarray(acc.path_BxC) >= spec.gamma), axis=1)
    counts['cycles'] += int(live.sum())
    counts['accepted'] += int((n_acc * live).sum())
    counts['branch_accepts'] += int((left_chain & live).sum())
    if on_cycle is not None:
      on_cycle(state, tree, acc, new_state)
    state = new_state
    if check_caches:
      assert_caches_fresh(cfg, bundle, spec, state)
  n = spec.generation.max_new_tokens
  outs = [SP.generated(state, n)[b, :state.num_out_B[b]].tolist() for b in range(len(prompts))]
  return outs, counts


# ----------------------------------------------------------------------------------------------
# An oracle tree drafter


def oracle_tree(reference_BxN, vocab_size: int):
  """A drafting method that knows each row's AR continuation (reference, long enough to never
  run out). Its chain is right up to a wrong token at depth w (w cycles through 1..gamma-1 as
  tokens are generated); branch 0 hangs at chain node w-1 and carries the truth from there,
  so every accepted path leaves the chain through it; branch 1 hangs at another cut and is
  wrong. It uses drafters' contexts only so that their updates are checked along branch paths.
  Needs settings.n_branches = 2."""

  def draft(params, cfg, settings, state):
    del params, cfg
    G_ = settings.gamma
    depth = jnp.arange(G_)[None]
    idx = state.num_out_B[:, None] + depth - 1  # reference index of depth d's token (d >= 1)
    truth_BxG = jnp.take_along_axis(reference_BxN, jnp.clip(idx, 0, reference_BxN.shape[1] - 1),
                                    1).at[:, 0].set(state.anchor_B)
    w_B = 1 + state.num_out_B % (G_ - 1)
    chain_BxG = jnp.where(depth == w_B[:, None], (truth_BxG + 1) % vocab_size, truth_BxG)
    cut_BxK = jnp.stack([w_B - 1, w_B % (G_ - 1)], axis=1)
    right = jnp.where(depth <= cut_BxK[:, :1], chain_BxG, truth_BxG)
    wrong = jnp.where(depth <= cut_BxK[:, 1:], chain_BxG, (truth_BxG + 2) % vocab_size)
    return drafting.pack_tree(state.anchor_B, chain_BxG, jnp.stack([right, wrong], 1), cut_BxK,
                              settings.tree_size)

  return drafting.Method(draft, drafters=('drafter1', 'drafter2'),
                         nodes=lambda s: s.gamma + 2 * (s.gamma - 1), branched=True)


def oracle_spec(gen, name='oracle_tree'):
  return SP.SpecSettings(gen, method=name, gamma=DCFG.gamma, drafter1=DCFG, drafter2=DCFG2,
                         n_branches=2)


def check_oracle_tree(tiny, bundle, max_new_tokens=24):
  """Branch paths accepted every cycle: output = AR, every cache = a fresh prefill."""
  cfg, params = tiny
  gen = AR.GenerationSettings(max_new_tokens=max_new_tokens, eos_ids=(), pad_id=0)
  long = AR.GenerationSettings(max_new_tokens=max_new_tokens + 2 * DCFG.gamma, eos_ids=(), pad_id=0)
  reference = jnp.asarray(ar_outputs(cfg, params, PROMPTS, long))
  drafting.register('oracle_tree', oracle_tree(reference, cfg.vocab_size))
  try:
    outs, counts = run_cycles(cfg, bundle, oracle_spec(gen), PROMPTS)
  finally:
    drafting.REGISTRY.pop('oracle_tree')
  assert outs == ar_outputs(cfg, params, PROMPTS, gen)
  assert counts['branch_accepts'] == counts['cycles'] > 0, counts
  return counts


def eos_case(tiny, max_new_tokens=24):
  """(eos token, index in row 0's AR output) such that the oracle's accepted path of that
  cycle continues past the EOS (it is neither the bonus token nor the path's last draft)."""
  cfg, params = tiny
  G_ = DCFG.gamma
  ref = ar_outputs(cfg, params, PROMPTS[:1],
                   AR.GenerationSettings(max_new_tokens=max_new_tokens, eos_ids=(), pad_id=0))[0]
  for i in range(1, len(ref)):
    # The prefill emits token 0; cycle c emits tokens 1 + c·G .. G + c·G (G-1 drafts + bonus).
    if (i - 1) % G_ <= G_ - 3 and ref[i] not in ref[:i]:
      return ref[i], i
  raise AssertionError(f'no usable EOS position in {ref}')


def check_eos_inside_accepted_path(tiny, bundle, max_new_tokens=24):
  cfg, params = tiny
  eos, index = eos_case(tiny, max_new_tokens)
  free = AR.GenerationSettings(max_new_tokens=max_new_tokens + 2 * DCFG.gamma, eos_ids=(),
                              pad_id=0)
  reference = jnp.asarray(ar_outputs(cfg, params, PROMPTS, free))
  gen = AR.GenerationSettings(max_new_tokens=max_new_tokens, eos_ids=(eos,), pad_id=0)
  ar = ar_outputs(cfg, params, PROMPTS, gen)
  assert len(ar[0]) == index + 1 and ar[0][-1] == eos
  seen = []

  def on_cycle(state, tree, acc, new_state):
    # Row 0's cycle that commits the EOS accepted drafts beyond it.
    start, n_acc = int(state.num_out_B[0]), int(acc.accept_len_B[0])
    if not bool(state.done_B[0]) and start <= index < start + n_acc:
      seen.append(index - start < n_acc - 1)

  drafting.register('oracle_tree', oracle_tree(reference, cfg.vocab_size))
  try:
    outs, _ = run_cycles(cfg, bundle, oracle_spec(gen), PROMPTS, on_cycle=on_cycle)
  finally:
    drafting.REGISTRY.pop('oracle_tree')
  assert seen == [True], seen  # the situation this check is about really happened
  assert outs == ar


def _block_logits(dparams, dcfg, params, cfg, feats_1xLxKxD, block_1xG, is_mask_1xG, n):
  """A drafter's logits [G, V] for one block after the first n tokens of a sequence (its target
  features from a fresh prefill; the slots from n on are masked out)."""
  L, G = feats_1xLxKxD.shape[1], block_1xG.shape[1]
  ctx = D.context_kv(dparams, dcfg,
                     D.features_of(feats_1xLxKxD[:, :, list(dcfg.feature_layers)]),
                     jnp.arange(L)[None])
  return D.forward(dparams, dcfg, params, cfg, block_1xG, is_mask_1xG, n + jnp.arange(G)[None],
                   ctx, jnp.reshape(n, (1,)), jnp.ones((1, G, G), bool))[0]


# (jitted at fixed shapes, so compiled once: the references run them for every row of every
# cycle, and op by op they take most of a test's time)
_jitted_prefill = jax.jit(fresh_prefill, static_argnums=(0, 3))
_jitted_block_logits = jax.jit(_block_logits, static_argnums=(1, 3))


def drafter_logits_reference(tiny, bundle, spec, state, b):
  """What drafting.py's drafts of row b rest on, computed independently of it: drafter 1's
  block from one fresh forward ('logp1' [G, V], calibrated by its confidence temperature, and
  'chain'), the K cuts by enumerating r(i) = c_1..c_i (1 - c_{i+1}) in numpy, each branch
  re-drafted by drafter 2 alone from [anchor, chain[1..i], MASK...] with the chain's token at
  i+1 excluded ('branches': (cut, tokens, calibrated confidences)), and prompt lookup's proposal
  ('lookup': tokens, valid, matched length; lookup.lookup, checked by the pld tests). With
  spec.branch_passes = P, branch pass p (2..P) re-drafts, from the branch's first p - 1
  re-drafted tokens given, the positions after them."""
  cfg, params = tiny
  G_ = spec.gamma
  n = int(state.cache_len_B[b])
  anchor = int(state.seq_BxL[b, n])
  _, feats = _jitted_prefill(cfg, params, state.seq_BxL[b:b + 1], (0, 1, 2))

  def logits_of(name, block, is_mask):
    return np.asarray(_jitted_block_logits(bundle[name], getattr(spec, name), params, cfg, feats,
                                           jnp.asarray([block]), jnp.asarray([is_mask]), n),
                      np.float64)

  def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))

  block = [anchor] + [0] * (G_ - 1)
  lg = logits_of('drafter1', block, [False] + [True] * (G_ - 1)) / spec.drafter1.confidence_temperature
  logp1 = log_softmax(lg)
  chain = [anchor] + np.argmax(lg[1:], -1).tolist()
  conf = np.clip(np.exp(logp1).max(-1)[1:], 1e-6, 1 - 1e-6)
  r = [np.prod(conf[:i]) * (1 - conf[i]) for i in range(G_ - 1)]
  cuts = sorted(range(G_ - 1), key=lambda i: -r[i])[:spec.n_branches]
  branches = []
  t2 = spec.drafter2.confidence_temperature
  for i in cuts:
    lg2 = logits_of('drafter2', chain[:i + 1] + [0] * (G_ - 1 - i),
                    [False] * (i + 1) + [True] * (G_ - 1 - i))
    lg2[i + 1, chain[i + 1]] = -np.inf
    conf2 = np.where(np.arange(G_) > i, np.exp(log_softmax(lg2 / t2)).max(-1), 1.0)
    tokens = chain[:i + 1] + np.argmax(lg2[i + 1:], -1).tolist()
    # spec.branch_passes: pass p sees the branch's first p re-drafted tokens, drafts the rest
    for p in range(1, spec.branch_passes):
      given = min(i + 1 + p, G_)
      lg2 = logits_of('drafter2', tokens[:given] + [0] * (G_ - given),
                      [False] * given + [True] * (G_ - given))
      tokens = tokens[:given] + np.argmax(lg2[given:], -1).tolist()
      conf2 = np.where(np.arange(G_) >= given, np.exp(log_softmax(lg2 / t2)).max(-1), conf2)
    branches.append((i, tokens, conf2))
  draft, valid, matched = jax.jit(lookup_lib.lookup, static_argnames=('settings',))(spec, state)
  return {'logp1': logp1, 'chain': chain, 'branches': branches,
          'lookup': (np.asarray(draft[b]).tolist(), np.asarray(valid[b]).tolist(),
                     int(matched[b]))}


def branch_blocks_reference(tiny, bundle, spec, state):
  """What D2SD's tree must hold: per row a list of (cut, branch tokens), by
  drafter_logits_reference."""
  return [[(cut, tokens) for cut, tokens, _ in
           drafter_logits_reference(tiny, bundle, spec, state, b)['branches']]
          for b in range(state.seq_BxL.shape[0])]


def tree_branches(tree, b, gamma):
  """Per branch of row b's packed tree: (cut, [anchor .. branch tokens]) by walking parents."""
  tokens, parents = np.asarray(tree.tokens_BxT[b]), np.asarray(tree.parents_BxT[b])
  valid = np.asarray(tree.valid_BxT[b])
  branches, node = [], gamma
  while node < len(tokens) and valid[node]:
    cut = int(parents[node])
    path = []
    while node < len(tokens) and (not path or parents[node] == node - 1) and valid[node]:
      path.append(int(tokens[node]))
      node += 1
    prefix = [int(tokens[0])] + [int(t) for t in tokens[1:cut + 1]]
    branches.append((cut, prefix + path))
  return branches


def check_d2sd_tree_is_drafter2(tiny, bundle, cycles=3, branch_passes=1):
  """After a few cycles on PROMPTS, D2SD's tree holds drafter 1's chain, branches at the top-K
  r(i) cuts, and exactly what drafter 2 drafts alone from each branch prefix (and, with
  branch_passes > 1, from each longer prefix its passes see). Returns the branches drafted."""
  cfg, _ = tiny
  spec = SP.SpecSettings(AR.GenerationSettings(max_new_tokens=40, eos_ids=(), pad_id=0),
                         method='d2sd', gamma=DCFG.gamma, drafter1=DCFG, drafter2=DCFG2,
                         n_branches=3, branch_passes=branch_passes)
  drafted = []
  init, draft, _, _, _ = _stage_programs()
  step = jax.jit(SP.spec_step, static_argnames=('cfg', 'settings'))
  block, lens = AR.pad_prompts(PROMPTS, 0, bucket=8)
  state = init(bundle, cfg, spec, block, lens, AR.row_keys(0, range(3)),
               SP.cache_size_needed(block.shape[1], spec))
  for c in range(cycles):
    tree = draft(bundle, cfg, spec, state)
    want = branch_blocks_reference(tiny, bundle, spec, state)
    for b in range(3):
      got = tree_branches(tree, b, spec.gamma)
      assert [c_ for c_, _ in got] == [c_ for c_, _ in want[b]], (c, b, got, want[b])
      assert got == want[b], (c, b, got, want[b])
      drafted.append(got)
    state = step(bundle, cfg, spec, state)
  return drafted


def check_branch_points():
  """drafting.branch_points = the K largest r(i) = c_1..c_i (1 - c_{i+1}), enumerated in numpy
  on random confidences (most likely first)."""
  rng = np.random.default_rng(0)
  conf = rng.uniform(0.05, 0.99, (64, 8))
  got = np.asarray(drafting.branch_points(jnp.asarray(conf, jnp.float32), 3))
  for b in range(64):
    c = conf[b, 1:]
    r = [np.prod(c[:i]) * (1 - c[i]) for i in range(7)]
    assert got[b].tolist() == sorted(range(7), key=lambda i: -r[i])[:3], (b, got[b], r)


def check_merged_cuts():
  """redraft='merge': a branch's cut is its last position agreeing with the chain; a branch
  equal to the chain, or the later of two that leave it at the same node with the same token,
  is dropped."""
  chain = jnp.asarray([[50, 1, 2, 3, 4, 5]])
  branches = jnp.asarray([[[50, 1, 9, 9, 9, 9],    # cut 0, agrees at 1: hangs at 1
                           [50, 1, 2, 3, 4, 5],    # equal throughout: dropped
                           [50, 1, 2, 3, 8, 8],    # cut 2 -> 3
                           [50, 1, 9, 7, 7, 7]]])  # leaves at 1 with 9 like branch 0: dropped
  cut, keep = drafting.merged_cuts(chain, branches)
  assert cut.tolist() == [[1, 5, 3, 1]] and keep.tolist() == [[True, False, True, False]]


def check_every_verified_node_reachable(tiny, bundle, methods=('dflash_resample', 'dflash_dflash',
                                                               'd2sd', 'd2sd_pld')):
  """No verified node is a repeat of an earlier sibling's token (sample-and-match could never
  enter it): every valid node of every tree drafted along a generation is reachable."""
  cfg, _ = tiny
  gen = AR.GenerationSettings(max_new_tokens=20, eos_ids=(), pad_id=0)
  runs = [(m, 'exclude') for m in methods] + [(m, 'merge') for m in methods
                                                if m in ('dflash_dflash', 'd2sd', 'd2sd_pld')]
  for method, redraft in runs:
    spec = SP.SpecSettings(gen, method=method, gamma=DCFG.gamma, drafter1=DCFG, drafter2=DCFG2,
                           n_branches=3, redraft=redraft)
    trees = []
    run_cycles(cfg, bundle, spec, PROMPTS, check_caches=False,
               on_cycle=lambda state, tree, acc, new: trees.append((state.done_B, tree)))
    shrunk = 0
    for done, tree in trees:
      live = ~np.asarray(done)[:, None]
      unreachable = np.asarray(tree.valid_BxT & ~tree_lib.reachable(tree)) & live
      assert not unreachable.any(), (method, redraft, np.argwhere(unreachable))
      shrunk += int(np.sum((np.asarray(tree.valid_BxT).sum(1) < spec.tree_size) & live[:, 0]))
    if redraft == 'merge' and method != 'd2sd_pld':
      assert shrunk, method  # (branches did start on the chain's token and were merged)


# ----------------------------------------------------------------------------------------------
# Multi-step denoising and per-row drafting, against direct references


_drafter_forward = jax.jit(D.forward, static_argnums=(1, 3))
_context_kv = jax.jit(D.context_kv, static_argnums=(1,))


def _reference_denoise(dparams, dcfg, tparams, tcfg, tokens_BxQ, is_mask_BxQ, positions_BxQ,
                       ctx, ctx_mask_BxS, steps, sign=1.0):
  """drafter.denoise written out eagerly: every pass is one plain drafter forward (a dense
  block-diagonal mask); in each block it commits the ceil(M / steps) masked positions of
  highest confidence (sign=-1: of lowest), ties to the lower position, in numpy float64.
  Returns (tokens, conf, probs, the smallest confidence gap a choice depended on)."""
  tokens, mask = np.array(tokens_BxQ), np.array(is_mask_BxQ)
  B, Q = tokens.shape
  G = dcfg.gamma
  per_step = -(-mask.reshape(B, Q // G, G).sum(2) // steps)
  conf_out = np.ones((B, Q))
  probs_out = np.eye(tcfg.vocab_size)[tokens]
  block_mask = np.kron(np.eye(Q // G, dtype=bool), np.ones((G, G), bool))
  gap = np.inf
  for _ in range(steps):
    lg = np.asarray(_drafter_forward(dparams, dcfg, tparams, tcfg, tokens, mask, positions_BxQ,
                                     ctx, ctx_mask_BxS, np.broadcast_to(block_mask, (B, Q, Q))),
                    np.float64)
    p = np.exp(lg - lg.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    zc = (lg - lg.max(-1, keepdims=True)) / dcfg.confidence_temperature
    conf = 1.0 / np.exp(zc).sum(-1)
    for b in range(B):
      for blk in range(Q // G):
        masked = [q for q in range(blk * G, (blk + 1) * G) if mask[b, q]]
        order = sorted(masked, key=lambda q: (-sign * conf[b, q], q))
        n = int(per_step[b, blk])
        if 0 < n < len(order):
          gap = min(gap, abs(conf[b, order[n - 1]] - conf[b, order[n]]))
        for q in order[:n]:
          tokens[b, q], conf_out[b, q] = int(np.argmax(lg[b, q])), conf[b, q]
          probs_out[b, q], mask[b, q] = p[b, q], False
  return tokens, conf_out, probs_out, gap


def check_denoise_confidence_order(tiny, bundle):
  """Multi-step denoising (`order='confidence'`) commits the most confident masked positions
  first, in every block: it equals the eager reference on drafter 1 (trained: its confidences
  vary), for 2 and 4 passes over blocks of 4 and 3 masked positions side by side, in rows
  of different contexts. The order really matters here: the least-confident-first reference
  drafts other distributions."""
  cfg, params = tiny
  dparams, G = bundle['drafter1'], DCFG.gamma
  rng = np.random.default_rng(1)
  B, n = 4, 12
  seq = rng.integers(1, cfg.vocab_size, (B, n + 1)).astype(np.int32)
  _, feats = fresh_prefill(cfg, params, jnp.asarray(seq), DCFG.feature_layers)
  ctx = _context_kv(dparams, DCFG, D.features_of(np.asarray(feats)[:, :n]),
                    np.broadcast_to(np.arange(n), (B, n)))
  ctx_mask = np.ones((B, n), bool)
  # Block 0: the anchor and 4 masks; block 1: the anchor, a given token and 3 masks.
  block = np.zeros((B, 2 * G), np.int32)
  block[:, 0] = block[:, G] = seq[:, n]
  block[:, G + 1] = seq[:, 0]
  is_mask = np.tile(np.r_[np.arange(G) > 0, np.arange(G) > 1], (B, 1))
  positions = np.broadcast_to(n + np.tile(np.arange(G), 2), (B, 2 * G))
  denoise = jax.jit(D.denoise, static_argnums=(1, 3), static_argnames=('steps', 'order'))
  for steps in (2, 4):
    tokens, conf, probs = denoise(dparams, DCFG, params, cfg, block, is_mask, positions, ctx,
                                  ctx_mask, steps=steps, order='confidence')
    ref_tokens, ref_conf, ref_probs, gap = _reference_denoise(
        dparams, DCFG, params, cfg, block, is_mask, positions, ctx, ctx_mask, steps)
    assert gap > 1e-4, gap  # no near-tie: the order is well defined in float32
    np.testing.assert_allclose(np.asarray(probs), ref_probs, atol=1e-5, err_msg=f'steps={steps}')
    np.testing.assert_allclose(np.asarray(conf), ref_conf, atol=1e-5, err_msg=f'steps={steps}')
    np.testing.assert_array_equal(np.asarray(tokens), ref_tokens, err_msg=f'steps={steps}')
    _, _, reverse_probs, _ = _reference_denoise(dparams, DCFG, params, cfg, block, is_mask,
                                                positions, ctx, ctx_mask, steps, sign=-1.0)
    assert np.abs(reverse_probs - ref_probs).max() > 1e-2, steps


def check_rows_draft_as_alone(tiny, bundle, methods=('d2sd',), cycles=1):
  """Every row of a batch of rows of different committed lengths (PROMPTS: 10, 1 and 6 tokens;
  with cycles > 1, then what each cycle commits) drafts the tree it drafts alone, from its own
  context length: the same tokens, parents and validity (drafter 1's chain, the cuts its
  confidences choose, drafter 2's branches)."""
  cfg, _ = tiny
  gen = AR.GenerationSettings(max_new_tokens=20, eos_ids=(), pad_id=0)
  init, draft, _, _, _ = _stage_programs()
  block, lens = AR.pad_prompts(PROMPTS, 0, bucket=8)
  for method in methods:
    spec = SP.SpecSettings(gen, method=method, gamma=DCFG.gamma, drafter1=DCFG, drafter2=DCFG2,
                           n_branches=3)
    state = init(bundle, cfg, spec, block, lens, AR.row_keys(0, range(len(PROMPTS))),
                 SP.cache_size_needed(block.shape[1], spec))
    for c in range(cycles):
      assert len(set(np.asarray(state.cache_len_B).tolist())) == len(PROMPTS)
      tree = draft(bundle, cfg, spec, state)
      for b in range(len(PROMPTS)):
        alone = draft(bundle, cfg, spec, jax.tree.map(
            lambda x: np.asarray(x)[b:b + 1] if x.ndim else x, state))
        for field in ('tokens_BxT', 'parents_BxT', 'valid_BxT'):
          np.testing.assert_array_equal(np.asarray(getattr(tree, field))[b],
                                        np.asarray(getattr(alone, field))[0],
                                        err_msg=f'{method}, cycle {c}, row {b}: {field}')
      if c + 1 < cycles:
        state = jax.jit(SP.spec_step, static_argnames=('cfg', 'settings'))(bundle, cfg, spec, state)
