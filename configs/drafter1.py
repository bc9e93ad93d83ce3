"""Train drafter 1 (block diffusion) for the SmolLM2 target, or any other (`target`).

  python train.py --config configs/drafter1.py [--config.train.steps=2000]
"""
import ml_collections
from ml_collections.config_dict import placeholder


def get_config():
  c = ml_collections.ConfigDict()
  c.kind = 'drafter1'  # 'drafter1' (anchor + all masks) or 'drafter2' (variable prefix)
  c.target = 'smollm2'  # the target the drafter learns (must match at decode time)
  c.dtype = 'float32'  # the frozen target's weights ('bfloat16' on pods: half the memory)
  c.workdir = 'runs/drafter1'  # checkpoints/ and metrics.jsonl go here; rerun to resume
  # A drafter whose weights AND architecture start this run: a train.py workdir, an exported
  # drafter or a DFlash folder (drafter 2: drafter 1's); '' = from scratch
  c.init_from = ''

  # The drafter's architecture (d2sd_jax/train/architecture.py). None = not set: with init_from,
  # the starting drafter's (all of it; a set field must agree with it); from scratch, the value
  # after "None:" (for SmolLM2 exactly the shipped drafters' architecture).
  c.drafter = ml_collections.ConfigDict()
  c.drafter.gamma = placeholder(int)  # block: anchor + gamma-1 drafts. None: 8 (suits CPU
  #                                      verification; 16 on GPU/TPU, DFlash's block)
  c.drafter.n_layers = placeholder(int)  # transformer layers. None: 2
  c.drafter.d_model = placeholder(int)  # width. None: the target's (no in/out projections)
  c.drafter.n_heads = placeholder(int)  # None: the target's
  c.drafter.n_kv_heads = placeholder(int)  # None: the target's
  c.drafter.head_dim = placeholder(int)  # None: the target's
  c.drafter.d_ff = placeholder(int)  # FFN width. None: the target's
  # Target hidden states fed to the drafter (0 = the embeddings). None: DFlash's choice, one
  # per drafter layer spread from the target's second to its third-last layer; the 'smollm2'
  # target: (1, 10, 20, 29), what its shipped drafters read
  c.drafter.feature_layers = placeholder(tuple)
  c.drafter.rope_base = placeholder(float)  # None: the target's
  c.drafter.norm_eps = placeholder(float)  # None: the target's
  # Per-head RMSNorm of queries and keys (Qwen3 layers; DFlash format needs them). None: the
  # target's (SmolLM2: False; Qwen3: True)
  c.drafter.qk_norm = placeholder(bool)
  # The drafter predicts only the data's N likeliest tokens (0: all). None: 8192 (0 for a
  # vocabulary of at most 16384 tokens)
  c.drafter.head_vocab = placeholder(int)
  # The mask embedding. None: a learned vector (with init_from, the starting drafter's mask);
  # N: the target's embedding of token N, kept frozen, as DFlash drafters have it (a drafter
  # then exports to DFlash format unchanged: scripts/dflash.py export)
  c.drafter.mask_token_id = placeholder(int)

  c.data = ml_collections.ConfigDict()
  # 'shards' (gzip JSONL from d2sd_jax.train.distill: the target's own responses, the best labels),
  # 'tfds' (any TFDS dataset prepared as array_record: token records, or text to bootstrap from)
  # or 'conversations' (a JSONL of ShareGPT / OpenAI conversations: its assistant turns)
  c.data.source = 'shards'
  c.data.path = 'data/distill'  # 'shards': folder(s), comma-separated; 'conversations': a JSONL
  c.data.tfds_dir = 'data/tfds'  # python scripts/prepare_tfds.py --shards data/distill --data_dir ...
  c.data.tfds_name = 'd2sd_distill'  # the TFDS dataset (name[/config][:version]) in tfds_dir
  c.data.tfds_split = 'train'  # its split (the eval set is held out of it by record id)
  c.data.text_field = 'text'  # a dataset without prompt_ids/response_ids: its text feature
  c.data.prefetch = 2  # batches each host reads ahead in grain threads (0: in the train loop)
  c.data.seq_len = 320  # tokens per training window (prompt tail + response)
  c.data.eval_fraction = 0.05  # records held out for evaluation
  # What is held out whole: 'record' (by id: a held-out record's package was trained on, so its
  # figures measure memory) or 'source' (whole packages, standard-library modules and question
  # subjects: held-out figures then measure generalisation; the shipped drafters used 'record')
  c.data.holdout = 'record'
  c.data.features_dir = ''  # precomputed teacher features ('' = workdir/features); runs share it
  # A teacher-forced corpus (python scripts/corpus.py --seq_len 320): text labelled with the
  # target's own next-token predictions, mixed into the training windows ('' = none)
  c.data.corpus_path = ''
  c.data.corpus_windows = 0  # corpus windows used (its first N; 0 = all): the mix

  c.train = ml_collections.ConfigDict()
  c.train.batch_size = 4  # sequences per step
  c.train.anchors_per_seq = 48  # blocks drawn per sequence (all in one drafter pass)
  c.train.steps = 4000
  c.train.lr = 1e-3  # peak AdamW learning rate (warmup, then cosine to 10 %)
  c.train.warmup = 200
  c.train.weight_decay = 0.01
  c.train.clip = 1.0  # global gradient-norm clip
  c.train.seed = 0
  c.train.precompute_features = True  # teacher features once, to a float16 file (False: in-step)
  c.train.compute_dtype = 'float32'  # drafter arithmetic; 'bfloat16' keeps float32 master weights
  c.train.grad_accum = 1  # micro-batches per step (same update, 1/k of the activations)
  c.train.remat = False  # recompute drafter layers in the backward pass (memory for compute)
  # Anchors drawn without replacement (distinct positions; a window with fewer label positions
  # than anchors_per_seq leaves the rest unused), as the D²SD reference draws them
  c.train.distinct_anchors = False

  c.loss = ml_collections.ConfigDict()
  c.loss.decay = 4.0  # drafter 1: position weights exp(-(k-1)/decay)
  c.loss.beta = 0.8  # drafter 2: prefix-length prior P(l=j) ∝ beta^j
  # drafter 2's prefix lengths: '' (beta^l, l = 0..gamma-2), 'reference' (the D²SD reference's:
  # l = 1..14 ∝ 0.9^(l+1)) or weights per l ('0.38,0.25,...': e.g. the chain's measured first
  # rejections, which benchmarks/drafter_quality.py prints as rejection_prior)
  c.loss.prefix_prior = ''
  c.loss.tau = 4.0  # drafter 2: weights exp(-(k-l-1)/tau)
  # drafter 2: each block's weights sum to 1 (True), or one weighted mean over the batch of the
  # raw exp(-(k-l-1)/tau) (False, the D²SD reference's)
  c.loss.block_norm = True
  # drafter 2: a drafter 1 whose chain, drafted at each anchor, places the block at its first
  # rejection (the only cut where a branch can add tokens), its rejected token forbidden there
  # as decoding's redraft='exclude' forbids it; the prior above is then unused ('' = off)
  c.loss.cuts_from = ''
  # Fraction of blocks partly unmasked (a ratio t ~ U(0,1) of the positions after the prefix
  # shown, no loss on them), so multi-step denoising (spec.steps > 1) has learnt what its later
  # passes see; 0 = every block fully masked after its prefix, as the shipped drafters trained.
  c.loss.reveal = 0.0
  # Corpus labels: weight of the target's top-k distribution (soft) against its argmax (hard);
  # 0 = argmax only. Needs a corpus built with --top_k >= soft_k.
  c.loss.soft = 0.0
  c.loss.soft_k = 8

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1  # data-parallel axis size (-1: all devices not used by mesh.model)
  c.mesh.model = 1  # tensor-parallel axis size (-1: all devices not used by mesh.data)
  c.distributed = False  # True on multi-host pod slices: jax.distributed.initialize()

  c.log_every = 10  # steps between metrics lines
  c.eval_every = 500  # steps between held-out evaluations (0 = never)
  c.save_every = 100  # steps between checkpoints
  c.keep = 3  # checkpoints kept
  c.progress_bar = True
  return c
