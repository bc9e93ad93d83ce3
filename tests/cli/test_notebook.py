"""notebooks/quickstart.ipynb runs top to bottom (on a tiny target and tiny drafters)."""
import os

import nbformat
import pytest
from nbclient import NotebookClient

from tests.conftest import ROOT


@pytest.mark.slow
def test_quickstart_notebook_executes_twice(tiny_folder, tiny_drafters, tmp_path):
  """Top to bottom, then again in the same kernel (Run All twice): the second run saves over the
  first run's saved decoder."""
  nb = nbformat.read(os.path.join(ROOT, 'notebooks', 'quickstart.ipynb'), as_version=4)
  params = [c for c in nb.cells if 'parameters' in c.metadata.get('tags', [])]
  assert len(params) == 1
  params[0].source = '\n'.join([
      f'TARGET = {tiny_folder!r}', f"DRAFTER1 = {tiny_drafters['drafter1']!r}",
      f"DRAFTER2 = {tiny_drafters['drafter2']!r}", "PROMPTS = ['abcabcab', 'hello hello']",
      'CHAT = False', 'MAX_NEW_TOKENS = 12', f"SAVE_DIR = {str(tmp_path / 'saved')!r}"])
  client = NotebookClient(nb, timeout=600, kernel_name='python3',
                          resources={'metadata': {'path': os.path.join(ROOT, 'notebooks')}})
  with client.setup_kernel():
    for run in range(2):
      for index, cell in enumerate(nb.cells):
        client.execute_cell(cell, index)  # raises CellExecutionError on an error
      outputs = [o for c in nb.cells if c.cell_type == 'code' for o in c.get('outputs', [])]
      text = ''.join(o.get('text', '') for o in outputs)
      assert 'identical to AR greedy output: True' in text, run
      assert 'same output' in text, run
      assert any('image/png' in o.get('data', {}) for o in outputs), run  # the acceptance plot
  assert sorted(os.listdir(tmp_path)) == ['saved']
