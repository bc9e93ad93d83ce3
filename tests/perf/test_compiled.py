"""Programs compiled for TPU topologies from this CPU host (d2sd_jax/perf/compiled.py,
benchmarks/tpu_compile.py): the floors against a hand computation from the shapes, and a small
target's AR step and dflash cycle compiled for a v5p chip reading at most 1.1x their floor in
the TPU program's own form (no CPU-only column products). libtpu comes with the test extra;
without it these tests fail, saying so, rather than skip."""
import dataclasses
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import tomllib

import jax
import jax.numpy as jnp
import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from d2sd_jax.kernels import partition
from d2sd_jax.models import drafter as drafter_lib
from d2sd_jax.models import sampling
from d2sd_jax.models import target as model_lib
from d2sd_jax.models import xla_options
from d2sd_jax.perf import compiled as C
from d2sd_jax.perf import floors
from d2sd_jax.perf import hlo
from d2sd_jax.perf import tpu_records
from d2sd_jax.perf import costmodel
from d2sd_jax.spec_decode import ar
from d2sd_jax.spec_decode import speculative as SP

from tests.conftest import ROOT


def tpu_devices(topology):
  if importlib.util.find_spec('libtpu') is None:
    pytest.fail("libtpu is not installed: pip install -e '.[test]' (it brings jax[tpu]'s "
                'libtpu) to compile for TPU topologies')
  return C.tpu_devices(topology)


def _jax_tpu_requirements():
  """The requirements the installed jax declares for its `tpu` extra."""
  out = []
  for line in importlib.metadata.requires('jax') or []:
    req = Requirement(line)
    if req.marker is not None and req.marker.evaluate({'extra': 'tpu'}) and not (
        req.marker.evaluate({'extra': ''})):
      out.append(req)
  return out


def test_installed_libtpu_is_the_one_the_installed_jax_declares():
  """The compiler these tests and benchmarks/tpu_compile.py measure with is the one
  `pip install 'jax[tpu]'` puts on a TPU VM: the installed libtpu satisfies the installed jax's
  own `tpu` requirement (jax 0.10.2: libtpu==0.0.42.*). Another build compiles the same HLO
  differently (0.0.52 fails jax 0.10.2's batch > 1 prefills; 0.0.42 refused a kernel that 0.0.52
  took)."""
  (want,) = [r for r in _jax_tpu_requirements() if r.name == 'libtpu']
  tpu_devices('v5p:1x1x1')  # fails, saying how to install it, where libtpu is missing
  have = importlib.metadata.version('libtpu')
  assert want.specifier.contains(have, prereleases=True), (
      f"libtpu {have} is installed, but jax {importlib.metadata.version('jax')} declares "
      f"{want.name}{want.specifier} for its tpu extra: pip install -e '.[aot]' (or "
      "pip install 'jax[tpu]') to get it")


def _pyproject():
  with open(os.path.join(ROOT, 'pyproject.toml'), 'rb') as f:
    return tomllib.load(f)['project']


def _extra_requirements(project, extra):
  """The requirements an extra brings, its references to the project's own extras followed."""
  out = []
  for line in project['optional-dependencies'][extra]:
    req = Requirement(line)
    if canonicalize_name(req.name) == canonicalize_name(project['name']):
      for inner in req.extras:
        out += _extra_requirements(project, inner)
    else:
      out.append(req)
  return out


def test_the_tpu_extras_take_libtpu_from_jax_and_python_and_jax_are_what_the_suite_runs_on():
  """pyproject.toml: the `tpu`, `aot` and `test` extras bring libtpu only through jax[tpu] (one
  place: the libtpu that jax declares, never a pin of our own that drifts from it); the declared
  jax range holds the installed jax and starts at its minor release (the one the suite runs on);
  and `requires-python` admits no Python that jax refuses (pip then refuses at once, naming the
  version, rather than backtracking through jax releases)."""
  project = _pyproject()
  for extra in ('tpu', 'aot', 'test'):
    reqs = _extra_requirements(project, extra)
    assert not [r for r in reqs if r.name == 'libtpu'], (
        f"the {extra} extra pins libtpu itself: take it through jax[tpu], whose libtpu is jax's")
    assert [r for r in reqs if r.name == 'jax' and 'tpu' in r.extras], (extra, reqs)
  (jax_req,) = [Requirement(r) for r in project['dependencies'] if Requirement(r).name == 'jax']
  installed = Version(importlib.metadata.version('jax'))
  assert jax_req.specifier.contains(installed), (str(jax_req), installed)
  lowest = [Version(s.version) for s in jax_req.specifier if s.operator == '>=']
  assert lowest and lowest[0].release[:2] == installed.release[:2], (
      f'{jax_req}: the lowest jax allowed is not of the {installed.major}.{installed.minor} '
      'release the suite runs on; raise the lower bound (or test the oldest allowed in CI)')
  ours = SpecifierSet(project['requires-python'])
  jax_python = SpecifierSet(importlib.metadata.metadata('jax')['Requires-Python'])
  for minor in range(6, 20):
    assert not (f'3.{minor}' in ours and f'3.{minor}' not in jax_python), (
        f"requires-python {ours} admits Python 3.{minor}, which jax {installed} refuses "
        f'({jax_python}): raise it to what jax requires')


def _documented_topologies():
  names = set()
  for path in ['README.md'] + [os.path.join('docs', f) for f in os.listdir(
      os.path.join(ROOT, 'docs')) if f.endswith('.md')]:
    with open(os.path.join(ROOT, path)) as f:
      names |= set(re.findall(r'\bv(?:5e|5p|6e):\d+x\d+(?:x\d+)?\b', f.read()))
  return names


def test_tpu_devices_gives_every_topology_the_docs_name():
  """Every topology the README and docs name, and those the decode programs are checked on,
  gives its chips, one device each, of its chip. Under jax's own libtpu a topology smaller than
  its default host of 2x2x1 chips (v5p:1x1x1, v5e:1x1) is refused unless laid out as one host
  (chips_per_host_bounds)."""
  names = _documented_topologies() | {'v5p:1x1x1', 'v5p:2x2x1', 'v5e:2x4', 'v5e:1x1'}
  for name in sorted(names):
    kind, shape = name.split(':')
    devices = tpu_devices(name)
    assert len(devices) == math.prod(int(d) for d in shape.split('x')), (name, len(devices))
    assert C.chip_of(devices).name == f'TPU {kind}', (name, devices[0].device_kind)


class MeshShape:
  """What the floors read of a mesh: its axis sizes."""

  def __init__(self, data, model):
    self.shape = {'data': data, 'model': model}


@pytest.mark.parametrize('data,model', [(1, 1), (1, 8), (2, 4)])
def test_floors_equal_a_hand_computation_from_the_shapes(data, model):
  """Qwen3-8B with the paper's drafters, context 1024, batch 2: every part of the AR step's and
  the d2sd cycle's floor from the config's numbers (bf16 weights, f32 caches)."""
  t = costmodel.TARGETS['qwen3-8b']
  d = costmodel.paper_drafter(t)
  mesh, B, ctx = MeshShape(data, model), 2, 1024
  gen = ar.GenerationSettings(max_new_tokens=8, eos_ids=(), pad_id=0)
  spec = SP.SpecSettings(gen, method='d2sd', gamma=16, n_branches=4, drafter1=d, drafter2=d)
  D, hd, Hkv, H, F, V, L = (t.d_model, t.head_dim, t.n_kv_heads, t.n_heads, t.d_ff,
                            t.vocab_size, t.n_layers)
  m = model  # every split dimension of these shapes divides 8 and 4
  rows = B // data
  layer = (Hkv * (H // Hkv + 2) * hd * D + D * H * hd + 2 * F * D + D * F) // m * 2 + (
      2 * D + 2 * hd) * 2  # wqkv, wo, gate/up, down (split) + the four norms (replicated)
  target = L * layer + D * 2  # + final norm
  head = V * D // m * 2
  kv = 2 * L * rows * (Hkv // m) * ctx * hd * 4
  ar_step = floors.floors('step', t, {}, None, mesh, B, ctx)
  assert ar_step == {'target weights': target, 'target head': head,
                     'embedding rows': B * 1 * D * 2, 'target KV': kv}
  # The paper's drafter: 5 target-width layers without q/k norms, a final norm and a mask
  # embedding, the target's whole head, its context KV; the commit reads fc [D, 5D] (split over
  # its inputs), fc_norm and each layer's key/value rows [2 Hkv hd, D] (split by KV head).
  d_layers = d.n_layers * ((Hkv * (H // Hkv + 2) * hd * D + D * H * hd + 2 * F * D + D * F)
                           // m * 2 + 2 * D * 2) + 2 * D * 2
  d_kv = 2 * d.n_layers * rows * (Hkv // m) * ctx * hd * 4
  d_context = D * 5 * D // m * 2 + D * 2 + d.n_layers * 2 * Hkv * hd * D // m * 2
  cycle = floors.floors('step', t, {'drafter1': d, 'drafter2': d}, spec, mesh, B, ctx)
  want = {'target weights': target, 'target head': head,
          'embedding rows': B * spec.tree_size * D * 2, 'target KV': kv}
  for name in ('drafter1', 'drafter2'):
    want.update({f'{name} passes x1: layers': d_layers, f'{name} passes x1: head': head,
                 f'{name} passes x1: context KV': d_kv, f'{name} context write': d_context})
  assert cycle == want
  # a second branch pass (spec.branch_passes=2) reads drafter 2 once more, drafter 1 as before
  two = floors.floors('step', t, {'drafter1': d, 'drafter2': d},
                 dataclasses.replace(spec, branch_passes=2), mesh, B, ctx)
  assert two['drafter2 passes x2: layers'] == 2 * d_layers
  assert two['drafter2 passes x2: head'] == 2 * head
  assert two['drafter1 passes x1: layers'] == d_layers
  if (data, model) == (1, 1):  # the issue's figure: the d2sd cycle's floor is ~1.4 AR steps
    ratio = sum(cycle.values()) / sum(ar_step.values())
    assert 1.35 < ratio < 1.5, ratio


# A target whose weights dominate its decode programs (as an 8B target's do), small enough to
# compile in seconds: 2 layers of width 1024, bf16.
LEAN = model_lib.ModelConfig(vocab_size=4096, d_model=1024, n_layers=2, n_heads=4, n_kv_heads=2,
                             head_dim=128, d_ff=4096, dtype='bfloat16')
LEAN_DRAFTER = drafter_lib.DrafterConfig(gamma=8, n_layers=1, d_model=1024, n_heads=4,
                                         n_kv_heads=2, head_dim=128, d_ff=4096,
                                         feature_layers=(1, 2), dtype='bfloat16')


def test_tpu_step_and_cycle_read_at_most_1_1x_their_floor_in_the_tpu_form():
  """Compiled for a v5p chip: the AR step and a dflash cycle read at most 1.1x their floor and
  take no CPU-only form (model.linear's column products, chosen by the platform compiled for,
  not by the host's backend); the memory fields are there and the compiler's estimate is used."""
  devices = tpu_devices('v5p:1x1x1')
  mesh = C.mesh_of(devices, 'data=1,model=1')
  programs = C.decode_programs(LEAN, {'drafter1': LEAN_DRAFTER}, ['ar', 'dflash'], mesh,
                               batch=1, context=64, max_new_tokens=32, loops=False)
  rows = {}
  for prefill, step in zip(programs[::2], programs[1::2]):
    # On one device every output of the prefill is on that device: its state, placed there,
    # without compiling the prefill (the benchmark compiles it and takes its shardings).
    on_device = jax.sharding.SingleDeviceSharding(devices[0])
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_device),
                         prefill.abstract_output())
    step.args = step.args[:3] + (state,)
    rows[step.method, step.name] = C.compile_program(step, C.chip_of(devices), 1)[0]
  for key in (('ar', 'step'), ('dflash', 'step')):
    r = rows[key]
    assert r['cpu_only_forms'] == 0, (key, r['cpu_only_forms'])
    assert r['bytes_per_device'] <= 1.1 * r['ideal_bytes_per_device'], (
        key, r['bytes_per_device'] / r['ideal_bytes_per_device'])
    assert set(r['memory']) >= {'arguments', 'temporaries', 'outputs'}
    assert r['memory_bytes_per_device'] == sum(r['memory'][k] for k in
                                               ('arguments', 'temporaries', 'outputs'))
    assert r['estimate_source'] == 'compiler' and r['estimate_s'] > 0
  # the dflash cycle reads the AR step's weights and a drafter pass more, not less
  assert rows['dflash', 'step']['bytes_per_device'] > rows['ar', 'step']['bytes_per_device']


@pytest.mark.parametrize('batch', [1, 2])
def test_ar_step_and_d2sd_cycle_compile_on_the_fused_kernels(batch):
  """For a v5p chip, at batch 1 and 2: the AR step (one new token per row) and a d2sd cycle
  (a 36-node tree per row) compile, every target and drafter layer on fused.py's kernels
  (head dim 128). A kernel form that Mosaic does not lower (a score product against one key
  row: "Not implemented: Lane broadcast") fails the AR step; a `fits` that sends these shapes
  to the XLA form leaves too few kernel calls."""
  devices = tpu_devices('v5p:1x1x1')
  mesh = C.mesh_of(devices, 'data=1,model=1')
  dcfgs = {'drafter1': LEAN_DRAFTER, 'drafter2': LEAN_DRAFTER}
  programs = C.decode_programs(LEAN, dcfgs, ['ar', 'd2sd'], mesh, batch=batch, context=64,
                               max_new_tokens=32, loops=False)
  on_device = jax.sharding.SingleDeviceSharding(devices[0])
  for prefill, step in zip(programs[::2], programs[1::2]):
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_device),
                         prefill.abstract_output())
    step.args = step.args[:3] + (state,)
    _, compiled = C.compile_program(step, C.chip_of(devices), 1)
    calls = compiled.as_text().count('custom_call_target="tpu_custom_call"')
    # attention half + MLP per target layer, and per drafter layer in each of d2sd's 2 passes
    layers = LEAN.n_layers + (2 * LEAN_DRAFTER.n_layers if step.method == 'd2sd' else 0)
    assert calls >= 2 * layers, (step.method, batch, calls)


@pytest.mark.slow  # (16 s of compiling; the batch-1/2 fused-kernel compiles stay in the default tier)
def test_d2sd_cycle_at_batch_8_reads_at_most_2_2x_its_floor():
  """A d2sd cycle of 8 rows (36-node trees: 288 rows of new tokens, 320 verified) compiled for
  a v5p chip reads at most 2.2x its floor (LEAN's activations weigh far more against its
  weights than an 8B target's). It read 2.64x with the layers of more than 128 rows in the XLA
  form, the 36 nodes unpadded (a [8, 36, D] view as [288, D] is a relayout on a TPU) and the
  argmax's NaN test outside its reduction."""
  devices = tpu_devices('v5p:1x1x1')
  mesh = C.mesh_of(devices, 'data=1,model=1')
  dcfgs = {'drafter1': LEAN_DRAFTER, 'drafter2': LEAN_DRAFTER}
  prefill, step = C.decode_programs(LEAN, dcfgs, ['d2sd'], mesh, batch=8, context=64,
                                    max_new_tokens=32, loops=False)
  on_device = jax.sharding.SingleDeviceSharding(devices[0])
  state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_device),
                       prefill.abstract_output())
  step.args = step.args[:3] + (state,)
  row, compiled = C.compile_program(step, C.chip_of(devices), 1)
  assert row['bytes_over_ideal'] <= 2.2, row['bytes_over_ideal']
  # every target layer (verification) and drafter layer (both passes) on the kernels
  calls = compiled.as_text().count('custom_call_target="tpu_custom_call"')
  assert calls >= 2 * (LEAN.n_layers + 2 * LEAN_DRAFTER.n_layers), calls


def test_greedy_head_over_8_rows_reads_its_weights_once():
  """The head's matmul and the greedy argmax over 8 rows of 40 tokens, compiled for a v5p
  chip, read the head once (the reduction fused into the matmul): with NaN -> +inf tested
  outside the reduction the logits were written and read back beside a bit mask of every
  element, 2.2x the head."""
  devices = tpu_devices('v5p:1x1x1')
  on = jax.sharding.SingleDeviceSharding(devices[0])
  head = jax.ShapeDtypeStruct((32768, 1024), jnp.bfloat16, sharding=on)
  hidden = jax.ShapeDtypeStruct((8, 40, 1024), jnp.float32, sharding=on)
  for fn in (sampling.argmax, lambda x: sampling.confidence_and_argmax(x, 0.7)):
    compiled = jax.jit(lambda h, w, f=fn: f(model_lib.linear(h, w))).lower(hidden, head).compile(
        xla_options.for_arrays((head,)))
    nbytes = hlo.figures(compiled, C.chip_of(devices), 1)['bytes_per_device']
    assert nbytes <= 1.1 * 32768 * 1024 * 2, nbytes / (32768 * 1024 * 2)


def test_kernels_split_over_the_tensorcores_of_the_chip_compiled_for():
  """A layer compiled for a v5e (one TensorCore) sums its MLP in one part, for a v5p (two) in
  two halves; the kind comes from the mesh traced under."""
  for topology, cores in (('v5e:2x2', 1), ('v5p:1x1x1', 2)):
    devices = tpu_devices(topology)
    mesh = C.mesh_of(devices[:1], 'data=1,model=1')
    with C.sharding.tracing_under(mesh):
      assert partition.tensor_cores() == cores
    text = _one_layer(devices).compile().as_text()
    mlp = [line for line in text.split('\n') if 'tpu_custom_call' in line and
           f'f32[{cores},8,{LEAN.d_model}]' in line.split('custom-call(')[0]]
    assert mlp, (topology, cores)


def _one_layer(devices):
  """One LEAN layer verifying 8 tokens of one row, lowered for the first of `devices`."""
  mesh = C.mesh_of(devices[:1], 'data=1,model=1')
  cfg = dataclasses.replace(LEAN, n_layers=1)
  lp = C.target_params(cfg, mesh)['layers'][0]
  on = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  S = lambda shape, dt=jnp.float32: jax.ShapeDtypeStruct(shape, dt, sharding=on)
  kv = {k: S((1, cfg.n_kv_heads, 256, cfg.head_dim), cfg.jnp_dtype) for k in 'kv'}
  tree = jnp.tril(jnp.ones((1, 8, 8), bool))
  fn = lambda params, kv_, x, pos, n: model_lib.layer(cfg, x, params, kv_, pos, n, tree, n)
  with C.sharding.tracing_under(mesh):
    return jax.jit(fn).lower(lp, kv, S((1, 8, cfg.d_model)), S((1, 8), jnp.int32),
                             S((1,), jnp.int32))


@pytest.mark.slow
def test_tpu_compile_every_method_loop_and_a_training_step_on_a_v5e_mesh(tmp_path):
  """benchmarks/tpu_compile.py on v5e:2x2 (model axis 2) with a tiny target: every method's
  prefill, cycle and loop, and a training step, compile, carry their memory fields, gather no
  weight and take no CPU-only form."""
  config = tmp_path / 'target'
  config.mkdir()
  (config / 'config.json').write_text(json.dumps({
      'model_type': 'llama', 'vocab_size': 4096, 'hidden_size': 256, 'num_hidden_layers': 4,
      'num_attention_heads': 4, 'num_key_value_heads': 2, 'intermediate_size': 512,
      'tie_word_embeddings': True}))
  out = tmp_path / 'out.json'
  tpu_devices('v5e:2x2')
  cmd = [sys.executable, os.path.join(ROOT, 'benchmarks', 'tpu_compile.py'), '--topology',
         'v5e:2x2', '--mesh', 'data=1,model=2', '--target', str(config), '--methods',
         'ar,pld,dflash,d2sd', '--drafters', 'paper', '--context', '64', '--max_new_tokens',
         '16', '--json', str(out),
         '--train', os.path.join(ROOT, 'configs', 'drafter1.py'), '--train.dtype=bfloat16',
         '--train.mesh.model=2', '--train.mesh.data=2', '--train.train.batch_size=4',
         '--train.data.seq_len=64', '--train.drafter.d_model=256', '--train.drafter.n_heads=4',
         '--train.drafter.n_kv_heads=2', '--train.drafter.head_dim=64',
         '--train.drafter.d_ff=512', '--train.drafter.feature_layers=(1,2)',
         '--train.drafter.head_vocab=1024', '--train.train.precompute_features=False']
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(out.read_text())
  names = {(p['method'], p['name']) for p in result['programs'] if p['compiled']}
  for method in ('ar', 'pld', 'dflash', 'd2sd'):
    assert {(method, 'prefill'), (method, 'step'), (method, 'loop')} <= names, names
  assert ('drafter1', 'train_step') in names
  for p in result['programs']:
    assert p['memory_bytes_per_device'] > 0 and p['fits'], p['name']
    assert p['cpu_only_forms'] == 0, (p['method'], p['name'])
    assert not p['collectives']['weight_gathers'], (p['method'], p['name'])
  assert result['weights_bytes_per_device'] > 0 and result['kv_bytes_per_device'] > 0


def test_platform_choices_follow_the_compile_target_not_the_host():
  """On this CPU host the same forward lowered for the CPU takes the column form and lowered
  for a TPU does not (jax.lax.platform_dependent resolved at lowering)."""
  cfg = dataclasses.replace(LEAN, dtype='float32', n_layers=1)
  params = jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.PRNGKey(0)))
  tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)

  def run(p, tok):
    h, _, _ = model_lib.forward(p, cfg, tok, jnp.broadcast_to(jnp.arange(8), (1, 8)),
                                model_lib.init_cache(cfg, 1, 16), jnp.zeros((1,), jnp.int32))
    return model_lib.logits(p, cfg, h)

  cpu = jax.jit(run).lower(params, tokens).as_text()
  devices = tpu_devices('v5p:1x1x1')
  placed = C._placed(params, jax.tree.map(  # pylint: disable=protected-access
      lambda _: jax.sharding.SingleDeviceSharding(devices[0]), params))
  tpu = jax.jit(run).lower(placed, jax.ShapeDtypeStruct(
      (1, 8), jnp.int32, sharding=jax.sharding.SingleDeviceSharding(devices[0]))).as_text()
  assert cpu.count('optimization_barrier') == 5  # qkv, o, gate/up, down and the head
  assert tpu.count('optimization_barrier') == 0


@pytest.mark.slow
def test_training_micro_batches_split_over_the_data_axis():
  """train.py's step with grad_accum = 2, compiled for v5e:2x2: on a 2 x 2 mesh each device
  does half the flops it does on a 1 x 2 mesh (every micro-batch is split over 'data'; a
  micro-batch held by one data shard made every device run all of it)."""
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel
  from d2sd_jax.train import training  # pylint: disable=import-outside-toplevel
  devices = tpu_devices('v5e:2x2')
  config = config_flags.config_flags._LoadConfigModule(  # pylint: disable=protected-access
      'drafter1', os.path.join(ROOT, 'configs', 'drafter1.py')).get_config()
  config.dtype = 'bfloat16'
  config.train.update(batch_size=8, grad_accum=2, precompute_features=False)
  config.data.seq_len = 64
  config.drafter.update(d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=512,
                        feature_layers=(1, 2), head_vocab=1024)
  tcfg = model_lib.ModelConfig(vocab_size=4096, d_model=256, n_layers=2, n_heads=4,
                               n_kv_heads=2, head_dim=64, d_ff=512, dtype='bfloat16')
  flops = {}
  for data in (1, 2):
    mesh = C.sharding.make_mesh(data, 2, devices)
    row, _ = C.compile_program(C.train_program(config, tcfg, mesh, training),
                               C.chip_of(devices), mesh.size)
    flops[data] = row['flops_per_device']
  assert flops[2] == pytest.approx(flops[1] / 2, rel=0.1), flops


def test_budgeted_trees_compile_at_the_measured_budget():
  """The compiled ddtree / d2sd_tree cycles verify compiled.TREE_BUDGET nodes, the budget
  reproduce.py measures their tau at (the docs' predicted speed-ups pair the two); the other
  methods keep their own trees."""
  gen = C.generation_settings(16)
  dcfgs = {'drafter1': LEAN_DRAFTER, 'drafter2': LEAN_DRAFTER}
  for method in ('ddtree', 'd2sd_tree'):
    assert C.spec_settings(method, gen, dcfgs).tree_size == C.TREE_BUDGET == 16
  assert C.spec_settings('d2sd', gen, dcfgs).tree_size == 8 + 4 * 7  # chain + K branches


def test_a_budgeted_tree_compiles_at_the_budget_its_label_names():
  """'d2sd_tree:32' is d2sd_tree verifying 32 nodes, its programs labelled so (one table
  can hold a tree at two budgets); a budget on a method without one, or a method that does not
  exist, is refused by name."""
  devices = jax.devices('cpu')[:1]
  mesh = C.mesh_of(devices, 'data=1,model=1')
  dcfgs = {'drafter1': LEAN_DRAFTER, 'drafter2': LEAN_DRAFTER}
  programs = C.decode_programs(LEAN, dcfgs, ['d2sd_tree', 'd2sd_tree:32', 'ddtree:8'], mesh,
                               context=64, max_new_tokens=32, loops=False)
  sizes = {p.method: p.args[2].tree_size for p in programs if p.name == 'step'}
  assert sizes == {'d2sd_tree': C.TREE_BUDGET, 'd2sd_tree:32': 32, 'ddtree:8': 8}
  assert C.method_of('ar') == ('ar', C.TREE_BUDGET)
  with pytest.raises(ValueError, match=r"'dflash:8': only a budgeted tree \(d2sd_tree, ddtree\)"):
    C.method_of('dflash:8')
  with pytest.raises(ValueError, match="method 'eagle': choose ar or one of"):
    C.method_of('eagle')


def test_breakeven_is_each_batchs_cycle_in_ar_steps_on_one_chip_mesh_and_drafters():
  """tpu_records.breakeven: for the chip, target, drafters, mesh and context asked, each kept
  batch's cycles over its own AR step (the τ above which a method beats AR there); records of
  another mesh, drafters or context, and a batch without an AR step, are left out."""
  def result(batch, est, mesh=(1, 1), drafters='paper', context=1024):
    return {'chip': 'TPU v5p', 'target': 'qwen3-8b', 'drafters': drafters, 'batch': batch,
            'context': context, 'mesh': {'data': mesh[0], 'model': mesh[1]},
            'programs': [{'method': m, 'name': 'step', 'compiled': True, 'estimate_s': s}
                         for m, s in est.items()] +
                        [{'method': 'ar', 'name': 'prefill', 'compiled': True, 'estimate_s': 9}]}
  kept = {'a': result(8, {'ar': 2.0, 'dflash': 3.0, 'd2sd_tree:32': 9.0}),
          'b': result(1, {'ar': 1.0, 'dflash': 1.25, 'd2sd_tree:32': 2.0}),
          'c': result(1, {'ar': 1.0, 'dflash': 7.0}, mesh=(1, 8)),
          'd': result(1, {'ar': 1.0, 'dflash': 7.0}, drafters='x'),
          'e': result(1, {'ar': 1.0, 'dflash': 7.0}, context=256),
          'f': result(32, {'dflash': 3.0})}
  assert tpu_records.breakeven(kept, 'TPU v5p', 'qwen3-8b') == {
      1: {'dflash': 1.25, 'd2sd_tree:32': 2.0}, 8: {'dflash': 1.5, 'd2sd_tree:32': 4.5}}
  assert list(tpu_records.breakeven(kept, 'TPU v5p', 'qwen3-8b', mesh='1x8')) == [1]
  assert tpu_records.breakeven(kept, 'TPU v5e', 'qwen3-8b') == {}


def test_speedups_at_the_paper_tau_only_for_its_gamma_and_a_train_header_without_decode():
  """tpu_compile.py quotes speed-ups at the paper's tau (gamma-16 drafters) for gamma-16 drafters
  only; with --train alone (no decode method) its header names no drafters nor context."""
  rows = [{'method': m, 'name': 'step', 'compiled': True, 'estimate_s': s}
          for m, s in (('ar', 1.0), ('dflash', 2.0))]
  d16 = costmodel.paper_drafter(costmodel.TARGETS['qwen3-8b'])
  quoted, why = C.paper_speedups(rows, {'drafter1': d16})
  assert not why and quoted['dflash']['speedup'] == pytest.approx(C.PAPER_TAU['dflash'] / 2)
  quoted, why = C.paper_speedups(rows, {'drafter1': dataclasses.replace(d16, gamma=8)})
  assert quoted == {} and why == ("no speed-up quoted: the paper's tau is for gamma=16 drafters, "
                                  'these have gamma=8')
  result = {'topology': 'v5e:2x2', 'device_kind': 'TPU v5 lite', 'n_devices': 4,
            'hbm_bytes_per_device': 16 * C.GiB, 'mesh': {'data': 1, 'model': 4},
            'target': 'T', 'drafters': 'paper', 'batch': 1, 'context': 1024, 'methods': [],
            'weights_bytes_per_device': 0, 'kv_bytes_per_device': 0, 'programs': [],
            'speedups': {}}
  code = ('import json, sys; sys.path.insert(0, "benchmarks"); import tpu_compile; '
          f'print(tpu_compile.table(json.loads({json.dumps(json.dumps(result))})))')
  proc = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True,
                        timeout=300, check=True)
  header = proc.stdout.splitlines()[0]
  assert header == 'v5e:2x2 (TPU v5 lite, 4 devices, 16 GiB each), target T', proc.stdout


@pytest.mark.slow
def test_markdown_names_the_libtpu_and_the_batch_1_table_takes_batch_1(tmp_path, monkeypatch):
  """benchmarks/tpu_compile.py --markdown on a record holding one v5p chip at batch 1 and at
  batch 8: each program table names its libtpu and stands apart from the next block (a blank
  line), and the speed-up table, titled batch 1, has one v5p row, the batch-1 record's (a
  batch-8 record with its dearer AR step there would be a second row, or the only one)."""
  sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))
  import tpu_compile  # pylint: disable=import-outside-toplevel
  with open(tpu_compile.RECORD) as f:
    kept = json.load(f)
  one = kept[next(k for k in kept if k.startswith('TPU v5p|qwen3-8b|paper|mesh=1x1|batch=1|'))]
  eight = json.loads(json.dumps({**one, 'batch': 8, 'toolchain': {'libtpu': '9.9.9'}}))
  for p in eight['programs']:
    p['estimate_s'] *= 3
  record = tmp_path / 'tpu_compile.json'
  record.write_text(json.dumps({'a': one, 'b': eight}))
  monkeypatch.setattr(tpu_compile, 'RECORD', str(record))
  text = tpu_compile.markdown()
  assert f"libtpu {one['toolchain']['libtpu']};" in text and 'libtpu 9.9.9;' in text
  assert "|\n\n**Qwen3-8B, the paper's drafters" in text
  rows = [line for line in text.splitlines() if line.startswith('| TPU v5p (v5p:1x1x1')]
  est = tpu_records.step_estimates(one)
  assert len(rows) == 1 and f"| {1e3 * est['ar']:.2f} ms |" in rows[0], rows
