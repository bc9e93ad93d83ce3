"""Chat-template keyword arguments (enable_thinking, tools, ...) reach the rendered prompt from
decode.py's config (a JSON string) and from Decoder.generate (a dict): their parsing is
decode/options.py's parse_chat_template_kwargs; the rendering is formats/test_tokenizer.py's."""
import importlib.util
import io
import json
import os
import shutil

import pytest

import d2sd_jax
from d2sd_jax.decode import generate as generate_lib
from d2sd_jax.decode import options as options_lib
from d2sd_jax.formats import tokenizer as tokenizer_lib
from tests.conftest import ROOT


@pytest.fixture
def thinking_folder(tiny_folder, tmp_path):
  """tiny_folder whose chat template reads enable_thinking."""
  folder = tmp_path / 'thinking'
  shutil.copytree(tiny_folder, folder)
  config_file = folder / 'tokenizer_config.json'
  config = json.loads(config_file.read_text())
  config['chat_template'] += '{% if enable_thinking is false %}[no-think] {% endif %}'
  config_file.write_text(json.dumps(config))
  return str(folder)


@pytest.fixture
def rendered(monkeypatch):
  """Every string render_chat returns during the test, in order."""
  out = []
  render = tokenizer_lib.Tokenizer.render_chat

  def spy(self, messages, **kwargs):
    out.append(render(self, messages, **kwargs))
    return out[-1]

  monkeypatch.setattr(tokenizer_lib.Tokenizer, 'render_chat', spy)
  return out


def decode_config():
  path = os.path.join(ROOT, 'configs', 'smollm2.py')
  spec = importlib.util.spec_from_file_location('smollm2_decode_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def test_config_kwargs_reach_the_prompt(thinking_folder, rendered):
  config = decode_config()
  config.update(target=thinking_folder, method='ar', drafter1='', drafter2='', prompt='hi',
                max_new_tokens=2, chat_template_kwargs='{"enable_thinking": false}')
  generate_lib.run(config, out=io.StringIO())
  assert rendered == ['[user] hi[assistant] [no-think] ']
  config.chat_template_kwargs = ''  # the default: the template's own default
  generate_lib.run(config, out=io.StringIO())
  assert rendered[1] == '[user] hi[assistant] '


def test_api_kwargs_reach_the_prompt(thinking_folder, rendered):
  dec = d2sd_jax.load(thinking_folder)
  dec.generate('hi', 2, chat_template_kwargs={'enable_thinking': False})
  dec.generate('hi', 2)
  assert rendered == ['[user] hi[assistant] [no-think] ', '[user] hi[assistant] ']
  with pytest.raises(ValueError, match='chat_template_kwargs=.* must be a dict'):
    dec.generate('hi', 2, chat_template_kwargs='{"enable_thinking": false}')


@pytest.mark.parametrize('value,expected', [
    ('', {}), ('{}', {}), ('{"enable_thinking": false, "tools": null}',
                           {'enable_thinking': False, 'tools': None}),
    ({'enable_thinking': False}, {'enable_thinking': False}),
])
def test_config_kwargs_parse(value, expected):
  assert options_lib.parse_chat_template_kwargs(value) == expected


@pytest.mark.parametrize('value,match', [
    ('{"enable_thinking": fals}', 'not valid JSON'),
    ('[1, 2]', 'must be a JSON object'),
])
def test_bad_config_kwargs_are_explained(value, match):
  with pytest.raises(ValueError, match=match):
    options_lib.parse_chat_template_kwargs(value)
