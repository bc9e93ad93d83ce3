"""The notebook entry point: `d2sd_jax.load(...)` returns a ready `Decoder`.

  import d2sd_jax
  dec = d2sd_jax.load('smollm2', drafter1='drafters/smollm2-drafter1',
                      drafter2='drafters/smollm2-drafter2')
  out = dec.generate(['def fib(n):'], max_new_tokens=64, chat=False)
  out.texts, out.stats['tau']

`dec.save(path)` writes the target (parameters, architecture, tokenizer) and the drafters as
Orbax checkpoints in one folder, and `d2sd_jax.load(path)` restores all of it, optionally
onto a mesh (`mesh=...`, see `d2sd_jax.models.sharding`). Decoding goes through the same programs as
decode.py (one jitted prefill, one `lax.while_loop` per batch).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import tokenizers

from d2sd_jax.formats import checkpoints as ckpt
from d2sd_jax.decode import generate as generate_lib
from d2sd_jax.decode import options as options_lib
from d2sd_jax.formats import loaders
from d2sd_jax.models import target as model_lib
from d2sd_jax.formats import tokenizer as tokenizer_lib
from d2sd_jax.formats.drafters import load_drafter
from d2sd_jax.models import sharding

DECODER_FILE = 'd2sd_decoder.json'
TARGET_FILE = 'd2sd_target.json'
DRAFTERS = options_lib.DRAFTERS
_DEFAULTS = options_lib.Options(method='ar')  # generate()'s defaults are options_lib.Options'


@dataclasses.dataclass
class Generation:
  texts: list[str]
  ids: list[list[int]]
  stats: dict  # method, prompts, new_tokens, decode_s, decode_tokens_per_s, tau, cycles, ...


class Decoder:
  """A target and its drafters, ready to generate with any method."""

  def __init__(self, target: loaders.Target, drafters: dict | None = None,
               method: str | None = None, mesh=None):
    self.target = target
    self.drafters = dict(drafters or {})  # name -> (DrafterConfig, params)
    if method is None:
      method = 'd2sd' if len(self.drafters) == 2 else 'dflash' if self.drafters else 'ar'
    options_lib.check(options_lib.Options(method=method), self.drafters)
    self.method = method
    self.mesh = mesh
    self._runners = {}  # compiled programs, reused by calls with the same shapes

  def generate(self, prompts: str | list[str], max_new_tokens: int = _DEFAULTS.max_new_tokens,
               *, method: str | None = None, chat: bool = _DEFAULTS.chat,
               temperature: float = _DEFAULTS.temperature, top_k: int = _DEFAULTS.top_k,
               top_p: float = _DEFAULTS.top_p, seed: int = _DEFAULTS.seed,
               batch_size: int = _DEFAULTS.batch_size, cache_len: int = _DEFAULTS.cache_len,
               prompt_width: int = _DEFAULTS.prompt_width,
               stage_times: bool = _DEFAULTS.stage_times,
               auto_refresh: bool = _DEFAULTS.auto_refresh,
               auto_probe: bool = _DEFAULTS.auto_probe,
               quality_budget: float = _DEFAULTS.quality_budget,
               chat_template_kwargs: dict | None = None, **spec) -> Generation:
    """Completes each prompt through decode.py's path (`generate_lib.generate`, same defaults).

    chat_template_kwargs: variables for the chat template, as transformers'
    apply_chat_template takes them (e.g. {'enable_thinking': False} for Qwen3).
    spec: speculative knobs, the fields of `speculative.SpecSettings` (gamma: by default the
    drafters' block; n_branches: K, by default min(4, gamma-1); steps, order, tree_budget,
    leniency, ngram_max). The stats include tau and the acceptance histogram for speculative
    methods. Repeated calls with the same shapes reuse the compiled programs; prompt_width
    (pad every prompt to at least this many tokens) gives calls with prompts of other lengths
    the same shapes. quality_budget (method='auto'): the NLL per token the outputs may add over
    the target's own, for speed (0: lossless; decode/quality_route.py)."""
    options = options_lib.Options(
        method=method or self.method, max_new_tokens=max_new_tokens, chat=chat,
        chat_template_kwargs={} if chat_template_kwargs is None else chat_template_kwargs,
        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, batch_size=batch_size,
        cache_len=cache_len, prompt_width=prompt_width, spec=spec, stage_times=stage_times,
        auto_refresh=auto_refresh, auto_probe=auto_probe, quality_budget=quality_budget)
    with sharding.tracing_under(self.mesh):
      completions, stats = generate_lib.generate(self.target, self.drafters, prompts, options,
                                                 self._runners)
    return Generation(texts=[c['completion'] for c in completions],
                      ids=[c['completion_ids'] for c in completions], stats=stats)

  def drop_programs(self) -> None:
    """Forgets the compiled programs kept for later calls, and JAX's own caches of them. Each
    program holds its code mapped into the process: a session that runs many methods and
    shapes (benchmarks/reproduce.py's sections) frees them between phases, and a later call
    compiles again what it needs."""
    self._runners.clear()
    jax.clear_caches()

  def save(self, directory: str) -> str:
    """Target (parameters, architecture, tokenizer) and drafters as Orbax checkpoints in one
    folder that `d2sd_jax.load(directory)` restores. Saving again replaces the earlier save
    atomically: the new one is written whole into a sibling folder, then swapped in, so a crash
    at any point leaves a loadable save (a notebook can be rerun top to bottom)."""
    directory = os.path.abspath(directory)
    fresh, old = save_siblings(directory)
    if os.path.isdir(directory) and not set(os.listdir(directory)) <= set(SAVE_PARTS):
      raise ValueError(f'{directory} holds files that are not a saved decoder; save into a new '
                       'or empty folder (a saved decoder there is replaced)')
    shutil.rmtree(fresh, ignore_errors=True)  # what a crashed save left
    self._write(fresh)
    if os.path.isdir(directory):
      shutil.rmtree(old, ignore_errors=True)  # a crash before the last step of an earlier save
      os.rename(directory, old)
    os.rename(fresh, directory)  # (a crash just before this: load() reads `old`)
    shutil.rmtree(old, ignore_errors=True)
    return directory

  def _write(self, directory: str) -> None:
    os.makedirs(directory)
    save_target(self.target, os.path.join(directory, 'target'))
    for name, (dcfg, params) in self.drafters.items():
      meta = ckpt.checkpoint_metadata(name, 'target', self.target, dcfg)
      meta['confidence_temperature'] = dcfg.confidence_temperature
      mngr = ckpt.manager(os.path.join(directory, name), keep=1)
      mngr.save(0, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                           meta=ocp.args.JsonSave(meta)), force=True)
      mngr.wait_until_finished()
      mngr.close()
    with open(os.path.join(directory, DECODER_FILE), 'w') as f:
      json.dump({'method': self.method, 'drafters': sorted(self.drafters)}, f)


SAVE_PARTS = ('target', *DRAFTERS, DECODER_FILE)  # all a saved decoder folder holds


def save_siblings(directory: str) -> tuple[str, str]:
  """Where Decoder.save writes a new save before swapping it in, and where the earlier save
  waits during the swap."""
  directory = os.path.abspath(directory)
  return directory + '.saving', directory + '.replaced'


def saved_folder(path: str) -> str | None:
  """The saved decoder at `path`, or None if `path` is not one. After a save that crashed
  between its two renames `path` is absent and the earlier save waits beside it: that one."""
  if os.path.isfile(os.path.join(path, DECODER_FILE)):
    return path
  old = save_siblings(path)[1]
  if not os.path.exists(path) and os.path.isfile(os.path.join(old, DECODER_FILE)):
    return old
  return None


def save_target(target: loaders.Target, directory: str) -> None:
  """The target's parameters (Orbax), its architecture and its tokenizer, in one folder."""
  mngr = ckpt.manager(directory, keep=1)
  mngr.save(0, args=ocp.args.Composite(params=ocp.args.StandardSave(target.params)), force=True)
  mngr.wait_until_finished()
  mngr.close()
  tok = target.tokenizer
  info = {'config': dataclasses.asdict(target.cfg), 'source': target.source,
          'fingerprint': ckpt.target_fingerprint(target),  # identity: what drafters check
          'params_fingerprint': ckpt.params_fingerprint(target.cfg, target.params),  # integrity
          'tokenizer': None if tok is None else {
              'eos_ids': list(tok.eos_ids), 'pad_id': tok.pad_id, 'bos_id': tok.bos_id,
              'add_bos': tok.add_bos, 'chat_template': tok.chat_template,
              'bpe': tok.bpe.to_str()}}
  with open(os.path.join(directory, TARGET_FILE), 'w') as f:
    json.dump(info, f)


def load_saved_target(directory: str, sharding=None) -> loaders.Target:
  path = os.path.join(directory, TARGET_FILE)
  try:
    with open(path) as f:
      info = json.load(f)
    cfg = model_lib.ModelConfig(**info['config'])
  except (OSError, json.JSONDecodeError, TypeError, KeyError) as e:
    raise ValueError(f'{path} is missing or unreadable ({e}): save the decoder again') from e
  abstract = jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.PRNGKey(0)))
  if sharding is not None:
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            abstract, sharding(abstract))
  mngr = ckpt.manager(directory, create=False)
  step = mngr.latest_step()
  if step is None:
    raise FileNotFoundError(f'no saved target parameters in {directory}')
  try:
    params = mngr.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract)))['params']
  except Exception as e:
    raise ValueError(f'saved target in {directory} is corrupt or incomplete '
                     f'({type(e).__name__}: {e}): save it again') from e
  t = info['tokenizer']
  tok = None if t is None else tokenizer_lib.Tokenizer(
      bpe=tokenizers.Tokenizer.from_str(t['bpe']), eos_ids=tuple(t['eos_ids']),
      pad_id=t['pad_id'], bos_id=t['bos_id'], add_bos=t['add_bos'],
      chat_template=t['chat_template'])
  target = loaders.Target(cfg=cfg, params=params, tokenizer=tok, source=directory,
                          fingerprint=info['fingerprint'])
  if ckpt.params_fingerprint(cfg, params) != info.get('params_fingerprint', info['fingerprint']):
    raise ValueError(f'saved target in {directory} does not match its recorded fingerprint: '
                     'the parameters were changed or damaged; save it again')
  return target


def load(target: str = 'smollm2', drafter1: str | None = None, drafter2: str | None = None, *,
         method: str | None = None, dtype: str = 'float32', mesh=None) -> Decoder:
  """A ready Decoder from a saved decoder folder (`Decoder.save`), or from a target
  ('smollm2', a .gguf file, a Hugging Face folder) plus drafter checkpoints (train.py workdirs
  or exported drafters). With `mesh` (a jax.sharding.Mesh with 'data' and 'model' axes) the
  parameters are placed by the sharding rules of `d2sd_jax.models.sharding`."""
  shard_target = None
  if mesh is not None:
    shard_target = lambda tree: sharding.target_shardings(mesh, tree)
  root = saved_folder(target)
  if root is not None:
    with open(os.path.join(root, DECODER_FILE)) as f:
      info = json.load(f)
    tgt = load_saved_target(os.path.join(root, 'target'), shard_target)
    paths = {name: os.path.join(root, name) for name in info['drafters']}
    method = method or info['method']
  else:
    tgt = loaders.load_target(target, dtype, mesh)
    paths = {n: p for n, p in (('drafter1', drafter1), ('drafter2', drafter2)) if p}
  generate_lib.tokenizer_of(tgt)  # refused now, not at the first generate()
  drafters = {}
  for name, path in paths.items():
    dcfg, params, _ = load_drafter(path, tgt, tgt.cfg.dtype, mesh)
    drafters[name] = (dcfg, params)
  return Decoder(tgt, drafters, method, mesh)


def acceptance_plot(generation: Generation, ax=None):
  """Bar chart of accepted draft tokens per cycle (matplotlib), from generate()'s stats."""
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  hist = np.asarray(generation.stats.get('accepted_histogram') or [])
  if ax is None:
    _, ax = plt.subplots(figsize=(5, 3))
  ax.bar(np.arange(len(hist)), hist)
  ax.set_xlabel('draft tokens accepted in a cycle')
  ax.set_ylabel('cycles')
  ax.set_title(f"{generation.stats['method']}: tau = {generation.stats.get('tau')}")
  return ax


__all__ = ['Decoder', 'Generation', 'load', 'save_target', 'load_saved_target',
           'acceptance_plot']
