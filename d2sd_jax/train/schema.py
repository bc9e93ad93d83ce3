"""train.py's config: every field with its default and meaning (`TrainConfig`), the config
configs/drafter1.py returns (`default_config`), and the start-up checks (`validate`).

  python train.py --config configs/drafter1.py --config.train.steps=2000 --config.data.path=...

Fields are set with `--config.GROUP.FIELD=VALUE`. A field left None is decided at start-up:
the drafter's architecture by `architecture.resolve` (from init_from, else from the target).
"""
from __future__ import annotations

import dataclasses
import sys

from d2sd_jax import config_check
from d2sd_jax.models import drafter as drafter_lib
from d2sd_jax.train import architecture
from d2sd_jax.train import data as data_lib
from d2sd_jax.train import losses

KINDS = ('drafter1', 'drafter2')


@dataclasses.dataclass(frozen=True)
class Drafter:
  """The drafter's architecture (train/architecture.py). None = not set: with init_from, the
  starting drafter's (all of it; a set field must agree with it); from scratch, the value after
  "None:" (for SmolLM2 exactly the shipped drafters' architecture)."""
  # block: anchor + gamma-1 drafts. None: 8 (suits CPU verification; 16 on GPU/TPU, DFlash's)
  gamma: int | None = None
  n_layers: int | None = None  # transformer layers. None: 2
  d_model: int | None = None  # width. None: the target's (no in/out projections)
  n_heads: int | None = None  # None: the target's
  n_kv_heads: int | None = None  # None: the target's
  head_dim: int | None = None  # None: the target's
  d_ff: int | None = None  # FFN width. None: the target's
  # Target hidden states fed to the drafter (0 = the embeddings). None: DFlash's choice, one per
  # drafter layer spread from the target's second to its third-last layer; the 'smollm2'
  # target: (1, 10, 20, 29), what its shipped drafters read
  feature_layers: tuple[int, ...] | None = None
  rope_base: float | None = None  # None: the target's
  norm_eps: float | None = None  # None: the target's
  # Per-head RMSNorm of queries and keys (Qwen3 layers; DFlash format needs them). None: the
  # target's (SmolLM2: False; Qwen3: True)
  qk_norm: bool | None = None
  # The drafter predicts only the data's N likeliest tokens (0: all). None: 8192 (0 for a
  # vocabulary of at most 16384 tokens)
  head_vocab: int | None = None
  # The mask embedding. None: a learned vector (with init_from, the starting drafter's mask);
  # N: the target's embedding of token N, kept frozen, as DFlash drafters have it (a drafter then
  # exports to DFlash format unchanged: scripts/dflash.py export)
  mask_token_id: int | None = None


@dataclasses.dataclass(frozen=True)
class Data:
  # 'shards' (gzip JSONL from d2sd_jax.train.distill: the target's own responses, the best
  # labels), 'tfds' (any TFDS dataset prepared as array_record: token records, or text to
  # bootstrap from) or 'conversations' (a JSONL of ShareGPT / OpenAI conversations: its
  # assistant turns)
  source: str = 'shards'
  path: str = 'data/distill'  # 'shards': folder(s), comma-separated; 'conversations': a JSONL
  tfds_dir: str = 'data/tfds'  # python scripts/prepare_tfds.py --shards data/distill --data_dir
  tfds_name: str = 'd2sd_distill'  # the TFDS dataset (name[/config][:version]) in tfds_dir
  tfds_split: str = 'train'  # its split (the eval set is held out of it by record id)
  text_field: str = 'text'  # a dataset without prompt_ids/response_ids: its text feature
  prefetch: int = 2  # batches each host reads ahead in grain threads (0: in the train loop)
  seq_len: int = 320  # tokens per training window (prompt tail + response)
  eval_fraction: float = 0.05  # records held out for evaluation
  # What is held out whole: 'record' (by id: a held-out record's package was trained on, so its
  # figures measure memory) or 'source' (whole packages, standard-library modules and question
  # subjects: held-out figures then measure generalisation; the shipped drafters used 'record')
  holdout: str = 'record'
  features_dir: str = ''  # precomputed teacher features ('' = workdir/features); runs share it
  # A teacher-forced corpus (python scripts/corpus.py --seq_len 320): text labelled with the
  # target's own next-token predictions, mixed into the training windows ('' = none)
  corpus_path: str = ''
  corpus_windows: int = 0  # corpus windows used (its first N; 0 = all): the mix


@dataclasses.dataclass(frozen=True)
class Train:
  batch_size: int = 4  # sequences per step
  anchors_per_seq: int = 48  # blocks drawn per sequence (all in one drafter pass)
  steps: int = 4000
  lr: float = 1e-3  # peak AdamW learning rate (warmup, then cosine to 10 %)
  warmup: int = 200
  weight_decay: float = 0.01
  clip: float = 1.0  # global gradient-norm clip
  seed: int = 0
  precompute_features: bool = True  # teacher features once, to a float16 file (False: in-step)
  compute_dtype: str = 'float32'  # drafter arithmetic; 'bfloat16' keeps float32 master weights
  grad_accum: int = 1  # micro-batches per step (same update, 1/k of the activations)
  remat: bool = False  # recompute drafter layers in the backward pass (memory for compute)
  # Anchors drawn without replacement (distinct positions; a window with fewer label positions
  # than anchors_per_seq leaves the rest unused), as the D²SD reference draws them
  distinct_anchors: bool = False


@dataclasses.dataclass(frozen=True)
class Loss:
  decay: float = 4.0  # drafter 1: position weights exp(-(k-1)/decay)
  beta: float = 0.8  # drafter 2: prefix-length prior P(l=j) ∝ beta^j
  # drafter 2's prefix lengths: '' (beta^l, l = 0..gamma-2), 'reference' (the D²SD reference's:
  # l = 1..14 ∝ 0.9^(l+1)) or weights per l ('0.38,0.25,...': e.g. the chain's measured first
  # rejections, which benchmarks/drafter_quality.py prints as rejection_prior)
  prefix_prior: str = ''
  tau: float = 4.0  # drafter 2: weights exp(-(k-l-1)/tau)
  # drafter 2: each block's weights sum to 1 (True), or one weighted mean over the batch of the
  # raw exp(-(k-l-1)/tau) (False, the D²SD reference's)
  block_norm: bool = True
  # drafter 2: a drafter 1 whose chain, drafted at each anchor, places the block at its first
  # rejection (the only cut where a branch can add tokens), its rejected token forbidden there
  # as decoding's redraft='exclude' forbids it; the prior above is then unused ('' = off)
  cuts_from: str = ''
  # With cuts_from: the fraction of blocks placed one token past the chain's cut, the true
  # token there given (no token forbidden): what a branch's second re-drafting pass drafts
  # (spec.branch_passes=2) when its first token is right. 0 = every block at the cut.
  second_pass: float = 0.0
  # Fraction of blocks partly unmasked (a ratio t ~ U(0,1) of the positions after the prefix
  # shown, no loss on them), so multi-step denoising (spec.steps > 1) has learnt what its later
  # passes see; 0 = every block fully masked after its prefix, as the shipped drafters trained.
  reveal: float = 0.0
  # Corpus labels: weight of the target's top-k distribution (soft) against its argmax (hard);
  # 0 = argmax only. Needs a corpus built with --top_k >= soft_k.
  soft: float = 0.0
  soft_k: int = 8


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  kind: str = 'drafter1'  # 'drafter1' (anchor + all masks) or 'drafter2' (variable prefix)
  target: str = 'smollm2'  # the target the drafter learns (must match at decode time)
  dtype: str = 'float32'  # the frozen target's weights ('bfloat16' on pods: half the memory)
  workdir: str = 'runs/drafter1'  # checkpoints/ and metrics.jsonl go here; rerun to resume
  # A drafter whose weights AND architecture start this run: a train.py workdir, an exported
  # drafter or a DFlash folder (drafter 2: drafter 1's); '' = from scratch
  init_from: str = ''
  drafter: Drafter = Drafter()
  data: Data = Data()
  train: Train = Train()
  loss: Loss = Loss()
  mesh: config_check.Mesh = config_check.Mesh()
  distributed: bool = False  # True on multi-host pod slices: jax.distributed.initialize()
  log_every: int = 10  # steps between metrics lines
  eval_every: int = 500  # steps between held-out evaluations (0 = never)
  save_every: int = 100  # steps between checkpoints
  keep: int | None = 3  # checkpoints kept (None: all)
  progress_bar: bool = True


FIELDS = config_check.schema_fields(TrainConfig)  # what check_fields and flag hints know


def default_config(**changes):
  """TrainConfig as the ConfigDict train.py reads, with `changes` (top-level fields, or whole
  groups as dataclasses) applied: a config file is this with its own values."""
  return config_check.as_config(dataclasses.replace(TrainConfig(), **changes))


def validate(config) -> None:
  """Start-up checks that name the field and the fix."""
  config_check.check_fields(config, FIELDS, 'training')
  if config.kind not in KINDS:
    raise ValueError(f'kind={config.kind!r} is not one of {KINDS}')
  t = config.train
  for name in ('batch_size', 'anchors_per_seq', 'steps'):
    if t[name] < 1:
      raise ValueError(f'train.{name}={t[name]} must be >= 1')
  if config.data.source not in data_lib.SOURCES:
    raise ValueError(f'data.source={config.data.source!r}: use one of {data_lib.SOURCES}')
  if config.data.get('prefetch', 0) < 0:
    raise ValueError(f'data.prefetch={config.data.prefetch} must be >= 0')
  gamma = config.drafter.get('gamma')
  if gamma is not None and config.data.seq_len <= gamma:
    raise ValueError(f'data.seq_len={config.data.seq_len} must exceed drafter.gamma={gamma}')
  if not 0.0 < config.loss.beta < 1.0:
    raise ValueError(f'loss.beta={config.loss.beta} must be in (0, 1)')
  prior = config.loss.get('prefix_prior', '')
  if prior and prior != losses.REFERENCE_PRIOR:
    losses.parse_prior(prior, config.drafter.gamma)
  if not 0.0 <= config.loss.get('second_pass', 0.0) <= 1.0:
    raise ValueError(f'loss.second_pass={config.loss.second_pass} must be a fraction in [0, 1]')
  if config.loss.get('second_pass', 0.0) and not config.loss.get('cuts_from', ''):
    raise ValueError('loss.second_pass places blocks past the chain\'s cuts: set '
                     'loss.cuts_from=<drafter 1> too')
  if config.loss.get('cuts_from', '') and config.kind != 'drafter2':
    raise ValueError(f'loss.cuts_from={config.loss.cuts_from!r} places drafter 2\'s blocks; '
                     f'kind={config.kind!r} trains from the anchor alone: set '
                     "loss.cuts_from=''")
  if config.loss.tau <= 0 or config.loss.decay <= 0:
    raise ValueError('loss.tau and loss.decay must be > 0')
  if not 0.0 <= config.loss.get('reveal', 0.0) <= 1.0:
    raise ValueError(f'loss.reveal={config.loss.reveal} must be in [0, 1] (the fraction of blocks '
                     'partly unmasked)')
  if not 0.0 <= config.loss.get('soft', 0.0) <= 1.0:
    raise ValueError(f'loss.soft={config.loss.soft} must be in [0, 1] (the weight of the '
                     "target's top-k distribution against its argmax)")
  if config.loss.get('soft', 0.0) and not config.data.get('corpus_path'):
    raise ValueError('loss.soft needs the target\'s distributions, which only a teacher-forced '
                     'corpus stores: set data.corpus_path (python scripts/corpus.py --top_k 8) '
                     'or loss.soft=0')
  if config.loss.get('soft', 0.0) and config.loss.get('soft_k', 8) < 1:
    raise ValueError(f'loss.soft_k={config.loss.soft_k} must be >= 1')
  if config.data.get('holdout', 'record') not in data_lib.HOLDOUTS:
    raise ValueError(f'data.holdout={config.data.holdout!r}: use one of {data_lib.HOLDOUTS}')
  if not 0.0 <= config.data.eval_fraction < 1.0:
    raise ValueError(f'data.eval_fraction={config.data.eval_fraction} must be in [0, 1)')
  for name in ('log_every', 'save_every'):
    if config[name] < 1:
      raise ValueError(f'{name}={config[name]} must be >= 1')
  if config.keep is not None and config.keep < 1:
    raise ValueError(f'keep={config.keep} must be >= 1 (checkpoints kept) or None (all)')
  if config.train.lr <= 0 or config.train.clip <= 0:
    raise ValueError('train.lr and train.clip must be > 0')
  if t.get('grad_accum', 1) < 1 or t.batch_size % t.get('grad_accum', 1):
    raise ValueError(f'train.grad_accum={t.get("grad_accum")} must be >= 1 and divide '
                     f'train.batch_size={t.batch_size}')
  for name, value in (('dtype', config.get('dtype', 'float32')),
                      ('train.compute_dtype', t.get('compute_dtype', 'float32'))):
    if value not in ('float32', 'bfloat16'):
      raise ValueError(f"{name}={value!r}: use 'float32' or 'bfloat16'")
  given = architecture.given(config.drafter)
  if len(given) == len(architecture.FIELDS):  # all set: the drafter's own checks, now
    drafter_lib.DrafterConfig(**given)
  if t.warmup >= t.steps:
    print(f'warning: train.warmup={t.warmup} >= train.steps={t.steps}: the learning rate never '
          f'reaches train.lr={t.lr}; set --config.train.warmup={max(1, t.steps // 10)} (a tenth '
          'of the steps)', file=sys.stderr, flush=True)
