"""Distillation data: the target's own responses to training prompts (d2sd_jax/train/distill.py):

  python scripts/distill.py --out data/distill --max_prompts 4096
  python scripts/distill.py --out data/distill-questions --source questions --max_prompts 4800
  python scripts/distill.py --out data/chat --prompts sharegpt.jsonl
  python scripts/distill.py --out data/t07 --config configs/smollm2.py --temperature 0.7
"""
from __future__ import annotations

import argparse
import os
import time

from d2sd_jax.formats import conversations
from d2sd_jax.formats import loaders
from d2sd_jax.models import sampling as sampling_lib
from d2sd_jax.models import sharding
from d2sd_jax.spec_decode import ar
from d2sd_jax.train import batching
from d2sd_jax.train import distill


def arg_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out', default='data/distill')
  parser.add_argument('--config', default='', help='a decode config (e.g. configs/smollm2.py) '
                      'whose target, dtype, mesh, temperature, top_k, top_p, seed and '
                      'chat_template_kwargs are the defaults of the flags below')
  parser.add_argument('--target', default=None, help='default smollm2')
  parser.add_argument('--dtype', default=None, choices=('float32', 'bfloat16'),
                      help='the target\'s weights (default float32)')
  parser.add_argument('--mesh_data', type=int, default=None, help='data axis (default -1)')
  parser.add_argument('--mesh_model', type=int, default=None, help='tensor-parallel axis: the '
                      'target\'s weights split over it (default 1)')
  parser.add_argument('--temperature', type=float, default=None, help='default 0: greedy')
  parser.add_argument('--top_k', type=int, default=None, help='default 0: off')
  parser.add_argument('--top_p', type=float, default=None, help='default 1: off')
  parser.add_argument('--seed', type=int, default=None, help='sampling seed (default 0; '
                      'prompt i always samples with the same key)')
  parser.add_argument('--chat_template_kwargs', default=None, help='JSON object of chat '
                      'template variables, e.g. \'{"enable_thinking": false}\'')
  parser.add_argument('--max_prompts', type=int, default=4096)
  parser.add_argument('--max_new_tokens', type=int, default=256)
  parser.add_argument('--max_prompt_tokens', type=int, default=448)
  parser.add_argument('--batch_size', type=int, default=64, help='rows decoded together')
  parser.add_argument('--shard_size', type=int, default=64, help='prompts per shard (keep it '
                      'when resuming: it fixes which prompts each shard holds)')
  parser.add_argument('--length_bounds', default='128', help='cache classes: prompts up to '
                      'each bound (and up to --max_prompt_tokens) share a cache size')
  parser.add_argument('--prompt_bucket', type=int, default=32, help='prefill width multiple')
  parser.add_argument('--source', default='stdlib', choices=distill.SOURCES,
                      help='the built-in prompts: the standard library\'s documented functions, '
                      'the installed packages\' (numpy never), or everyday questions made from '
                      'WordNet\'s common nouns (apt-get install wordnet-base)')
  parser.add_argument('--prompts', default='', help='a JSONL of prompts or conversations '
                      '(d2sd_jax.formats.conversations) instead of the standard-library requests')
  parser.add_argument('--chunk_shards', type=int, default=4, help='--prompts: shards generated '
                      'together, turn by turn')
  return parser


def main(argv=None):
  parser = arg_parser()
  args = parser.parse_args(argv)
  try:  # a bad line or setting is reported before the target loads
    teacher = distill.teacher_settings(args)
    convs = conversations.read(args.prompts) if args.prompts else None
    os.makedirs(args.out, exist_ok=True)
    recorded = {**teacher, 'max_new_tokens': args.max_new_tokens}
    if not args.prompts and args.source != 'stdlib':
      recorded['source'] = args.source
    distill.check_settings(args.out, recorded)
    rows = None if convs is not None else distill.training_prompts(args.max_prompts,
                                                                   source=args.source)
  except (ValueError, OSError) as e:
    parser.error(str(e))

  mesh = sharding.make_mesh(teacher['mesh']['data'], teacher['mesh']['model'])
  target = loaders.load_target(teacher['target'], teacher['dtype'],
                               mesh if mesh.size > 1 else None)
  tok = target.tokenizer
  sampling = sampling_lib.SamplingSettings(teacher['temperature'], teacher['top_k'],
                                           teacher['top_p'])
  settings = ar.GenerationSettings(max_new_tokens=args.max_new_tokens, eos_ids=tok.eos_ids,
                                  pad_id=tok.pad_id, sampling=sampling)
  template = teacher['chat_template_kwargs']
  bounds = sorted({int(b) for b in args.length_bounds.split(',') if b.strip()
                   if int(b) < args.max_prompt_tokens} | {args.max_prompt_tokens})
  generator = batching.Generator(target.params, target.cfg, settings, args.batch_size, bounds,
                                 args.prompt_bucket)
  with sharding.tracing_under(mesh):  # (the TPU attention kernel splits over the mesh)
    t0, log = time.time(), lambda m: print(m, flush=True)
    if convs is not None:
      tokens = distill.distill_conversations(convs, tok, args.out, generator, args.shard_size,
                                     args.max_prompt_tokens, args.chunk_shards, log,
                                     teacher['seed'], template)
    else:
      prompts = distill.encoded(rows, tok, args.max_prompt_tokens, template)
      tokens = distill.distill(prompts, args.out, generator, args.shard_size, log, teacher['seed'])
    print(f'{tokens} tokens in {time.time() - t0:.0f} s ({generator.compile_s:.0f} s compiling)',
          flush=True)


if __name__ == '__main__':
  main()
