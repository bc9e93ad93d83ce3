"""decode.py's contract: config fields, printed completions, the final JSON stats line, errors."""
import dataclasses
import io
import json
import os
import subprocess
import sys

import pytest

from d2sd_jax import config_check
from d2sd_jax.decode import generate as generate_lib
from d2sd_jax.decode import options as options_lib
from d2sd_jax.spec_decode import drafting
from d2sd_jax.formats import loaders
from tests.helpers.tiny_drafters import DCFG
from d2sd_jax.spec_decode import speculative
from d2sd_jax.formats.drafters import load_drafter

from tests.conftest import ROOT
sys.path.insert(0, os.path.join(ROOT, 'configs'))
import smollm2 as smollm2_config  # pylint: disable=wrong-import-position

def config_for(folder, **overrides):
  config = smollm2_config.get_config()
  config.target = folder
  config.update(method='ar', drafter1='', drafter2='')  # the shipped drafters are SmolLM2's
  config.max_new_tokens = 12
  config.update(overrides)
  return config


def run(config):
  out = io.StringIO()
  stats = generate_lib.run(config, out=out)
  lines = out.getvalue().strip().split('\n')
  assert json.loads(lines[-1]) == stats  # the stats are the last line
  return stats, out.getvalue()


def test_prompts_file_batches_and_output(tiny_folder, tmp_path):
  prompts = ['def f(x):', 'Hello there, how', 'a', 'The quick brown fox jumps']
  prompts_file = tmp_path / 'prompts.jsonl'
  prompts_file.write_text(''.join(json.dumps({'prompt': p}) + '\n' for p in prompts))
  results = {}
  for batch_size in (1, 3):
    out_file = tmp_path / f'out{batch_size}.jsonl'
    # prompts_file given alone wins over the config's (empty) default prompt
    stats, text = run(config_for(tiny_folder, prompts_file=str(prompts_file),
                                 batch_size=batch_size, output=str(out_file), chat=False))
    rows = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [r['prompt'] for r in rows] == prompts
    for r in rows:
      assert 1 <= len(r['completion_ids']) <= 12
      assert r['completion'] in text
    assert stats['method'] == 'ar' and stats['prompts'] == 4
    assert stats['new_tokens'] == sum(len(r['completion_ids']) for r in rows)
    for key in ('compile_s', 'prefill_s', 'decode_s', 'decode_tokens_per_s'):
      assert stats[key] > 0
    results[batch_size] = [r['completion_ids'] for r in rows]
  assert results[1] == results[3]  # batching (with a padded last batch) changes nothing
  # Prompt-lookup speculative decoding: same tokens as AR, plus its own stats (and, on request,
  # the stage times).
  stats, _ = run(config_for(tiny_folder, prompts_file=str(prompts_file), batch_size=3,
                            output=str(tmp_path / 'pld.jsonl'), chat=False, method='pld',
                            spec={'gamma': 4}, stage_times=True))
  rows = [json.loads(line) for line in (tmp_path / 'pld.jsonl').read_text().splitlines()]
  assert [r['completion_ids'] for r in rows] == results[1]
  assert stats['method'] == 'pld' and stats['cycles'] > 0
  assert stats['tau'] == pytest.approx((stats['new_tokens'] - 4) / stats['cycles'], abs=1e-3)
  assert sum(stats['accepted_histogram']) == stats['cycles']
  assert set(stats['stage_ms']) == {'draft', 'verify', 'accept'}  # asked for
  assert all(t > 0 for t in stats['stage_ms'].values())


def test_chat_template_is_applied(tiny_folder):
  tok = loaders.load_target(tiny_folder).tokenizer
  assert tok.eos_ids == (95,)
  ids = tok.encode_prompt('hi', chat=True)
  assert tok.decode(ids) == '[user] hi[assistant] '
  assert tok.encode_prompt('hi', chat=False) == tok.encode('hi') == [ord('h') - 32, ord('i') - 32]


@pytest.mark.parametrize('overrides,error,match', [
    ({'prompt': 'x', 'prompts_file': 'p.jsonl'}, ValueError, 'prompt .* or prompts_file .* both'),
    ({'prompts_file': '/nonexistent.jsonl'}, FileNotFoundError, 'not found'),
    ({'method': 'magic'}, ValueError, r"method='magic' is not one of \('ar', 'auto', 'pld'"),
    ({'method': 'd2sd', 'drafter1': 'x'}, ValueError, r"method='d2sd' needs drafter2"),
    ({'method': 'pld', 'spec': {'gamma': 1}}, ValueError, 'gamma'),
    ({'method': 'pld', 'spec': {'leniency': 2.0}}, ValueError, 'leniency'),
    ({'temperature': -0.5}, ValueError, 'temperature'),
    ({'top_p': 0.0}, ValueError, 'top_p'),
    ({'top_k': -1}, ValueError, 'top_k'),
    ({'max_new_tokens': 0}, ValueError, 'max_new_tokens'),
    ({'batch_size': -1}, ValueError, 'batch_size'),
    ({'prompt': 'x' * 40, 'cache_len': 48}, ValueError, 'exceeds the cache length 48'),
    ({'prompt': 'x' * 40, 'max_new_tokens': 100}, ValueError, r'model context 128'),
    ({'target': '/no/such/checkpoint'}, FileNotFoundError, 'not found'),
])
def test_bad_input_is_explained(tiny_folder, overrides, error, match):
  with pytest.raises(error, match=match):
    generate_lib.run(config_for(tiny_folder, chat=False, **overrides), out=io.StringIO())


def test_unknown_decode_fields_are_named(tiny_folder):
  c = config_for(tiny_folder)
  c.unlock()
  c.temprature = 0.7
  with pytest.raises(ValueError, match=r'unknown decode config field\(s\): temprature \(did you '
                                       r'mean temperature\?\)'):
    generate_lib.run(c, out=io.StringIO())
  c = config_for(tiny_folder)
  c.mesh.unlock()
  c.mesh.tensor = 2
  with pytest.raises(ValueError, match=r'mesh.tensor'):
    generate_lib.run(c, out=io.StringIO())


@pytest.mark.parametrize('flags,message', [
    # refused by the flag parser; named with the flag and the field meant (config_check)
    (['--config.temprature=0.5'], '--config.temprature=0.5: the config has no field '
                                  'temprature (did you mean --config.temperature?)'),
    (['--config.gamma=16'], 'no field gamma (did you mean --config.spec.gamma?)'),
    (['--config.temperature=-1'], 'temperature=-1.0 must be >= 0'),  # ValueError
    (['--config.prompts_file=/no/such.jsonl'], "prompts_file '/no/such.jsonl' not found"),
    # A JSON object is a plain string to the flag parser: read, then refused by decode.py.
    (['--config.chat_template_kwargs={"enable_thinking": fals}'], 'is not valid JSON'),
])
def test_decode_cli_user_errors_are_one_line(flags, message):
  """A user error is one line `error: ...` on stderr and exit status 2, no traceback; each is
  refused before the target loads."""
  proc = subprocess.run([sys.executable, os.path.join(ROOT, 'decode.py'), '--config',
                         os.path.join(ROOT, 'configs', 'smollm2.py'), *flags],
                        capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert 'Traceback' not in proc.stderr and proc.stdout == ''
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith('error: ') and message in last, proc.stderr[-3000:]


def test_prompt_and_prompts_file(tmp_path):
  """An explicit prompts_file wins over the config's default prompt; with neither, a demo
  prompt; both given explicitly is refused."""
  prompts_file = tmp_path / 'p.jsonl'
  prompts_file.write_text('{"prompt": "from the file"}\n')
  config = smollm2_config.get_config()
  assert options_lib.read_prompts(config) == [options_lib.DEMO_PROMPT]
  config.prompts_file = str(prompts_file)
  options_lib.validate(config)
  assert options_lib.read_prompts(config) == ['from the file']
  config.prompt = 'typed'
  with pytest.raises(ValueError, match='not both'):
    options_lib.validate(config)


@pytest.mark.parametrize('gamma', [4, 16])
def test_a_config_left_as_it_is_decodes_as_the_notebook_does(gamma):
  """configs/smollm2.py with nothing set and Decoder.generate with no keyword run the same
  SpecSettings, for drafters of block 4 (n_branches capped at gamma-1 = 3) and 16: gamma and
  n_branches follow the drafter in both, every other knob is SpecSettings' default."""
  config = smollm2_config.get_config()
  assert set(config.spec) == set(config_check.SPEC_KNOBS) == set(
      speculative.SpecSettings.__dataclass_fields__) - set(config_check.NOT_KNOBS)
  dcfg = dataclasses.replace(DCFG, gamma=gamma)
  drafters = {'drafter1': (dcfg, None), 'drafter2': (dcfg, None)}
  settings = []
  for options in (options_lib.options_from_config(config), options_lib.Options(method='auto')):
    gen = options_lib.generation_settings(options)
    settings.append(speculative.SpecSettings(
        gen, method='d2sd', drafter1=dcfg, drafter2=dcfg,
        **options_lib.spec_fields(dataclasses.replace(options, method='d2sd'), drafters)))
  assert settings[0] == settings[1]
  assert settings[0].gamma == gamma and settings[0].n_branches == min(4, gamma - 1)


def test_methods_are_read_from_the_registry_at_call_time(tiny_folder, monkeypatch):
  """A method registered after import is accepted by decode.py's checks and runs."""
  config = config_for(tiny_folder, method='pld_again', prompt='abcabcab', chat=False,
                      max_new_tokens=6, spec={'gamma': 4})
  with pytest.raises(ValueError, match="'pld_again' is not one of"):
    options_lib.validate(config)
  monkeypatch.setitem(drafting.REGISTRY, 'pld_again', drafting.Method(drafting.pld))
  assert 'pld_again' in options_lib.methods()
  stats, _ = run(config)
  assert stats['method'] == 'pld_again' and stats['cycles'] > 0


def test_prompt_padding_beyond_a_small_cache(tiny_folder, tmp_path):
  """A 65-token prompt pads to 128 columns, more than a 100-slot cache: still exact."""
  ids = {}
  for cache_len in (100, 2048):
    out = tmp_path / f'{cache_len}.jsonl'
    run(config_for(tiny_folder, prompt='y' * 65, chat=False, max_new_tokens=10,
                   cache_len=cache_len, output=str(out)))
    ids[cache_len] = json.loads(out.read_text())['completion_ids']
  assert len(ids[100]) == 10 and ids[100] == ids[2048]


def test_bad_prompts_file_lines(tiny_folder, tmp_path):
  bad = tmp_path / 'bad.jsonl'
  bad.write_text('{"prompt": "ok"}\n{"text": "no prompt field"}\n')
  with pytest.raises(ValueError, match='bad.jsonl:2'):
    generate_lib.run(config_for(tiny_folder, prompts_file=str(bad)), out=io.StringIO())
  empty = tmp_path / 'empty.jsonl'
  empty.write_text('{"prompt": ""}\n')
  with pytest.raises(ValueError, match='empty.jsonl:1: an empty user turn'):
    generate_lib.run(config_for(tiny_folder, prompts_file=str(empty), chat=False),
                 out=io.StringIO())


def test_prompts_file_takes_conversations_in_every_format(tiny_folder, tmp_path):
  """DFlash `turns`, ShareGPT and OpenAI lines decode their first user turn through the chat
  template, exactly as the same text given as a "prompt" line; a system message is kept."""
  lines = [{'prompt': 'def f(x):'}, {'turns': ['def f(x):', 'and then?']},
           {'conversations': [{'from': 'human', 'value': 'def f(x):'},
                              {'from': 'gpt', 'value': 'return x'}]},
           {'messages': [{'role': 'system', 'content': 'Be brief.'},
                         {'role': 'user', 'content': 'def f(x):'}]}]
  path = tmp_path / 'mixed.jsonl'
  path.write_text('\n'.join(json.dumps(l) for l in lines) + '\n')
  out = tmp_path / 'out.jsonl'
  run(config_for(tiny_folder, prompts_file=str(path), chat=True, output=str(out)))
  rows = [json.loads(l) for l in open(out)]
  assert [r['completion_ids'] for r in rows[1:3]] == [rows[0]['completion_ids']] * 2
  assert rows[3]['prompt'][0] == {'role': 'system', 'content': 'Be brief.'}
  with pytest.raises(ValueError, match='needs chat=True'):
    generate_lib.run(config_for(tiny_folder, prompts_file=str(path), chat=False), out=io.StringIO())


@pytest.mark.slow
def test_decode_py_on_smollm2(smollm2, auto_choices):
  """The README's command, on the real target with the shipped drafters, through the real entry
  point: method='auto' chooses from the shipped drafters' prior (no probe) and says so in one
  line; then, with a remembered choice for exactly this request's key (D²SD with K = 4, which
  the prior would not pick on this CPU), decodes with that at once. Every completion equals
  plain AR's, and no Orbax or absl INFO line reaches the terminal."""
  from d2sd_jax.decode import auto_record, autoconfig  # pylint: disable=import-outside-toplevel
  prompt, new_tokens = 'What is the capital of France?', 12
  config = smollm2_config.get_config()
  assert config.method == 'auto'
  config.update(prompt=prompt, max_new_tokens=new_tokens)
  options = options_lib.options_from_config(config)
  drafters = {n: load_drafter(os.path.join(ROOT, config[n]), smollm2)[:2]
              for n in options_lib.DRAFTERS}
  longest = len(smollm2.tokenizer.encode_prompt(prompt, True, {}))
  key = autoconfig.remembered_key(smollm2, drafters, options, 1, longest)
  table = {label: {'method': m, 'spec': k, 'predicted_tokens_per_s': 1.0}
           for label, m, k in autoconfig.candidates(drafters)}
  table['d2sd(K=4)']['predicted_tokens_per_s'] = 2.0
  out = {}

  def decode(*extra):
    proc = subprocess.run(
        [sys.executable, 'decode.py', '--config', 'configs/smollm2.py',
         f'--config.max_new_tokens={new_tokens}', f'--config.prompt={prompt}', *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ' I1' not in proc.stderr and 'INFO' not in proc.stderr, proc.stderr[-3000:]
    *text, last = proc.stdout.strip().split('\n')
    stats = json.loads(last)
    out[stats['auto_source'] if 'auto_source' in stats else 'ar'] = '\n'.join(text)
    assert 1 <= stats['new_tokens'] <= new_tokens
    return stats, proc.stderr

  stats, err = decode()  # no remembered choice: the prior
  assert stats['auto_source'] == 'prior' and stats['auto_reason'] in err
  assert stats['auto_choice'] in stats['auto_candidates'] and 'auto_priors.json' in err
  os.remove(stats['auto_file'])
  auto_choices.mkdir(exist_ok=True)
  (auto_choices / f'{key}.json').write_text(json.dumps(
      {'version': auto_record.VERSION, 'auto_choice': 'd2sd(K=4)',
       'predicted_tokens_per_s': 2.0, 'auto_candidates': table, 'cost_device': 'cpu'}))
  stats, _ = decode()
  assert (stats['auto_source'], stats['auto_choice']) == ('remembered', 'd2sd(K=4)')
  assert stats['cycles'] >= 1 and stats['tau'] >= 1.0 and stats['tree_size'] == 36
  decode('--config.method=ar')
  assert set(out) == {'prior', 'remembered', 'ar'}
  assert out['prior'] == out['remembered'] == out['ar'] and 'Paris' in out['ar']


def test_speculative_batches_of_different_prompt_widths(tiny_folder, tmp_path):
  """Batches whose prompts pad to different widths (5 and 70 tokens, batch 1) share one
  decode-loop program: every batch is padded to the run's widest prompt."""
  prompts = tmp_path / 'p.jsonl'
  prompts.write_text('\n'.join(json.dumps({'prompt': p}) for p in ['ab ab', 'xyz ' * 17 + 'xy']))
  ids = {}
  for method in ('ar', 'pld'):
    out = tmp_path / f'{method}.jsonl'
    stats, _ = run(config_for(tiny_folder, prompts_file=str(prompts), chat=False, method=method,
                              batch_size=1, output=str(out)))
    assert 'stage_ms' not in stats  # only on request (config.stage_times)
    ids[method] = [json.loads(line)['completion_ids'] for line in out.read_text().splitlines()]
  assert ids['pld'] == ids['ar'] and len(ids['ar']) == 2


def test_drafters_of_another_target_auto_leaves_out_or_the_error_names_the_flags(tiny_folder,
                                                                                 tmp_path):
  """The default command with another target: auto leaves out the shipped (SmolLM2) drafters
  and says so; drafters the user named that do not fit are an error naming the flags to fix."""
  import shutil  # pylint: disable=import-outside-toplevel
  target = loaders.load_target(tiny_folder)
  config = smollm2_config.get_config()  # method auto, the shipped drafters
  config.target = tiny_folder
  options = options_lib.validate(config)
  wanted, note = generate_lib._drafters_for(target, config, options, ['drafter1', 'drafter2'])
  assert wanted == [] and note.startswith(
      "the shipped drafters are for 'smollm2', not this target, so auto weighs the methods that "
      'need none (ar, pld)')
  mine = str(tmp_path / 'mine')
  shutil.copytree(os.path.join(ROOT, 'drafters', 'smollm2-drafter1'), mine)
  for method in ('auto', 'dflash'):
    config.update(drafter1=mine, method=method)
    with pytest.raises(ValueError, match=(
        rf"--config.drafter1={mine}: checkpoint .* was trained for target 'smollm2' .*Give "
        r'drafters for this target \(--config.drafter1=PATH --config.drafter2=PATH\) or decode '
        r'without them \(--config.method=pld\)')):
      generate_lib._drafters_for(target, config, options_lib.validate(config), ['drafter1'])
  config.update(drafter1='', drafter2='', method='pld')  # nothing to leave out
  assert generate_lib._drafters_for(target, config, options_lib.validate(config), []) == ([], '')
