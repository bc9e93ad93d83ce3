"""The speculative-decoding tests' drafters."""
import pytest

from tests.helpers import tiny_drafters


@pytest.fixture(scope='module')
def trained(tiny):
  """Tiny drafters trained on the tiny target's outputs: their drafts are accepted."""
  return tiny_drafters.trained_bundle(tiny)
