"""Chat templates render exactly as transformers' apply_chat_template, keyword arguments
(enable_thinking, tools, add_generation_prompt) included.

The reference strings come from scripts/make_reference_fixtures.py --only chat_templates.
"""
import datetime
import json
import os
import types

import jinja2
import pytest
import tokenizers
from tokenizers import models

from d2sd_jax.formats import tokenizer as tokenizer_lib
from tests.conftest import FIXTURES

FIXTURE = os.path.join(FIXTURES, 'chat_templates.json')


def reference():
  with open(FIXTURE, encoding='utf-8') as f:
    return json.load(f)


@pytest.fixture
def frozen_now(monkeypatch):
  """strftime_now sees the fixture's date (transformers' was frozen at it too)."""
  now = datetime.datetime.fromisoformat(reference()['now'])

  class FrozenNow(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
      return now

  monkeypatch.setattr(tokenizer_lib, 'datetime', types.SimpleNamespace(datetime=FrozenNow))


def fixture_tokenizer():
  ref = reference()
  specials = [ref['bos_token'], ref['eos_token']]
  bpe = tokenizers.Tokenizer(models.BPE(vocab={'a': 0, specials[0]: 1, specials[1]: 2},
                                        merges=[]))
  return tokenizer_lib.Tokenizer(bpe=bpe, eos_ids=(2,), pad_id=2, bos_id=1,
                                 chat_template=ref['template'])


def test_rendering_matches_transformers(frozen_now):
  tok = fixture_tokenizer()
  cases = reference()['cases']
  for case in cases:
    assert tok.render_chat(case['messages'], **case['kwargs']) == case['rendered'], case['kwargs']
  # The fixture exercises the switch: the same chat with enable_thinking=False differs.
  assert cases[0]['messages'] == cases[1]['messages'] and '<think>' in cases[1]['rendered']
  assert cases[0]['rendered'] != cases[1]['rendered']


def test_raise_exception_gives_the_templates_message(frozen_now):
  case = reference()['error_case']
  with pytest.raises(jinja2.TemplateError) as error:
    fixture_tokenizer().render_chat(case['messages'], **case['kwargs'])
  assert str(error.value) == case['error']


def test_template_defaults_and_overrides():
  """A plain string is one user turn and a generation prompt follows unless the caller says
  otherwise; tools and documents are None (a template's `tools is none` test holds)."""
  tok = fixture_tokenizer()
  tok.chat_template = ('{{ messages | length }} {{ add_generation_prompt }} {{ tools is none }} '
                       '{{ documents is none }} {{ bos_token }}{{ eos_token }}')
  assert tok.render_chat('hi') == '1 True True True <|bos|><|im_end|>'
  assert (tok.render_chat('hi', add_generation_prompt=False, tools=[], eos_token='E') ==
          '1 False False True <|bos|>E')
