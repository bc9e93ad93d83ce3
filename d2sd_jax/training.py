"""What `train.py` runs: the optax loop that trains drafter 1 or drafter 2 (the VP drafter).

The frozen target computes the context features inside the jitted step; anchors (and, for the
VP drafter, prefix lengths) are drawn from fold_in(seed, step), and the batch of step t is a
pure function of (seed, t): an interrupted run resumed from its checkpoint ends with exactly
the parameters of an uninterrupted one. Checkpoints are Orbax (params, optimizer state, step)
plus JSON metadata naming the target they were trained for.
"""
from __future__ import annotations

import json
import math
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
from tqdm import tqdm

from d2sd_jax import calibration
from d2sd_jax import checkpoints as ckpt
from d2sd_jax import data as data_lib
from d2sd_jax import drafter as drafter_lib
from d2sd_jax import loaders
from d2sd_jax import losses
from d2sd_jax import model as model_lib

KINDS = ('drafter1', 'drafter2')


def drafter_config(config) -> drafter_lib.DrafterConfig:
  d = config.drafter
  return drafter_lib.DrafterConfig(
      gamma=d.gamma, n_layers=d.n_layers, d_model=d.d_model, n_heads=d.n_heads,
      n_kv_heads=d.n_kv_heads, head_dim=d.head_dim, d_ff=d.d_ff,
      feature_layers=tuple(d.feature_layers), rope_base=d.rope_base, norm_eps=d.norm_eps)


def validate(config) -> None:
  if config.kind not in KINDS:
    raise ValueError(f'kind={config.kind!r} is not one of {KINDS}')
  t = config.train
  for name in ('batch_size', 'anchors_per_seq', 'steps'):
    if t[name] < 1:
      raise ValueError(f'train.{name}={t[name]} must be >= 1')
  if config.data.source not in ('shards', 'tfds'):
    raise ValueError(f"data.source={config.data.source!r}: use 'shards' or 'tfds'")
  if config.data.seq_len <= config.drafter.gamma:
    raise ValueError(f'data.seq_len={config.data.seq_len} must exceed drafter.gamma='
                     f'{config.drafter.gamma}')
  if not 0.0 < config.loss.beta < 1.0:
    raise ValueError(f'loss.beta={config.loss.beta} must be in (0, 1)')
  if config.loss.tau <= 0 or config.loss.decay <= 0:
    raise ValueError('loss.tau and loss.decay must be > 0')


def optimizer(config):
  t = config.train
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, t.lr, max(1, t.warmup), max(t.steps, t.warmup + 1), end_value=t.lr * 0.1)
  return optax.chain(optax.clip_by_global_norm(t.clip),
                     optax.adamw(schedule, weight_decay=t.weight_decay))


def sample_blocks(key, label_mask_BxL, config, gamma: int):
  """Anchors at positions whose next token is a label (response region), + prefix lengths and
  loss weights for this drafter kind."""
  B, L = label_mask_BxL.shape
  A = config.train.anchors_per_seq
  k_anchor, k_prefix = jax.random.split(key)
  ok = jnp.concatenate([label_mask_BxL[:, 1:], jnp.zeros((B, 1), bool)], axis=1)
  logits = jnp.where(ok, 0.0, -jnp.inf)
  anchors = jax.random.categorical(k_anchor, logits[:, None, :], axis=-1, shape=(B, A))
  if config.kind == 'drafter1':
    prefix = jnp.zeros((B, A), jnp.int32)
    weights = losses.vp_weights(jnp.zeros((1,), jnp.int32), gamma, config.loss.decay)
    weights = jnp.broadcast_to(weights, (B, A, gamma))
  else:
    prior = losses.vp_prefix_prior(gamma, config.loss.beta)
    prefix = jax.random.choice(k_prefix, gamma - 1, (B, A), p=prior).astype(jnp.int32)
    weights = losses.vp_weights(prefix.reshape(-1), gamma, config.loss.tau).reshape(B, A, gamma)
  return anchors.astype(jnp.int32), prefix, weights


def make_train_step(config, tcfg, dcfg, opt):

  def loss_fn(dparams, tparams, tokens, label_mask, key, calibrate=False):
    B, L = tokens.shape
    _, _, feats = model_lib.forward(tparams, tcfg, tokens, jnp.broadcast_to(jnp.arange(L), (B, L)),
                                    model_lib.init_cache(tcfg, B, L), jnp.zeros((B,), jnp.int32),
                                    feature_layers=dcfg.feature_layers)
    feats = jax.lax.stop_gradient(drafter_lib.features_of(feats))
    anchors, prefix, weights = sample_blocks(key, label_mask, config, dcfg.gamma)
    return losses.drafter_loss(dparams, dcfg, tparams, tcfg, tokens, feats, label_mask, anchors,
                               prefix, weights, calibrate)

  def train_step(dparams, opt_state, tparams, tokens, label_mask, key):
    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(dparams, tparams, tokens,
                                                                     label_mask, key)
    updates, opt_state = opt.update(grads, opt_state, dparams)
    metrics['grad_norm'] = optax.tree.norm(grads)
    return optax.apply_updates(dparams, updates), opt_state, metrics

  def eval_step(dparams, tparams, tokens, label_mask, key):
    return loss_fn(dparams, tparams, tokens, label_mask, key, calibrate=True)[1]

  return jax.jit(train_step, donate_argnums=(0, 1)), jax.jit(eval_step)


def run(config: ml_collections.ConfigDict) -> dict:
  validate(config)
  target = loaders.load_target(config.target, 'float32')
  dcfg = drafter_config(config)
  dcfg.check_target(target.cfg)
  if config.data.source == 'tfds':  # the prepared TFDS copy (python -m d2sd_jax.tfds_data)
    from d2sd_jax import tfds_data  # pylint: disable=import-outside-toplevel
    records = tfds_data.read_records(config.data.tfds_dir)
  else:
    records = data_lib.read_records(config.data.path)
  data = data_lib.SequenceData(records, config.data.seq_len, target.tokenizer.pad_id,
                               config.data.eval_fraction)
  opt = optimizer(config)
  train_step, eval_step = make_train_step(config, target.cfg, dcfg, opt)

  workdir = os.path.abspath(config.workdir)
  manager = ckpt.manager(os.path.join(workdir, 'checkpoints'), keep=config.keep)
  meta = ckpt.checkpoint_metadata(config.kind, config.target, target, dcfg)
  dparams = drafter_lib.init_params(dcfg, target.cfg, jax.random.PRNGKey(config.train.seed))
  opt_state = opt.init(dparams)
  start = 0
  if manager.latest_step() is not None:
    start = manager.latest_step()
    items = ckpt.restore(manager, start, target, {'params': dparams, 'opt_state': opt_state})
    dparams, opt_state = items['params'], items['opt_state']
    print(f'resumed from step {start}', flush=True)

  def save(step):
    manager.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(dparams), opt_state=ocp.args.StandardSave(opt_state),
        meta=ocp.args.JsonSave(meta)), force=True)

  log = MetricsLog(workdir)
  key0 = jax.random.PRNGKey(config.train.seed)
  B, L = config.train.batch_size, config.data.seq_len
  last = {}
  t0, tokens_done = time.time(), 0
  bar = tqdm(range(start, config.train.steps), initial=start, total=config.train.steps,
             disable=not config.progress_bar)
  for step in bar:
    tokens, labels = data.batch(step, B, config.train.seed)
    dparams, opt_state, metrics = train_step(dparams, opt_state, target.params, tokens, labels,
                                             jax.random.fold_in(key0, step))
    tokens_done += B * L
    if (step + 1) % config.log_every == 0 or step + 1 == config.train.steps:
      metrics = jax.device_get(metrics)
      loss = float(metrics['loss'])
      if not math.isfinite(loss):
        raise FloatingPointError(
            f'loss is {loss} at step {step + 1}: lower train.lr or raise train.warmup; the last '
            f'good checkpoint is step {manager.latest_step()} in {manager.directory}')
      last = {'step': step + 1, 'loss': loss, 'grad_norm': float(metrics['grad_norm']),
              'acc_by_pos': [round(float(a), 4) for a in metrics['acc_by_pos']],
              'tokens_per_s': round(tokens_done / (time.time() - t0), 1)}
      bar.set_postfix(loss=f'{loss:.3f}', acc1=f'{last["acc_by_pos"][1]:.3f}')
      log.write(step + 1, last, {'train/loss': loss, 'train/grad_norm': last['grad_norm'],
                                 'train/acc_pos1': last['acc_by_pos'][1],
                                 'train/tokens_per_s': last['tokens_per_s']})
    if config.eval_every and (step + 1) % config.eval_every == 0 and data.size('eval'):
      last['eval'] = evaluate(eval_step, dparams, target, data, config, key0)
      meta['confidence_temperature'] = last['eval']['confidence_temperature']
      ev = last['eval']
      log.write(step + 1, {'step': step + 1, 'eval': ev},
                {'eval/loss': ev['loss'], 'eval/tau_estimate': ev['tau_estimate'],
                 'eval/ece': ev['ece'], 'eval/ece_calibrated': ev['ece_calibrated']})
    if (step + 1) % config.save_every == 0 or step + 1 == config.train.steps:
      save(step + 1)
  manager.wait_until_finished()
  log.close()
  last['params'] = dparams
  return last


class MetricsLog:
  """Metrics as JSON lines (metrics.jsonl) and TensorBoard event files (tb/) in the workdir."""

  def __init__(self, workdir: str):
    from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
    self.path = os.path.join(workdir, 'metrics.jsonl')
    self.tb = SummaryWriter(os.path.join(workdir, 'tb'))

  def write(self, step: int, record: dict, scalars: dict):
    with open(self.path, 'a') as f:
      f.write(json.dumps(record) + '\n')
    for name, value in scalars.items():
      self.tb.add_scalar(name, value, step)
    self.tb.flush()

  def close(self):
    self.tb.close()


def evaluate(eval_step, dparams, target, data, config, key0) -> dict:
  """Held-out loss, per-position agreement and the acceptance length it implies for one chain
  (tau ≈ 1 + sum_k prod_{j<=k} acc_j, treating positions as independent)."""
  B = config.train.batch_size
  n = max(1, data.size('eval') // B)
  acc_sum, cnt_sum, loss_sum, calib = 0, 0, 0.0, 0
  for i in range(n):
    tokens, labels = data.batch(i, B, 0, split='eval')
    m = jax.device_get(eval_step(dparams, target.params, tokens, labels,
                                 jax.random.fold_in(key0, 10**9 + i)))
    acc_sum = acc_sum + m['acc_by_pos'] * m['count_by_pos']
    cnt_sum = cnt_sum + m['count_by_pos']
    loss_sum += float(m['loss'])
    calib = calib + m['calibration']
  acc = acc_sum / np.maximum(cnt_sum, 1)
  tau = 1.0 + float(np.sum(np.cumprod(acc[1:])))
  temperature, ece_after, ece_before = calibration.fit_temperature(calib)
  best = list(calibration.TEMPERATURES).index(temperature)
  return {'loss': loss_sum / n, 'acc_by_pos': [round(float(a), 4) for a in acc],
          'tau_estimate': round(tau, 3), 'ece': round(ece_before, 4),
          'confidence_temperature': temperature, 'ece_calibrated': round(ece_after, 4),
          'reliability_calibrated': calibration.reliability(calib[best])}
