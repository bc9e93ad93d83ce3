"""What `train.py` runs: the optax loop that trains drafter 1 or drafter 2 (the VP drafter).

The frozen target's context features come either from inside the jitted step or, with
`train.precompute_features` (the CPU recipe), from a float16 file computed once
(`d2sd_jax.train.features`). Anchors (and,
for the VP drafter, prefix lengths) are drawn from fold_in(seed, step), and the batch of step t
is a pure function of (seed, t), read per host through a grain pipeline (`grain_data`): an
interrupted run (or one stopped by SIGTERM / SIGINT, which saves first) resumed from its
checkpoint ends with exactly the parameters of an uninterrupted one. Checkpoints are Orbax
(params, optimizer state, the data iterator's position, step) plus JSON metadata naming the
target they were trained for. The step runs over a ('data', 'model') mesh (`d2sd_jax.models.sharding`).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import signal
import threading
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
from tqdm import tqdm

from d2sd_jax.train import blocks as blocks_lib
from d2sd_jax.train import calibration
from d2sd_jax.formats import checkpoints as ckpt
from d2sd_jax.train import data as data_lib
from d2sd_jax.train import features as features_lib
from d2sd_jax.models import drafter as drafter_lib
from d2sd_jax.train import grain_data
from d2sd_jax.formats import loaders
from d2sd_jax.train import losses
from d2sd_jax.models import sharding
from d2sd_jax.models import xla_options
from d2sd_jax.formats import drafters as drafter_formats
from d2sd_jax.formats.drafters import load_drafter
from d2sd_jax.train import architecture
from d2sd_jax.train import run_log
from d2sd_jax.train import schema

KINDS = schema.KINDS
validate = schema.validate  # (the checks live with the fields they check)


def drafter_config(config, tcfg=None) -> drafter_lib.DrafterConfig:
  """The run's drafter architecture (`architecture.resolve`): the drafter.* fields set, else
  init_from's, else what follows from the target (config `tcfg`)."""
  source = None
  if config.get('init_from'):
    try:
      source = drafter_formats.drafter_config(config.init_from)
    except (OSError, ValueError) as e:
      raise type(e)(f'init_from={config.init_from!r}: {e}') from e
  dcfg = architecture.resolve(config.drafter, tcfg, config.get('target', ''), source,
                              config.get('init_from', ''))
  if config.data.seq_len <= dcfg.gamma:
    raise ValueError(f'data.seq_len={config.data.seq_len} must exceed drafter.gamma={dcfg.gamma}')
  return dcfg


def optimizer(config):
  t = config.train
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, t.lr, max(1, t.warmup), max(t.steps, t.warmup + 1), end_value=t.lr * 0.1)
  return optax.chain(optax.clip_by_global_norm(t.clip),
                     optax.adamw(schedule, weight_decay=t.weight_decay))


def make_train_step(config, tcfg, dcfg, opt, compiler_options: dict | None = None,
                    frozen: tuple[str, ...] = (), chain=None):
  """Jitted (train_step, eval_step). Both take `feats` (precomputed target features, any
  float dtype) or None, in which case the frozen target computes them inside the step.

  Mixed precision: the optimizer keeps float32 master weights; with train.compute_dtype =
  'bfloat16' the loss casts them (and the features) to bfloat16, so the drafter's matmuls run in
  bfloat16 and the gradients flow back to the float32 masters. train.grad_accum = k splits the
  batch into k micro-batches (a scan: activations of one at a time) whose summed gradients,
  divided by the batch's total loss weight, equal the whole batch's. train.remat recomputes each
  drafter layer in the backward pass instead of storing its activations. compiler_options: the
  platform's (models/xla_options.py), for the devices of the run's mesh. frozen: parameters
  kept as they are (`drafter.split_fixed`). chain: (config, params) of the drafter 1 whose
  first rejections place drafter 2's blocks (loss.cuts_from, at_chain_cuts), or None."""
  t = config.train
  compute = t.get('compute_dtype', 'float32')
  accum, remat = t.get('grad_accum', 1), t.get('remat', False)
  cdcfg = dataclasses.replace(dcfg, dtype=compute)

  soft = config.loss.get('soft', 0.0)

  def loss_fn(trainable, fixed, tparams, tokens, label_mask, targets, blocks, feats,
              calibrate=False, normalizer=None):
    if feats is None:
      feats = features_lib.target_features(tparams, tcfg, dcfg, tokens)
    feats = jax.lax.stop_gradient(feats.astype(compute))
    params = {**jax.tree.map(lambda x: x.astype(compute), trainable), **fixed}
    anchors, prefix, weights, reveal, forbid = blocks
    return losses.drafter_loss(params, cdcfg, tparams, tcfg, tokens, feats, label_mask, anchors,
                               prefix, weights, calibrate, reveal, normalizer, remat,
                               label_ids_BxL=targets.get('label_ids'),
                               topk=(targets['topk_ids'], targets['topk_probs']) if soft else None,
                               soft=soft, forbid_BxAxG=forbid)

  def blocks_for(key, tparams, tokens, label_mask, targets, feats, chain_params, evaluate):
    """This step's blocks, and the features (computed here when the chain needs them)."""
    blocks = blocks_lib.sample_blocks(key, label_mask, config, dcfg.gamma, evaluate)
    if chain_params is None:
      return blocks, feats
    if feats is None:
      feats = features_lib.target_features(tparams, tcfg, dcfg, tokens)
    return blocks_lib.at_chain_cuts(blocks, (chain[0], chain_params), tparams, tcfg, feats,
                                    tokens, label_mask, targets.get('label_ids'), config, key,
                                    evaluate), feats

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def accumulated(trainable, fixed, tparams, tokens, label_mask, targets, blocks, feats):
    # Micro-batch k holds rows k, k + accum, k + 2 accum, ...: every data shard (a contiguous
    # block of rows) holds its share of each micro-batch. Contiguous micro-batches put each on
    # one data shard: compiled for a v5e-32 slice (benchmarks/tpu_compile.py --train), every
    # device then ran every micro-batch, all-reducing the teacher pass's [32, 2048, 4096]
    # residual stream in every layer.
    micro = lambda x: x.reshape(x.shape[0] // accum, accum, *x.shape[1:]).swapaxes(0, 1)

    def one(grads, xs):
      (_, m), g = grad_fn(trainable, fixed, tparams, *xs, normalizer=1.0)
      return jax.tree.map(jnp.add, grads, g), m

    xs = jax.tree.map(micro, (tokens, label_mask, targets, blocks, feats))
    grads, ms = jax.lax.scan(one, jax.tree.map(jnp.zeros_like, trainable), xs)
    weight = jnp.maximum(jnp.sum(ms['weight']), 1e-9)
    counts = jnp.sum(ms['count_by_pos'], 0)
    metrics = {'loss': jnp.sum(ms['loss']) / weight, 'weight': weight, 'count_by_pos': counts,
               'acc_by_pos': jnp.sum(ms['acc_by_pos'] * ms['count_by_pos'], 0) / jnp.maximum(
                   counts, 1)}
    return jax.tree.map(lambda g: g / weight, grads), metrics

  def train_step(dparams, opt_state, tparams, tokens, label_mask, key, feats=None, targets=None,
                 chain_params=None):
    targets = targets or {}
    trainable, fixed = drafter_lib.split_fixed(dparams, frozen)
    blocks, feats = blocks_for(key, tparams, tokens, label_mask, targets, feats, chain_params,
                               False)
    if accum == 1:
      (_, metrics), grads = grad_fn(trainable, fixed, tparams, tokens, label_mask, targets, blocks,
                                    feats)
    else:
      grads, metrics = accumulated(trainable, fixed, tparams, tokens, label_mask, targets, blocks,
                                   feats)
    updates, opt_state = opt.update(grads, opt_state, trainable)
    metrics['grad_norm'] = optax.tree.norm(grads)
    return {**optax.apply_updates(trainable, updates), **fixed}, opt_state, metrics

  def eval_step(dparams, tparams, tokens, label_mask, key, feats=None, targets=None,
                chain_params=None):
    targets = targets or {}
    trainable, fixed = drafter_lib.split_fixed(dparams, frozen)
    blocks, feats = blocks_for(key, tparams, tokens, label_mask, targets, feats, chain_params,
                               True)
    return loss_fn(trainable, fixed, tparams, tokens, label_mask, targets, blocks, feats,
                   calibrate=True)[1]

  steps = (jax.jit(train_step, donate_argnums=(0, 1), compiler_options=compiler_options),
           jax.jit(eval_step, compiler_options=compiler_options))
  if chain is None:
    return steps
  return tuple(functools.partial(f, chain_params=chain[1]) for f in steps)


class StopRequest:
  """SIGTERM / SIGINT during training: finish the step, save a checkpoint, return. A preempted
  pod job or a Ctrl-C loses nothing; rerunning the command resumes exactly."""

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.signum = None
    self._previous = {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():  # handlers only work there
      for sig in self.SIGNALS:
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame):
    del frame
    self.signum = signum

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


def run(config: ml_collections.ConfigDict, on_step=None) -> dict:
  """Trains (or resumes) the run in config.workdir. `on_step(step)` is called after each
  completed step (tests use it)."""
  validate(config)
  sharding.maybe_initialize_distributed(config.get('distributed', False))
  mesh_cfg = config.get('mesh') or {'data': -1, 'model': 1}
  mesh = sharding.make_mesh(mesh_cfg['data'], mesh_cfg['model'])
  with sharding.tracing_under(mesh):
    return _train(config, mesh, on_step)


def _train(config: ml_collections.ConfigDict, mesh, on_step) -> dict:
  sharding.check_batch(mesh, config.train.batch_size)
  chief = jax.process_index() == 0  # logs and progress from one process (Orbax saves from all)
  # The frozen target in config.dtype, each tensor straight onto its sharding (an 8B target in
  # bfloat16 never exists whole in float32, nor on one device).
  target = loaders.load_target(config.target, config.get('dtype', 'float32'), mesh)
  misfit = config.get('init_from') and drafter_formats.target_mismatch(config.init_from, target)
  if misfit:  # (before its architecture is taken: its feature layers may not fit this target)
    raise ValueError(f'init_from={config.init_from!r}: {misfit}. Set --config.init_from to a '
                     'drafter for this target (drafter 2: your drafter 1\'s workdir), or to \'\'')
  dcfg = drafter_config(config, target.cfg)
  dcfg.check_target(target.cfg)
  # A mask embedding that is the target's embedding of a token (a DFlash drafter's, or
  # drafter.mask_token_id) stays so: what the DFlash format stores, so that it exports.
  mask_token = architecture.mask_token(
      config.drafter, target.cfg.vocab_size,
      drafter_formats.mask_token_id(config.init_from) if config.get('init_from') else None,
      config.get('init_from', ''))
  frozen = ('mask_embed',) if mask_token is not None else ()
  if chief:
    print(f'drafter: {architecture.describe(dcfg)}' + (
        f' (from {config.init_from})' if config.get('init_from') else ''), flush=True)
  # Every record is checked here, before training: a malformed one names its file and line.
  soft_k = config.loss.get('soft_k', 8) if config.loss.get('soft', 0.0) else 0
  data = data_lib.from_config(config.data, target.tokenizer, target.cfg.vocab_size, soft_k)
  opt = optimizer(config)
  train_step, eval_step = make_train_step(
      config, target.cfg, dcfg, opt, xla_options.for_platform(mesh.devices.flat[0].platform),
      frozen, chain_drafter(config, target, dcfg, mesh))

  workdir = os.path.abspath(config.workdir)
  manager = ckpt.manager(os.path.join(workdir, 'checkpoints'), keep=config.keep)
  # (a target folder by its absolute path: export_drafter.py finds it from anywhere)
  recorded = (os.path.abspath(config.target) if os.path.exists(config.target) else
              config.target)
  meta = ckpt.checkpoint_metadata(config.kind, recorded, target, dcfg)
  if mask_token is not None:
    meta['dflash'] = {'mask_token_id': mask_token}
  dparams = drafter_lib.init_params(dcfg, target.cfg, jax.random.PRNGKey(config.train.seed))
  if mask_token is not None:
    dparams['mask_embed'] = jnp.asarray(target.params['embed'][mask_token], jnp.float32)
  if dcfg.head_vocab:
    dparams['head_ids'] = drafter_lib.choose_head_ids(
        *data.token_counts(target.cfg.vocab_size, target.tokenizer.pad_id), dcfg.head_vocab)
  dparams = jax.device_put(dparams, sharding.drafter_shardings(mesh, dparams))
  init_opt = jax.jit(lambda p: opt.init(drafter_lib.split_fixed(p, frozen)[0]))  # p's sharding
  rows = sharding.process_rows(config.train.batch_size)
  train_batches = grain_data.iterator(
      grain_data.batches(data, 'train', config.train.batch_size, config.train.seed, rows,
                         max(config.train.steps, manager.latest_step() or 0)),
      config.data.get('prefetch', 2))
  start = 0
  if manager.latest_step() is not None:
    start = manager.latest_step()
    saved_meta = _same_architecture(manager, start, target, dcfg, workdir)
    opt_state = init_opt(dparams)
    items = ckpt.restore(manager, start, target, {'params': dparams, 'opt_state': opt_state})
    dparams, opt_state = items['params'], items['opt_state']
    if 'confidence_temperature' in saved_meta:
      meta['confidence_temperature'] = saved_meta['confidence_temperature']
    data_from = grain_data.restore(manager, start, train_batches)
    if chief:
      print(f'resumed from step {start}' + ('' if data_from == 'checkpoint' else
                                            ' (data position from the step)'), flush=True)
  else:
    if config.get('init_from'):
      dparams = initial_params(config.init_from, target, dcfg, dparams)
      dparams = jax.device_put(dparams, sharding.drafter_shardings(mesh, dparams))
    opt_state = init_opt(dparams)
  feats = {'train': None, 'eval': None}
  features_dir = os.path.abspath(config.data.get('features_dir') or os.path.join(workdir,
                                                                                 'features'))
  if config.train.get('precompute_features'):
    for split in feats:
      if data.size(split):  # one file per part (a corpus added later reuses the main file)
        feats[split] = features_lib.Rows([
            features_lib.precompute_features(target, dcfg, tokens,
                                             os.path.join(features_dir, split),
                                             progress=config.progress_bar and chief)
            for tokens in data.token_arrays(split)])

  def on_device(batch, split):
    """This process's rows of a global batch (from grain) as arrays sharded over 'data'; the
    features of its windows looked up by window index. Returns (tokens, label mask, features,
    targets: label_ids and the soft labels, if any)."""
    f = None if feats[split] is None else sharding.global_batch(mesh, feats[split][batch['index']])
    targets = {k: sharding.global_batch(mesh, batch[k])
               for k in ('label_ids', 'topk_ids', 'topk_probs') if k in batch}
    return (sharding.global_batch(mesh, batch['tokens']),
            sharding.global_batch(mesh, batch['labels']), f, targets)

  eval_batches = grain_data.batches(data, 'eval', config.train.batch_size, 0, rows,
                                    max(1, data.size('eval') // config.train.batch_size)
                                    ) if data.size('eval') else None

  def save(step):
    manager.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(dparams), opt_state=ocp.args.StandardSave(opt_state),
        meta=ocp.args.JsonSave(meta), **{grain_data.ITEM: grain_data.checkpoint_save(
            train_batches)}), force=True)

  log = run_log.MetricsLog(workdir, enabled=chief)
  key0 = jax.random.PRNGKey(config.train.seed)
  B, L = config.train.batch_size, config.data.seq_len
  last = {}
  t0, tokens_done = time.time(), 0
  bar = tqdm(range(start, config.train.steps), initial=start, total=config.train.steps,
             disable=not (config.progress_bar and chief))
  with StopRequest() as stop:
    for step in bar:
      tokens, labels, f, targets = on_device(next(train_batches), 'train')
      dparams, opt_state, metrics = train_step(dparams, opt_state, target.params, tokens, labels,
                                               jax.random.fold_in(key0, step), f, targets)
      tokens_done += B * L
      done = step + 1
      final = done == config.train.steps
      if done % config.log_every == 0 or final:
        metrics = jax.device_get(metrics)
        loss = float(metrics['loss'])
        if not math.isfinite(loss):
          raise FloatingPointError(
              f'loss is {loss} at step {done}: lower train.lr or raise train.warmup; the last '
              f'good checkpoint is step {manager.latest_step()} in {manager.directory}')
        last = {'step': done, 'loss': loss, 'grad_norm': float(metrics['grad_norm']),
                'acc_by_pos': [round(float(a), 4) for a in metrics['acc_by_pos']],
                'tokens_per_s': round(tokens_done / (time.time() - t0), 1)}
        bar.set_postfix(loss=f'{loss:.3f}', acc1=f'{last["acc_by_pos"][1]:.3f}')
        if chief and not config.progress_bar:  # (no bar: a line per log_every steps)
          print(f'step {done}/{config.train.steps}: loss {loss:.4f}, acc1 '
                f'{last["acc_by_pos"][1]:.3f}, {last["tokens_per_s"]:.0f} tokens/s', flush=True)
        log.write(done, last, {'train/loss': loss, 'train/grad_norm': last['grad_norm'],
                               'train/acc_pos1': last['acc_by_pos'][1],
                               'train/tokens_per_s': last['tokens_per_s']})
      if config.eval_every and (done % config.eval_every == 0 or final) and data.size('eval'):
        last['eval'] = evaluate(eval_step, dparams, target, data, config, key0,
                                lambda i: on_device(eval_batches[i], 'eval'))
        meta['confidence_temperature'] = last['eval']['confidence_temperature']
        ev = last['eval']
        log.write(done, {'step': done, 'eval': ev},
                  {'eval/loss': ev['loss'], 'eval/tau_estimate': ev['tau_estimate'],
                   'eval/ece': ev['ece'], 'eval/ece_calibrated': ev['ece_calibrated']})
      if on_step is not None:
        on_step(done)
      if done % config.save_every == 0 or final or stop.signum is not None:
        save(done)
      if stop.signum is not None:
        manager.wait_until_finished()
        name = signal.Signals(stop.signum).name
        print(f'\n{name}: stopped after step {done}; checkpoint saved in {manager.directory}. '
              'Rerun the same command to resume.', flush=True)
        last['stopped_by'] = name
        break
  manager.wait_until_finished()
  log.close()
  if chief and 'stopped_by' not in last:
    print(run_log.next_steps(config, os.path.join(manager.directory,
                                                  str(manager.latest_step())),
                             dflash=mask_token is not None), flush=True)
  last['params'] = dparams
  return last


def _same_architecture(manager, step: int, target, dcfg, workdir: str) -> dict:
  """The metadata of the workdir's checkpoint `step`, after checking that it was made for this
  target and this drafter architecture (a changed config is not a damaged checkpoint)."""
  try:
    saved = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta']
  except Exception:  # pylint: disable=broad-except
    return {}  # unreadable: ckpt.restore says so
  ckpt.check_metadata(saved, target, os.path.join(manager.directory, str(step)))
  diff = architecture.changed(saved.get('drafter') or {}, dcfg)
  if diff:
    raise ValueError(f'workdir {workdir} holds a drafter of another architecture: the config '
                     f'changed ({"; ".join(diff)}): use another workdir, or the old values')
  return saved


def chain_drafter(config, target, dcfg, mesh):
  """(config, params) of loss.cuts_from, the drafter 1 whose chain places drafter 2's blocks,
  or None. It must read the same target features as the drafter trained (they are shared)."""
  path = config.loss.get('cuts_from', '')
  if not path:
    return None
  ccfg, cparams, _ = load_drafter(path, target)
  if (ccfg.gamma, tuple(ccfg.feature_layers)) != (dcfg.gamma, tuple(dcfg.feature_layers)):
    raise ValueError(f'loss.cuts_from={path!r} drafts gamma={ccfg.gamma} from feature layers '
                     f'{list(ccfg.feature_layers)}; this drafter has gamma={dcfg.gamma} and '
                     f'{list(dcfg.feature_layers)}: name a drafter 1 built alike, or set '
                     "loss.cuts_from=''")
  print(f'blocks at the first rejections of {path}', flush=True)
  return ccfg, jax.device_put(cparams, sharding.drafter_shardings(mesh, cparams))


def initial_params(path: str, target, dcfg, dparams: dict) -> dict:
  """Parameters of another drafter (e.g. drafter 1 to start drafter 2, or a DFlash folder) as
  this run's start; the architecture must match (`drafter_config` takes it from there)."""
  src_cfg, src, _ = load_drafter(path, target)
  mismatch = [f'{f}: {getattr(src_cfg, f)!r} there, {getattr(dcfg, f)!r} here'
              for f in architecture.FIELDS if getattr(src_cfg, f) != getattr(dcfg, f)]
  if mismatch:
    raise ValueError(f'init_from={path!r} has a different drafter architecture '
                     f'({"; ".join(mismatch)}): drop the drafter.* flags that differ, or drop '
                     'init_from')
  print(f'initialised from {path}', flush=True)
  return jax.tree.map(lambda a, b: jnp.asarray(a, b.dtype), src, dparams)


def evaluate(eval_step, dparams, target, data, config, key0, batch_of) -> dict:
  """Held-out loss, per-position agreement and the acceptance length it implies for one chain
  (tau ≈ 1 + sum_k prod_{j<=k} acc_j, treating positions as independent)."""
  B = config.train.batch_size
  n = max(1, data.size('eval') // B)
  acc_sum, cnt_sum, loss_sum, calib = 0, 0, 0.0, 0
  for i in range(n):
    tokens, labels, f, targets = batch_of(i)
    m = jax.device_get(eval_step(dparams, target.params, tokens, labels,
                                 jax.random.fold_in(key0, 10**9 + i), f, targets))
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
