"""A teacher-forced corpus: local text and code labelled with the target's next tokens:

  python scripts/corpus.py --out data/corpus                 # label everything (resumable)
  python scripts/corpus.py --out data/corpus --count_only    # how many tokens there are
  python scripts/corpus.py --roots ~/src/a,~/src/b --out data/mine   # any folders of text
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from d2sd_jax import files
from d2sd_jax.formats import loaders
from d2sd_jax.train import corpus


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out', default='data/corpus')
  parser.add_argument('--target', default='smollm2')
  parser.add_argument('--roots', default='', help='comma-separated folders (default: the '
                      'standard library and site-packages)')
  parser.add_argument('--seq_len', type=int, default=512)
  parser.add_argument('--batch_size', type=int, default=4)
  parser.add_argument('--shard_windows', type=int, default=256)
  parser.add_argument('--top_k', type=int, default=0, help='also store the top-k next tokens')
  parser.add_argument('--max_windows', type=int, default=0, help='0: all of them')
  parser.add_argument('--count_only', action='store_true', help='tokenize and count, no labels')
  args = parser.parse_args()
  if args.seq_len < 2:
    parser.error('--seq_len must be at least 2')

  target = loaders.load_target(args.target)
  tok = target.tokenizer
  roots = args.roots.split(',') if args.roots else corpus.default_roots()
  meta = {'target': args.target, 'roots': roots, 'seq_len': args.seq_len, 'order': 'shuffled-0',
          'shard_windows': args.shard_windows, 'top_k': args.top_k, 'eos_id': tok.eos_ids[0]}
  meta_path = os.path.join(args.out, 'meta.json')
  windows_path = os.path.join(args.out, 'windows.npy')
  if not args.count_only and os.path.exists(windows_path):
    # Resuming: label the windows cut the first time (the installed packages may have changed
    # since; the shards already written refer to these), without tokenizing again.
    with open(meta_path) as f:
      old = json.load(f)
    changed = sorted(k for k in meta if old.get(k) != meta[k])
    if changed:
      parser.error(f'{args.out} was built with other settings ({", ".join(changed)} differ): '
                   'rerun with those, or use a new --out')
    tokens = np.load(windows_path, mmap_mode='r')
    print(f'{args.out}: resuming over its {len(tokens)} windows', flush=True)
  else:
    t0 = time.time()
    docs = list(corpus.tokenize(corpus.read_texts(corpus.source_files(roots)), tok))
    tokens = corpus.windows((ids for _, ids in docs), tok.eos_ids[0], args.seq_len, shuffle_seed=0)
    by_ext = {}
    for path, ids in docs:
      ext = os.path.splitext(path)[1]
      by_ext[ext] = by_ext.get(ext, 0) + len(ids)
    print(json.dumps({'roots': roots, 'files': len(docs), 'tokens': sum(by_ext.values()),
                      'tokens_by_extension': by_ext, 'windows': len(tokens),
                      'seq_len': args.seq_len, 'tokenize_s': round(time.time() - t0, 1)}),
          flush=True)
    if args.count_only:
      return
    os.makedirs(args.out, exist_ok=True)
    with open(meta_path, 'w') as f:
      json.dump({**meta, 'windows': len(tokens)}, f)
    with files.replaced(windows_path, '.npy') as tmp:  # (after meta.json: it marks the cut)
      np.save(tmp, tokens)
  if args.max_windows:
    tokens = tokens[:args.max_windows]
  corpus.label_shards(target.params, target.cfg, tokens, args.out, args.shard_windows,
               args.batch_size, args.top_k, log=lambda m: print(m, flush=True))


if __name__ == '__main__':
  main()
