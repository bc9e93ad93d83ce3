"""The package's layering, read from its source: every import of d2sd_jax's own modules, at any
depth (an import inside a function hides a cycle as well as one at the top), follows the layer
order of d2sd_jax/__init__.py's docstring, and there is no cycle. The core (kernels/, models/, spec_decode/)
imports without Orbax or TFDS."""
import ast
import os
import subprocess
import sys

import pytest

import d2sd_jax

PACKAGE = os.path.dirname(d2sd_jax.__file__)
# What each part may import of the package (besides itself). The top-level helpers:
# config_check (config files' fields, read by decode/ and train/), cli (the error line) and
# files (whole-or-nothing writes); platforms (no TPU probe on a CPU host), which the package's
# face runs at import.
ALLOWED = {
    'kernels': set(),
    'models': {'kernels'},
    'spec_decode': {'models'},
    'formats': {'models', 'cli', 'files'},
    'perf': {'models', 'spec_decode', 'formats', 'files'},
    'decode': {'models', 'spec_decode', 'formats', 'perf', 'config_check', 'files'},
    'train': {'models', 'spec_decode', 'formats', 'perf', 'config_check', 'files'},
    'config_check': {'models', 'spec_decode'},
    'cli': set(),
    'files': set(),
    'platforms': set(),
}
FACE_IMPORTS = {'d2sd_jax.platforms'}  # all that `import d2sd_jax` loads of the package


def module_name(path: str) -> str:
  rel = os.path.relpath(path, os.path.dirname(PACKAGE))[:-len('.py')]
  parts = rel.split(os.sep)
  return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


def package_imports(path: str) -> set[str]:
  """The d2sd_jax modules a file imports, anywhere in it (`from d2sd_jax.x import y` counts
  d2sd_jax.x.y when that is a module, else d2sd_jax.x)."""
  with open(path) as f:
    tree = ast.parse(f.read(), path)
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names if a.name.startswith('d2sd_jax')}
    elif isinstance(node, ast.ImportFrom) and (node.module or '').startswith('d2sd_jax'):
      for a in node.names:
        sub = f'{node.module}.{a.name}'
        is_module = os.path.exists(os.path.join(os.path.dirname(PACKAGE),
                                                *sub.split('.'))) or os.path.exists(
            os.path.join(os.path.dirname(PACKAGE), *sub.split('.')) + '.py')
        found.add(sub if is_module else node.module)
  return found


def import_graph() -> dict[str, set[str]]:
  graph = {}
  for root, _, files in os.walk(PACKAGE):
    for name in files:
      if name.endswith('.py'):
        path = os.path.join(root, name)
        graph[module_name(path)] = package_imports(path)
  return graph


def part(module: str) -> str:
  """'models' for d2sd_jax.models.target; 'cli' for d2sd_jax.cli; '' for d2sd_jax itself."""
  return module.split('.')[1] if '.' in module else ''


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
  bad = []
  for mod, imported in graph.items():
    if part(mod) == '':  # the package's face: lazy names only, imports nothing else at load
      bad += [f'{mod} imports {i}' for i in imported - FACE_IMPORTS]
      continue
    for i in imported:
      if part(i) != part(mod) and part(i) not in ALLOWED[part(mod)]:
        bad.append(f'{mod} imports {i}')
  return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Every import cycle among the modules, as found by a depth-first search."""
  found, state = [], {}

  def visit(node, stack):
    state[node] = 'open'
    stack.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == 'open':
        found.append(stack[stack.index(nxt):] + [nxt])
      elif nxt not in state:
        visit(nxt, stack)
    stack.pop()
    state[node] = 'done'

  for node in sorted(graph):
    if node not in state:
      visit(node, [])
  return found


def test_every_import_follows_the_layers_and_none_makes_a_cycle():
  graph = import_graph()
  assert {'d2sd_jax.models.target', 'd2sd_jax.spec_decode.speculative', 'd2sd_jax.decode.generate',
          'd2sd_jax.train.training'} <= set(graph)
  assert 'd2sd_jax.models.target' in graph['d2sd_jax.spec_decode.speculative']  # imports are read
  assert layering_violations(graph) == []
  assert cycles(graph) == []


def test_the_checks_catch_a_core_module_importing_decode(tmp_path):
  """The same checks on the real graph with one import added, as a hidden one inside a function
  of spec_decode/ would add it: a layering violation and, as decode imports spec_decode, a cycle."""
  graph = import_graph()
  graph['d2sd_jax.spec_decode.drafting'] = graph['d2sd_jax.spec_decode.drafting'] | {
      'd2sd_jax.decode.options'}
  assert layering_violations(graph) == ['d2sd_jax.spec_decode.drafting imports d2sd_jax.decode.options']
  assert any('d2sd_jax.spec_decode.drafting' in c and 'd2sd_jax.decode.options' in c
             for c in cycles(graph))
  # ... and the reader sees an import inside a function
  source = tmp_path / 'm.py'
  source.write_text('def f():\n  from d2sd_jax.decode import options\n  return options\n')
  assert package_imports(str(source)) == {'d2sd_jax.decode.options'}


def test_the_core_imports_without_orbax_or_tfds():
  code = ('import sys, d2sd_jax, d2sd_jax.models.target, d2sd_jax.models.drafter, '
          'd2sd_jax.spec_decode.speculative, d2sd_jax.spec_decode.drafting; '
          'heavy = sorted(m for m in sys.modules if m.split(".")[0] in '
          '("orbax", "tensorflow_datasets", "grain", "tensorboardX")); '
          'assert not heavy, heavy')
  subprocess.run([sys.executable, '-c', code], check=True, env={**os.environ,
                                                                 'JAX_PLATFORMS': 'cpu'})


@pytest.mark.parametrize('name', sorted(d2sd_jax.__all__))
def test_the_public_names_load_lazily(name):
  assert callable(getattr(d2sd_jax, name))
  with pytest.raises(AttributeError, match='no attribute'):
    getattr(d2sd_jax, 'no_such_name')


def test_shipped_drafters_resolve_from_any_working_directory(tmp_path, monkeypatch):
  """A relative drafter path that is not under the working directory is looked up in the
  repository (the configs name drafters/...), wherever the package's modules sit."""
  from d2sd_jax.formats import checkpoints  # pylint: disable=import-outside-toplevel
  root = os.path.dirname(PACKAGE)
  monkeypatch.chdir(tmp_path)
  assert checkpoints.resolve_path('drafters/smollm2-drafter1') == os.path.join(
      root, 'drafters', 'smollm2-drafter1')
  assert checkpoints.resolve_path('no/such/folder') == 'no/such/folder'


def test_no_folder_of_the_package_reads_as_tests():
  """Code-mapping tools take `spec/`, `test/` and `tests/` for test folders and leave them out."""
  folders = {name for _, dirs, _ in os.walk(PACKAGE) for name in dirs}
  assert not folders & {'spec', 'specs', 'test', 'tests'}, folders
