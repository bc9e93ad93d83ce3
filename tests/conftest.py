import functools
import gc
import gzip
import importlib.util
import json
import os
import shutil
import tempfile

# The tests run on the CPU. With libtpu installed (the test extra has it, for the TPU compile
# checks), every process that starts JAX would otherwise probe for a TPU host first (seconds and
# warnings per process, subprocesses included: they inherit this). The compile-only TPU
# topologies of tests/perf/test_compiled.py work under it.
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# The suite compiles hundreds of small programs and runs each a few times, so compiling is most
# of its time: without LLVM's optimisation levels and expensive passes XLA's CPU backend
# compiles them about a quarter faster (measured on tests/test_speculative.py and test_model.py
# from an empty cache: 130 s -> 100 s). The programs' results are the same up to float rounding.
# Subprocesses inherit this; a flag already in XLA_FLAGS wins.
_FAST_COMPILE = ('--xla_backend_optimization_level=0', '--xla_llvm_disable_expensive_passes=true')
os.environ['XLA_FLAGS'] = ' '.join(
    [os.environ.get('XLA_FLAGS', '')] +
    [f for f in _FAST_COMPILE if f.split('=')[0] not in os.environ.get('XLA_FLAGS', '')]).strip()

import jax  # pylint: disable=wrong-import-position
import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models

from d2sd_jax.formats import loaders
from d2sd_jax.models import target as model_lib

jax.config.update('jax_enable_x64', False)

# XLA's persistent compilation cache, shared by the test processes (pytest-xdist's workers and
# the subprocesses tests start, through the environment): a program compiled again, by another
# worker, after jax.clear_caches or under another Python function object, is read back instead
# of compiled. Entries are keyed by the program, the compile options and the jax/XLA version.
CACHE = {'JAX_COMPILATION_CACHE_DIR': os.environ.get(
             'JAX_COMPILATION_CACHE_DIR', os.path.join(tempfile.gettempdir(),
                                                       'd2sd_jax_tests_xla_cache')),
         'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0',
         'JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES': '-1'}
os.environ.update(CACHE)
jax.config.update('jax_compilation_cache_dir', CACHE['JAX_COMPILATION_CACHE_DIR'])
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
jax.config.update('jax_persistent_cache_min_entry_size_bytes', -1)


# Every program XLA's CPU backend compiles maps its code into the process (about 15 memory
# maps for a small one), and jit caches keep the programs alive. A worker that runs a long
# history of tests reaches Linux's per-process limit (vm.max_map_count, 65,530 by default),
# and the next compile's mmap fails inside LLVM: a segfault, with memory to spare. So after a
# test that leaves the process above MAX_MAPS maps, the compiled programs are dropped (the
# persistent cache reads them back when a later test needs them again).
MAX_MAPS = 30_000


def memory_maps() -> int:
  """The memory maps of this process (Linux; 0 elsewhere)."""
  try:
    with open('/proc/self/maps', 'rb') as f:
      return sum(1 for _ in f)
  except OSError:
    return 0


@pytest.fixture(autouse=True)
def _drop_compiled_programs_near_the_map_limit():
  yield
  maps = memory_maps()
  if maps > MAX_MAPS:
    jax.clear_caches()
    gc.collect()
    if os.environ.get('D2SD_TEST_MAPS_LOG'):
      with open(os.environ['D2SD_TEST_MAPS_LOG'], 'a') as f:
        f.write(f'{os.getpid()} {maps} -> {memory_maps()}\n')


def pytest_collection_modifyitems(items):
  """The mutation suite last: each mutation ends with jax.clear_caches(), which would make the
  tests after it trace and compile everything again."""
  items.sort(key=lambda item: item.nodeid.startswith('tests/test_mutations.py'))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, 'tests', 'fixtures')


def load_script(name: str):
  """The command-line program scripts/NAME.py as a module (its main() and parser)."""
  spec = importlib.util.spec_from_file_location(f'scripts_{name}',
                                                os.path.join(ROOT, 'scripts', f'{name}.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module

TINY = model_lib.ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                             head_dim=8, d_ff=48, rope_base=10000.0, norm_eps=1e-6)
# Weights this large make the tiny model's outputs depend on its context: at the default scale
# (0.2) its greedy output repeats one token per prompt, and wiping its KV cache changes nothing.
TINY_SCALE = 1.2


def tiny_params():
  return model_lib.init_params(TINY, jax.random.PRNGKey(0), scale=TINY_SCALE)


@pytest.fixture(scope='session')
def tiny():
  """A tiny random Llama-family model whose outputs vary with the context: (cfg, params)."""
  return TINY, tiny_params()


@pytest.fixture
def cost_cache(tmp_path, monkeypatch):
  """The cost model's measurements (costmodel.measure) go to a folder of the test's own."""
  monkeypatch.setenv('D2SD_COST_CACHE', str(tmp_path / 'costs'))
  return tmp_path / 'costs'


@pytest.fixture(autouse=True)
def auto_choices(tmp_path, monkeypatch):
  """method='auto' remembers its choice on disk (autoconfig.choice_dir): every test gets an
  empty folder of its own, so no test reads a choice another test (or the user) made."""
  monkeypatch.setenv('D2SD_AUTO_CACHE', str(tmp_path / 'auto-choices'))
  return tmp_path / 'auto-choices'


@functools.lru_cache(maxsize=1)
def _smollm2():
  return loaders.load_target('smollm2')


@pytest.fixture(scope='session')
def smollm2():
  """The real SmolLM2-135M-Instruct target (float32), loaded once per session."""
  return _smollm2()


@pytest.fixture(scope='session')
def tiny_folder(tmp_path_factory):
  """The tiny Llama checkpoint fixture plus a character-level tokenizer, EOS id 95 and a chat
  template: a complete Hugging Face folder (vocab 96)."""
  folder = tmp_path_factory.mktemp('tiny') / 'llama'
  shutil.copytree(os.path.join(FIXTURES, 'hf_tiny', 'llama'), folder)
  chars = [chr(c) for c in range(32, 127)]  # 95 printable characters, then EOS = id 95
  bpe = tokenizers.Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
  bpe.add_special_tokens(['<eos>'])
  bpe.decoder = decoders.Fuse()
  bpe.save(str(folder / 'tokenizer.json'))
  (folder / 'tokenizer_config.json').write_text(json.dumps(
      {'eos_token': '<eos>', 'chat_template':
       '{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}[assistant] '}))
  (folder / 'generation_config.json').write_text(json.dumps({'eos_token_id': 95}))
  return str(folder)


def write_fake_distill(path, vocab: int = 90) -> str:
  """Fake distillation shards: repetitive responses a drafter can learn quickly (ids < vocab)."""
  os.makedirs(path, exist_ok=True)
  rng = np.random.default_rng(0)
  for shard in range(2):
    lines = []
    for i in range(12):
      motif = rng.integers(0, vocab, 5).tolist()
      lines.append(json.dumps({'id': f'{shard}-{i}', 'style': 'complete_plain', 'prompt': 'p',
                               'chat': False, 'source': 'fake',
                               'prompt_ids': rng.integers(0, vocab, 9).tolist(),
                               'response_ids': (motif * 8)[:30 + i]}))
    with gzip.open(os.path.join(path, f'shard-{shard:05d}.jsonl.gz'), 'wt') as f:
      f.write('\n'.join(lines) + '\n')
  return str(path)


@pytest.fixture(scope='session')
def distill_dir(tmp_path_factory):
  return write_fake_distill(tmp_path_factory.mktemp('distill'))


@pytest.fixture(scope='session')
def tiny_drafters(tiny_folder, distill_dir, tmp_path_factory):
  """train.py workdirs of both drafters for the tiny folder target (3 steps each), made once
  per test process: {'drafter1': path, 'drafter2': path}."""
  from d2sd_jax.train import training  # pylint: disable=import-outside-toplevel
  # (test_training's tiny training config)
  from tests.train import test_training  # pylint: disable=import-outside-toplevel
  root = tmp_path_factory.mktemp('drafters')
  paths = {}
  for kind in ('drafter1', 'drafter2'):
    paths[kind] = str(root / kind)
    training.run(test_training.tiny_config(tiny_folder, distill_dir, paths[kind], kind, steps=3))
  return paths
