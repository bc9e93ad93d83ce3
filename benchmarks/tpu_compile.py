"""A pod user's pre-flight check: our decode and training programs compiled for a real TPU
topology from this host (libtpu's compile-only devices, no TPU), with what the compiler says.

  python benchmarks/tpu_compile.py --topology v5p:1x1x1 --target qwen3-8b --drafters paper \\
      --methods ar,dflash,d2sd [--batch 1] [--context 1024] [--json OUT]
  python benchmarks/tpu_compile.py --topology v5e:2x4 --mesh data=1,model=8 ...
  python benchmarks/tpu_compile.py --topology v5e:4x8 --methods '' --train configs/drafter1.py \\
      --train.dtype=bfloat16 --train.mesh.model=8 ...   (train.py's --config flags as --train.*)

--target: a costmodel.TARGETS name (qwen3-8b, llama-3.1-8b), smollm2, or a Hugging Face folder
(its config.json); --dtype its weights' dtype (bfloat16). --drafters: paper (DFlash's 5-layer
drafters for the target, gamma 16, K = 4) or drafter folders DRAFTER1[,DRAFTER2] (their configs
only). --methods: ar, pld and the drafter methods (drafting.REGISTRY; the best-first trees
ddtree and d2sd_tree at compiled.TREE_BUDGET = 16 nodes, as reproduce.py measures them, or at N
nodes written d2sd_tree:N).
--mesh data=D,model=M over the topology's devices (default data=1,model=-1: every device on the
model axis); the training step uses its config's mesh, as train.py does.

Per method it compiles the prefill (the prompt block of --context tokens), the step (one AR step
or one speculative cycle, on the state the prefill hands over, donated as in the loop) and the
whole decode while_loop; with --train, one train.py step. For each it prints compile seconds,
per-device bytes accessed against the floor (d2sd_jax/perf/floors.py: weights used + KV
attended + head rows), flops, memory (arguments + temporaries + outputs) against the chip's HBM,
collectives, and a time estimate (the compiler's own on one chip, else a roofline), then the
speed-ups over AR at the paper's acceptance lengths beside the paper's H200 measurements.
--json OUT writes it all, with the date, machine and command; --record also keeps the figures in
results/tpu_compile.json (by chip, target and drafters), where `costmodel predict` reads the
cycle costs of TPU chips. libtpu prints warnings about the missing TPU host: harmless.
"""
from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault('JAX_PLATFORMS', 'cpu')  # the host's work runs on its CPU; TPU: compile only

from absl import app, flags, logging  # pylint: disable=wrong-import-position
from ml_collections import config_flags  # pylint: disable=wrong-import-position

from d2sd_jax import files  # pylint: disable=wrong-import-position
from d2sd_jax.perf import compiled as C  # pylint: disable=wrong-import-position
from d2sd_jax.perf import floors  # pylint: disable=wrong-import-position
from d2sd_jax.perf import tpu_records  # pylint: disable=wrong-import-position
from d2sd_jax.perf import costmodel  # pylint: disable=wrong-import-position

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD = os.path.join(ROOT, 'results', 'tpu_compile.json')

FLAGS = flags.FLAGS
flags.DEFINE_string('topology', 'v5p:1x1x1', 'TPU topology, e.g. v5e:2x4, v5p:1x1x1, v5e:4x8')
flags.DEFINE_string('mesh', 'data=1,model=-1', 'decode mesh over the topology: data=D,model=M')
flags.DEFINE_string('target', 'qwen3-8b', 'costmodel.TARGETS name, smollm2, or a HF folder')
flags.DEFINE_string('dtype', 'bfloat16', "the target's (and drafters') weight dtype")
flags.DEFINE_string('drafters', 'paper', 'paper, or drafter folders DRAFTER1[,DRAFTER2]')
flags.DEFINE_string('methods', 'ar,dflash,d2sd', 'comma-separated decode methods')
flags.DEFINE_integer('batch', 1, 'rows per decode batch')
flags.DEFINE_integer('context', 1024, 'prompt tokens: the KV every step attends to')
flags.DEFINE_integer('max_new_tokens', 256, 'generation length the caches are sized for')
flags.DEFINE_bool('loop', True, 'also compile the whole decode while_loop')
flags.DEFINE_multi_string('xla', [], 'OPTION=VALUE: an XLA option over models/xla_options.py\'s '
                          '(e.g. xla_msa_enable=true: the compiler\'s default)')
flags.DEFINE_string('json', None, 'write the figures to this JSON file')
flags.DEFINE_bool('record', False, f'also keep them in {os.path.relpath(RECORD, ROOT)}')
flags.DEFINE_bool('markdown', False, f'print the tables of {os.path.relpath(RECORD, ROOT)} (no '
                  'compiling) with the roofline and the published figures beside them')
flags.DEFINE_bool('write', False, 'with --markdown: put them into docs/scale-out.md')
config_flags.DEFINE_config_file('train', None, "a train.py config: compile one training step "
                                '(overrides as --train.x=y)', lock_config=True)


def table(result: dict) -> str:
  chip_gib = result['hbm_bytes_per_device'] / C.GiB
  head = (f"{'program':<16}{'compile':>8}{'GB read':>9}{'floor':>8}{'x floor':>8}{'GFLOP':>9}"
          f"{'memory GiB (arg+tmp+out)':>27}{'collectives':>14}{'estimate':>11}{'AR steps':>9}")
  machine = (f"{result['topology']} ({result['device_kind']}, {result['n_devices']} devices, "
             f"{chip_gib:.0f} GiB each)")
  if result['methods']:  # decode programs: their mesh, drafters, batch and context
    lines = [f"{machine}, mesh {result['mesh']}, target {result['target']}, drafters "
             f"{result['drafters']}, batch {result['batch']}, context {result['context']}",
             f"weights {result['weights_bytes_per_device'] / 1e9:.2f} GB per device, KV over "
             f"the context {result['kv_bytes_per_device'] / 1e9:.3f} GB per device", head]
  else:  # --train alone: each training row names its own mesh
    lines = [f"{machine}, target {result['target']}", head]
  ar_s = next((p['estimate_s'] for p in result['programs']
               if p['method'] == 'ar' and p['name'] == 'step' and p['compiled']), None)
  for p in result['programs']:
    label = f"{p['method']} {p['name']}" + (f" (mesh {p['mesh']['data']}x{p['mesh']['model']})"
                                            if 'mesh' in p else '')
    if not p['compiled']:
      lines.append(f"{label:<16} did not compile: {p['error']}")
      continue
    m = p['memory']
    floor = p.get('ideal_bytes_per_device')
    coll = p['collectives']
    lines.append(
        f"{label:<16}{p['compile_s']:>7.1f}s{p['bytes_per_device'] / 1e9:>9.2f}"
        f"{(floor / 1e9 if floor else float('nan')):>8.2f}"
        f"{(p['bytes_per_device'] / floor if floor else float('nan')):>8.2f}"
        f"{p['flops_per_device'] / 1e9:>9.1f}"
        f"{m['arguments'] / C.GiB:>11.2f}+{m['temporaries'] / C.GiB:.2f}+"
        f"{m['outputs'] / C.GiB:.2f}{'' if p['fits'] else ' !':2s}"
        f"{coll['count']:>6} {coll['bytes'] / 1e6:>6.1f}MB"
        f"{1e3 * p['estimate_s']:>8.3f}ms{p['estimate_source'][0]}"
        f"{(p['estimate_s'] / ar_s if ar_s and p['name'] in ('step', 'loop') else float('nan')):>9.2f}")
  lines.append("(estimate: c = the compiler's optimal_seconds, r = roofline; '!' = over the "
               'HBM; a loop is costed as one iteration)')
  for method, s in result['speedups'].items():
    lines.append(f"{method}: at the paper's tau {s['tau']:.2f}, a cycle of {s['cycle_over_ar']:.2f}"
                 f" AR steps -> {s['speedup']:.2f}x over AR (paper, measured on an H200: "
                 f"{s['paper_h200']:.2f}x)")
  if result.get('speedups_withheld'):
    lines.append(result['speedups_withheld'])
  for p in result['programs']:
    gathers = p.get('collectives', {}).get('weight_gathers')
    if gathers:
      lines.append(f"{p['method']} {p['name']}: {len(gathers)} collectives gather weights: "
                   f"{', '.join(gathers[:5])}")
  return '\n'.join(lines)


VLLM_TPU_DFLASH = ('vLLM tpu-inference DFlash port (UCSD), TPU v5p, Qwen3-4B + '
                   'z-lab/Qwen3-4B-DFlash-b16, greedy, 9 benchmarks: 3.01x standalone, 2.31x '
                   'in the serving pipeline, as reported at https://zhongyan0721.github.io/'
                   'tpu-dflash (3.13x average, tau 5.42, in github.com/ConstBob/tpu-spec-decode)')
BEGIN, END = '<!-- tpu_compile.py --markdown: begin -->', '<!-- tpu_compile.py --markdown: end -->'
DOC = os.path.join(ROOT, 'docs', 'scale-out.md')


def _program_table(result: dict) -> list[str]:
  est = {p['method']: p['estimate_s'] for p in result['programs']
         if p.get('compiled') and p['name'] == 'step'}
  decode = any(p['name'] != 'train_step' for p in result['programs'])
  where = (f"mesh data={result['mesh']['data']}, model={result['mesh']['model']}; drafters "
           f"{result['drafters']}; batch {result['batch']}, context {result['context']}"
           if decode else 'a training step')
  libtpu = result.get('toolchain', {}).get('libtpu') or 'not recorded'
  lines = [f"**{result['target']} on {result['topology']}** ({where}; libtpu {libtpu}; "
           f"{result['date']}, {result['machine']}, `{result['command']}`)", '',
           '| program | GB read / device | floor | × floor | memory GiB / device (of '
           f"{result['hbm_bytes_per_device'] / C.GiB:.0f}) | collectives | estimate | AR steps |",
           '|---|---|---|---|---|---|---|---|']
  for p in result['programs']:
    if not p.get('compiled'):
      lines.append(f"| {p['method']} {p['name']} | did not compile: {p['error']} ||||||")
      continue
    if 'mesh' in p:
      p = {**p, 'name': f"{p['name']} (mesh data={p['mesh']['data']}, "
                        f"model={p['mesh']['model']})"}
    floor = p.get('ideal_bytes_per_device')
    coll = p['collectives']
    steps = (f"{p['estimate_s'] / est['ar']:.2f}" if 'ar' in est and p['name'] in
             ('step', 'loop') else '')
    lines.append(
        f"| {p['method']} {p['name']} | {p['bytes_per_device'] / 1e9:.2f} | "
        f"{floor / 1e9:.2f} | {p['bytes_per_device'] / floor:.2f} | " if floor else
        f"| {p['method']} {p['name']} | {p['bytes_per_device'] / 1e9:.2f} | – | – | ")
    lines[-1] += (f"{p['memory_bytes_per_device'] / C.GiB:.2f} | {coll['count']} "
                  f"({coll['bytes'] / 1e6:.1f} MB{', weights gathered' if coll['weight_gathers'] else ''}) | "
                  f"{1e3 * p['estimate_s']:.2f} ms ({p['estimate_source']}) | {steps} |")
  return lines


def markdown() -> str:
  """docs/scale-out.md's compiled section, from results/tpu_compile.json (and, for the shipped
  drafters' speed-ups, results/reproduce.json's tau), with the roofline of costmodel.predict."""
  with open(RECORD) as f:
    kept = json.load(f)
  out = []
  for result in kept.values():
    out += _program_table(result) + ['']
  return '\n'.join(out) + '\n' + accelerator_tables(kept)


def accelerator_tables(kept: dict) -> str:
  """The predicted speed-ups (the accelerator table and the shipped drafters'), from
  the kept records, the roofline and the published figures."""
  from d2sd_jax.perf import throughput  # pylint: disable=import-outside-toplevel
  from d2sd_jax.spec_decode import ar, speculative as SP  # pylint: disable=import-outside-toplevel
  out = []
  # The accelerator table: Qwen3-8B with the paper's drafters at the paper's tau.
  out += ["**Qwen3-8B, the paper's drafters (gamma 16, K = 4), batch 1, 1,024 cached tokens, at "
          "the paper's tau (dflash 5.31, d2sd 7.05)**", '',
          '| chip | source | AR step | dflash cycle | d2sd cycle | dflash speed-up | '
          'd2sd speed-up |', '|---|---|---|---|---|---|---|']
  for result in kept.values():
    if (result['target'], result['drafters'], result['batch'], result['context']) != (
        'qwen3-8b', 'paper', 1, 1024):
      continue
    est = tpu_records.step_estimates(result)
    if not {'ar', 'dflash', 'd2sd'} <= set(est):
      continue
    src = ("TPU compiler's estimate" if result['n_devices'] == 1 else
           'roofline of the compiled per-device figures')
    src += f" (libtpu {result.get('toolchain', {}).get('libtpu') or 'not recorded'})"
    out.append(f"| {result['chip']} ({result['topology']}, model={result['mesh']['model']}) | "
               f"{src} | {1e3 * est['ar']:.2f} ms | {est['dflash'] / est['ar']:.2f} AR | "
               f"{est['d2sd'] / est['ar']:.2f} AR | "
               f"{C.PAPER_TAU['dflash'] * est['ar'] / est['dflash']:.2f}× | "
               f"{C.PAPER_TAU['d2sd'] * est['ar'] / est['d2sd']:.2f}× |")
  tcfg = costmodel.TARGETS['qwen3-8b']
  gen = ar.GenerationSettings(max_new_tokens=8, eos_ids=(), pad_id=0)
  d = costmodel.paper_drafter(tcfg)
  specs = {'dflash': SP.SpecSettings(gen, method='dflash', gamma=16, drafter1=d),
           'd2sd': SP.SpecSettings(gen, method='d2sd', gamma=16, drafter1=d, drafter2=d,
                                   n_branches=4)}
  for name in ('tpu-v5e', 'tpu-v5p', 'h200'):
    chip = costmodel.CHIPS[name]
    costs = costmodel.predict(tcfg, chip, list(specs.values()), 1, 1024,
                              sizes=sorted({1, 16, 32, 64} | {s.tree_size for s in
                                                              specs.values()}))
    cyc = {m: costs.cycle(sp) for m, sp in specs.items()}
    note = ", one chip: 8B weights do not fit its 16 GiB" if name == 'tpu-v5e' else ''
    out.append(f"| {chip.name} | roofline (`scripts/costmodel.py predict --chip {name}`, "
               f"lowered programs{note}) | {1e3 * costs.ar_step:.2f} ms | "
               f"{cyc['dflash'] / costs.ar_step:.2f} AR | {cyc['d2sd'] / costs.ar_step:.2f} AR | "
               f"{throughput.tokens_per_s(C.PAPER_TAU['dflash'], cyc['dflash']) * costs.ar_step:.2f}× | "
               f"{throughput.tokens_per_s(C.PAPER_TAU['d2sd'], cyc['d2sd']) * costs.ar_step:.2f}× |")
  out.append(f"| NVIDIA H200 | the D²SD paper's measurements | | | | "
             f"{C.PAPER_SPEEDUP_H200['dflash']:.2f}× | {C.PAPER_SPEEDUP_H200['d2sd']:.2f}× |")
  out += ['', f'For comparison: {VLLM_TPU_DFLASH}.', '']
  out += breakeven_tables(kept)
  # The shipped SmolLM2 drafters: tau measured here (it does not depend on the hardware).
  with open(os.path.join(ROOT, 'results', 'reproduce.json')) as f:
    rep = json.load(f)
  # From the trees run when it has HumanEval chat (every method of the table, the trees at
  # their budget, C.TREE_BUDGET nodes, as compiled), else the ladder's (no trees).
  methods = ('pld', 'dflash', 'd2sd', 'ddtree', 'd2sd_tree')
  section = 'trees' if 'humaneval_chat' in rep.get('trees', {}) else 'ladder'
  taus = {r['method']: r['tau'] for r in rep[section]['humaneval_chat'] if r['method'] in methods}
  run = rep['runs'][section]
  rows = []
  for result in kept.values():
    if result['target'] != 'smollm2' or result['batch'] != 1:
      continue
    est = tpu_records.step_estimates(result)
    for method in methods:
      if method in est and 'ar' in est and method in taus:
        rows.append(f"| {result['chip']} | {method} | {taus[method]:.2f} | "
                    f"{est[method] / est['ar']:.2f} AR | "
                    f"{taus[method] * est['ar'] / est[method]:.2f}× |")
  if rows:
    out += ['**The shipped SmolLM2 drafters** (gamma 8, K = 4; tau on HumanEval in the chat '
            f"template from results/reproduce.json: {run['date']}, `{run['command']}`"
            "), with the TPU compiler's cycle estimates above (context 256)", '',
            '| chip | method | tau | cycle | predicted speed-up |', '|---|---|---|---|---|'] + rows
  return '\n'.join(out).rstrip() + '\n'


def breakeven_tables(kept: dict) -> list[str]:
  """Where speculation stops paying: for each chip, mesh, target and drafters kept at more
  than one batch, every method's cycle in AR steps at each batch (the τ above which it beats
  AR; tpu_records.breakeven), and at the paper's τ the predicted speed-up."""
  groups = {}
  for r in kept.values():
    if r['methods'] and 'ar' in r['methods']:
      mesh = f"{r['mesh']['data']}x{r['mesh']['model']}"
      groups.setdefault((r['chip'], r['topology'], mesh, r['target'], r['drafters'],
                         r['context']), set()).add(r['batch'])
  out = []
  for (chip, topology, mesh, target, drafters, context), batches in groups.items():
    if len(batches) < 2:
      continue
    table = tpu_records.breakeven(kept, chip, target, drafters, mesh, context)
    methods = sorted({m for row in table.values() for m in row})
    paper = drafters == 'paper'
    out += [f'**Where speculation stops paying: {target} on {topology} (mesh {mesh}), drafters '
            f'{drafters}, context {context}.** Each cycle in AR steps, the τ above which the '
            "method beats AR at that batch (the TPU compiler's estimates"
            + (", and at the paper's τ the predicted speed-up" if paper else '') + ')', '',
            '| batch | ' + ' | '.join(methods) + ' |', '|---' * (len(methods) + 1) + '|']
    for batch, row in table.items():
      cells = []
      for m in methods:
        c = row.get(m)
        tau = C.PAPER_TAU.get(C.method_of(m)[0]) if paper else None
        cells.append('' if c is None else f'{c:.2f}' + (f' ({tau / c:.2f}×)' if tau else ''))
      out.append(f'| {batch} | ' + ' | '.join(cells) + ' |')
    out.append('')
  return out


def write_markdown(text: str, path: str = None) -> None:
  """Puts `text` between the markers of `path` (docs/scale-out.md)."""
  files.replace_block(path or DOC, BEGIN, END, text)


def run() -> dict:
  devices = C.tpu_devices(FLAGS.topology)
  chip = C.chip_of(devices)
  tcfg = C.target_config(FLAGS.target, FLAGS.dtype)
  methods = [m for m in FLAGS.methods.split(',') if m]
  dcfgs = (C.drafter_configs(FLAGS.drafters, tcfg) if any(m not in ('ar', 'pld') for m in methods)
           else {})
  mesh = C.mesh_of(devices, FLAGS.mesh)
  print(f'compiling for {FLAGS.topology} ({chip.name}) on a {dict(mesh.shape)} mesh ...',
        flush=True)
  programs = C.decode_programs(tcfg, dcfgs, methods, mesh, FLAGS.batch, FLAGS.context,
                               FLAGS.max_new_tokens, loops=FLAGS.loop)
  xla = dict(kv.split('=', 1) for kv in FLAGS.xla)
  rows = C.compile_all(programs, chip, mesh.size, log=lambda s: print(s, flush=True), xla=xla)
  if FLAGS.train is not None:
    from d2sd_jax.train import schema, training  # pylint: disable=import-outside-toplevel
    config = FLAGS.train
    config.target = FLAGS.target  # (the drafter follows this target: feature layers, width...)
    schema.validate(config)
    train_tcfg = C.target_config(FLAGS.target, config.get('dtype', 'float32'))
    mesh_cfg = config.get('mesh') or {'data': -1, 'model': 1}
    train_mesh = C.sharding.make_mesh(mesh_cfg['data'], mesh_cfg['model'], devices)
    trained = C.compile_all([C.train_program(config, train_tcfg, train_mesh, training)], chip,
                            train_mesh.size, log=lambda s: print(s, flush=True), xla=xla)
    rows += [{**r, 'mesh': dict(train_mesh.shape)} for r in trained]
  kv = floors.floors('step', tcfg, dcfgs, None, mesh, FLAGS.batch, FLAGS.context)['target KV']
  speedups, withheld = C.paper_speedups(rows, dcfgs)
  return {
      'date': time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()), 'machine': costmodel.machine(device=False),
      'command': ' '.join(['python benchmarks/tpu_compile.py', *sys.argv[1:]]),
      'toolchain': C.toolchain(),
      'topology': FLAGS.topology, 'device_kind': devices[0].device_kind, 'chip': chip.name,
      'n_devices': len(devices), 'mesh': dict(mesh.shape), 'target': FLAGS.target,
      'dtype': FLAGS.dtype, 'drafters': FLAGS.drafters, 'methods': methods,
      'batch': FLAGS.batch, 'context': FLAGS.context, 'max_new_tokens': FLAGS.max_new_tokens,
      'xla_options': {**C.xla_options.for_platform('tpu'), **xla},
      'hbm_bytes_per_device': chip.hbm_bytes,
      'weights_bytes_per_device': C.weights_bytes_per_device(tcfg, dcfgs, methods, mesh),
      'kv_bytes_per_device': kv,
      'programs': rows, 'speedups': speedups,
      **({'speedups_withheld': withheld} if withheld else {}),
  }


def main(argv):
  if not FLAGS['verbosity'].present:  # Orbax's INFO lines (reading drafter folders) stay out
    logging.set_verbosity(logging.WARNING)
  del argv
  if FLAGS.markdown:
    text = markdown()
    print(text)
    if FLAGS.write:
      write_markdown(text)
    return
  result = run()
  print(table(result))
  if FLAGS.json:
    files.write_json(FLAGS.json, result)
  if FLAGS.record:
    tpu_records.record(RECORD, result)


if __name__ == '__main__':
  sys.exit(app.run(main))
