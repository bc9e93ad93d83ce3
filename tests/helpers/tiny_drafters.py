"""The tiny drafters of the speculative-decoding tests: random ones (`bundle_for`), ones trained
on the tiny target's greedy outputs (`trained_bundle`) and ones fitted to its sampled
continuations (`sampled_bundle`), each cached on disk so the test processes of one machine train
them once; and the prompts, drafter configs and tree settings they are made for."""
import functools
import hashlib
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax

from d2sd_jax.models import drafter as D
from d2sd_jax.models import sampling as S
from d2sd_jax.models import target as M
from d2sd_jax.spec_decode import ar as AR
from d2sd_jax.spec_decode import speculative as SP
from d2sd_jax.train import losses
from tests.helpers.programs import full_last_logits, jitted

PROMPTS = [[5, 9, 2, 33, 7, 1, 60, 5, 9, 2], [12], [40, 41, 42, 43, 40, 41]]
DCFG = D.DrafterConfig(gamma=5, n_layers=1, d_model=32, n_heads=4, n_kv_heads=2, head_dim=8,
                       d_ff=48, feature_layers=(0, 2), rope_base=10000.0, norm_eps=1e-6)
DCFG2 = D.DrafterConfig(**{**DCFG.__dict__, 'feature_layers': (1, 2)})


def tree_spec(method, budget, max_new=14, **kw):
  """SpecSettings of a best-first tree (or another method) of `budget` nodes over these
  drafters: gamma 5, 3 branches, greedy, no EOS."""
  return SP.SpecSettings(AR.GenerationSettings(max_new_tokens=max_new, eos_ids=(), pad_id=0),
                         method=method, gamma=5, drafter1=DCFG, drafter2=DCFG2, n_branches=3,
                         tree_budget=budget, **kw)


def bundle_for(tiny):
  """Random (untrained) drafters: their drafts are almost never accepted."""
  cfg, params = tiny
  return {'target': params, 'drafter1': D.init_params(DCFG, cfg, jax.random.PRNGKey(5)),
          'drafter2': D.init_params(DCFG2, cfg, jax.random.PRNGKey(6))}


# ----------------------------------------------------------------------------------------------
# Trained tiny drafters: fitted to the tiny target's own greedy outputs (PROMPTS among them), so
# their drafts are accepted often, on the chain and on drafter 2's branches.


def _training_data(cfg, params):
  rng = np.random.default_rng(0)
  prompts = PROMPTS + [rng.integers(1, 64, rng.integers(1, 10)).tolist() for _ in range(29)]
  n = 40
  gen = AR.GenerationSettings(max_new_tokens=n, eos_ids=(), pad_id=0)
  block, lens = AR.pad_prompts(prompts, 0, bucket=8)
  ar = jitted()[0](params, cfg, gen, block, lens, AR.row_keys(0, range(len(prompts))),
                   block.shape[1] + n)
  L = block.shape[1] + n
  seq = np.zeros((len(prompts), L), np.int32)
  label = np.zeros((len(prompts), L), bool)
  for b, p in enumerate(prompts):
    seq[b, :len(p) + n] = p + np.asarray(ar.out_BxN[b]).tolist()
    label[b, len(p):len(p) + n] = True
  return jnp.asarray(seq), jnp.asarray(label)


def _adam(dparams, loss_fn, steps: int, key):
  """`steps` Adam steps (lr 3e-3) on loss_fn(params, key), one key per step, in one scan."""
  opt = optax.adam(3e-3)

  def step(carry, k):
    p, s = carry
    updates, s = opt.update(jax.grad(loss_fn)(p, k), s, p)
    return (optax.apply_updates(p, updates), s), None

  (dparams, _), _ = jax.lax.scan(step, (dparams, opt.init(dparams)), jax.random.split(key, steps))
  return dparams


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _fit(dparams, dcfg, tcfg, vp, steps, tparams, seq_BxL, label_BxL, key):
  B, L = seq_BxL.shape
  _, _, feats = M.forward(tparams, tcfg, seq_BxL, jnp.broadcast_to(jnp.arange(L), (B, L)),
                          M.init_cache(tcfg, B, L), jnp.zeros((B,), jnp.int32),
                          feature_layers=dcfg.feature_layers)
  feats = D.features_of(feats)
  A, Gm = 16, dcfg.gamma

  def loss_fn(p, k):
    ka, kl = jax.random.split(k)
    anchors = jax.random.randint(ka, (B, A), 1, L - 1)
    prefix = (jax.random.choice(kl, Gm - 1, (B, A), p=losses.vp_prefix_prior(Gm, 0.7)) if vp
              else jnp.zeros((B, A), jnp.int32))
    weights = losses.vp_weights(prefix.reshape(-1), Gm, 3.0).reshape(B, A, Gm)
    return losses.drafter_loss(p, dcfg, tparams, tcfg, seq_BxL, feats, label_BxL, anchors,
                               prefix, weights)[0]
  return _adam(dparams, loss_fn, steps, key)


def trained_bundle(tiny, steps: int = 400):
  """{'target', 'drafter1', 'drafter2'}: drafter 1 (plain) and drafter 2 (VP objective) trained
  on the tiny target's greedy outputs. Cached on disk by the training code and the target, so
  the test processes of one machine train them once (about 15 s)."""
  cfg, params = tiny

  def train(init):
    seq, label = _training_data(cfg, params)
    return {'drafter1': _fit(init['drafter1'], DCFG, cfg, False, steps, params, seq, label,
                             jax.random.PRNGKey(1)),
            'drafter2': _fit(init['drafter2'], DCFG2, cfg, True, steps, params, seq, label,
                             jax.random.PRNGKey(2))}

  return _cached_drafters(tiny, steps, train)


def _cached_drafters(tiny, recipe, train, drafter2_cfg=DCFG2):
  """The bundle of `train(initial drafters)`, cached on disk under a fingerprint of this file
  (the data and the training recipes), `recipe`, the configs, jax's version and the target."""
  cfg, params = tiny
  with open(__file__, 'rb') as f:
    fp = hashlib.sha256(f.read() + repr((DCFG, drafter2_cfg, recipe, cfg,
                                         jax.__version__)).encode())
  for x in jax.tree.leaves(params):
    fp.update(np.asarray(x).tobytes())
  path = os.path.join(tempfile.gettempdir(), f'd2sd_tiny_drafters_{fp.hexdigest()[:16]}.npz')
  init = {'drafter1': D.init_params(DCFG, cfg, jax.random.PRNGKey(5)),
          'drafter2': D.init_params(drafter2_cfg, cfg, jax.random.PRNGKey(6))}
  if os.path.exists(path):
    with np.load(path) as f:
      flat = [jnp.asarray(f[f'a{i}']) for i in range(len(f.files))]
    trained = jax.tree.unflatten(jax.tree.structure(init), flat)
  else:
    trained = train(init)
    tmp = path + f'.{os.getpid()}.tmp.npz'
    np.savez(tmp, **{f'a{i}': np.asarray(x) for i, x in enumerate(jax.tree.leaves(trained))})
    os.replace(tmp, path)
  return {'target': params, **trained}


# ----------------------------------------------------------------------------------------------
# Tiny drafters fitted to the target's sampled continuations: branches accepted at T > 0


WINDOW_PROMPT = PROMPTS[0]  # the prompt of the end-to-end law tests (test_acceptance.py)
WINDOW_NEW = 8  # tokens per training continuation: the law windows' blocks end by then


def _sampled_continuations(cfg, params, rows: int = 48):
  """[rows, P + WINDOW_NEW]: WINDOW_PROMPT and a continuation sampled from the target at T = 1,
  top-k 4 (the contexts the sampled law tests reach), drawn in numpy from the reference
  forward."""
  rng, settings, law = np.random.default_rng(0), S.SamplingSettings(temperature=1.0, top_k=4), {}
  seqs = []
  for _ in range(rows):
    seq = list(WINDOW_PROMPT)
    for _ in range(WINDOW_NEW):
      if tuple(seq) not in law:
        p = np.asarray(S.probs(full_last_logits(cfg, params, jnp.asarray([seq])), settings),
                       np.float64)
        law[tuple(seq)] = p / p.sum()
      seq.append(int(rng.choice(cfg.vocab_size, p=law[tuple(seq)])))
    seqs.append(seq)
  return jnp.asarray(seqs, jnp.int32)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _fit_soft(dparams, dcfg, tcfg, steps, tparams, seq_BxL, vp, key, k: int = 8):
  """Adam on the soft-label loss: at every generated position the target's k likeliest next
  tokens with their T = 1 probabilities, so that a drafter's second choice is the target's;
  anchors at the generated positions, prefixes from the VP prior where `vp` (traced: both
  drafters train in one program, vmapped)."""
  B, L = seq_BxL.shape
  h, _, feats = M.forward(tparams, tcfg, seq_BxL, jnp.broadcast_to(jnp.arange(L), (B, L)),
                          M.init_cache(tcfg, B, L), jnp.zeros((B,), jnp.int32),
                          feature_layers=dcfg.feature_layers)
  feats = D.features_of(feats)
  probs, ids = jax.lax.top_k(jax.nn.softmax(M.logits(tparams, tcfg, h), -1), k)
  # Position t's label is the law of token t: the logits after token t - 1.
  shift = lambda x: jnp.concatenate([x[:, :1], x[:, :-1]], 1)
  topk = (shift(ids).astype(jnp.int32), shift(probs))
  P = L - WINDOW_NEW
  label = jnp.broadcast_to(jnp.arange(L) >= P, (B, L))
  A, Gm = 8, dcfg.gamma

  def loss_fn(p, k):
    ka, kl = jax.random.split(k)
    anchors = jax.random.randint(ka, (B, A), P, L - 1)
    prefix = jnp.where(vp, jax.random.choice(kl, Gm - 1, (B, A), p=losses.vp_prefix_prior(Gm, 0.7)),
                       0)
    weights = losses.vp_weights(prefix.reshape(-1), Gm, 3.0).reshape(B, A, Gm)
    return losses.drafter_loss(p, dcfg, tparams, tcfg, seq_BxL, feats, label, anchors, prefix,
                               weights, topk=topk, soft=1.0)[0]
  return _adam(dparams, loss_fn, steps, key)


def sampled_bundle(tiny, steps: int = 200):
  """{'target', 'drafter1', 'drafter2'} fitted to the target's sampled continuations of
  WINDOW_PROMPT with soft labels: at T > 0 the target often draws its second choice, and
  drafter 2's branches (drafter 1's too, re-drafted) carry it, so paths through branches are
  accepted in many cycles. Both have drafter 1's config (DCFG: one training program for the
  two); drafter 2 is trained with the VP objective. Cached on disk like trained_bundle."""
  cfg, params = tiny

  def train(init):
    seq = _sampled_continuations(cfg, params)
    both = jax.tree.map(lambda *x: jnp.stack(x), init['drafter1'], init['drafter2'])
    fit = lambda p, vp, key: _fit_soft(p, DCFG, cfg, steps, params, seq, vp, key)
    both = jax.jit(jax.vmap(fit))(both, jnp.asarray([False, True]),
                                  jax.random.split(jax.random.PRNGKey(3)))
    return {'drafter1': jax.tree.map(lambda x: x[0], both),
            'drafter2': jax.tree.map(lambda x: x[1], both)}

  return _cached_drafters(tiny, ('sampled', steps), train, drafter2_cfg=DCFG)
