"""DFlash interop (d2sd_jax/formats/dflash_format.py) against the reference implementation.

tests/fixtures/dflash_tiny/ was written by scripts/make_dflash_fixtures.py with torch and the
`dflash` 0.1.0 package (z-lab's code): a tiny Qwen3 target, a tiny DFlash drafter trained on
the target's outputs, and reference.npz with the drafter's block logits and the reference
generation loop's tokens and per-cycle acceptance lengths. Nothing here needs torch.

Each conversion rule is pinned by a check that fails when it is broken:
`test_wrong_conversions_are_caught` shows the recorded logits tell every wrong variant apart
(layer ids without the offset, no q/k norm, another mask token, the target's RoPE base, ...).
"""
import dataclasses
import functools
import json
import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import loop_checks
from d2sd_jax.formats import checkpoints as ckpt
from d2sd_jax.decode import generate as generate_lib
from d2sd_jax.decode import options as options_lib
from d2sd_jax.formats import dflash_format as DF
from d2sd_jax.models import drafter as D
from d2sd_jax.spec_decode import ar as AR
from d2sd_jax.formats import loaders
from d2sd_jax.models import target as M
from d2sd_jax.spec_decode import speculative as SP
from d2sd_jax.formats.drafters import load_drafter
from tests.conftest import FIXTURES, ROOT, load_script

FIXTURE = os.path.join(FIXTURES, 'dflash_tiny')
DRAFTER_DIR = os.path.join(FIXTURE, 'drafter')
TOL = dict(rtol=1e-4, atol=1e-4)  # float32 (torch vs XLA: different summation orders)


@pytest.fixture(scope='module')
def target():
  return loaders.load_hf(os.path.join(FIXTURE, 'target'))


@pytest.fixture(scope='module')
def ref():
  with np.load(os.path.join(FIXTURE, 'reference.npz')) as f:
    return dict(f)


@pytest.fixture(scope='module')
def drafter(target):
  """The reference drafter through the path decode.py takes (checkpoints.load_drafter)."""
  return load_drafter(DRAFTER_DIR, target)


@functools.partial(jax.jit, static_argnames=('dcfg', 'tcfg'))  # (op by op: seconds a call)
def _blocks_logits(dparams, dcfg, tparams, tcfg, seq_1xL, anchors_C, blocks_CxG, mask_id):
  L, G_ = seq_1xL.shape[1], dcfg.gamma
  _, _, feats = M.forward(tparams, tcfg, seq_1xL, jnp.arange(L)[None],
                          M.init_cache(tcfg, 1, L), jnp.zeros((1,), jnp.int32),
                          feature_layers=dcfg.feature_layers)
  # every position's features in the decode-time context cache; a block sees those before its
  # anchor only
  cache = D.write_context(D.init_context_cache(dcfg, 1, L), dparams, dcfg, D.features_of(feats),
                          jnp.arange(L)[None], jnp.zeros((1,), jnp.int32))

  def one(a, block_G):
    block_1xG = block_G[None]
    is_mask = (block_1xG == mask_id).at[:, 0].set(False)  # the anchor is a token
    return D.forward(dparams, dcfg, tparams, tcfg, block_1xG, is_mask, a + jnp.arange(G_)[None],
                     cache, jnp.arange(L)[None] < a, jnp.ones((1, G_, G_), bool))[0]
  return jax.lax.map(lambda x: one(*x), (anchors_C, blocks_CxG))


def block_logits(target, dcfg, dparams, ref):
  """Our drafter's logits [C, G, V] for the recorded blocks: context features through the
  decode-time context cache, masks where the reference put its mask token."""
  mask_id = json.load(open(os.path.join(DRAFTER_DIR, 'config.json')))['dflash_config'][
      'mask_token_id']
  return np.asarray(_blocks_logits(dparams, dcfg, target.params, target.cfg,
                                   jnp.asarray(ref['block_seq'])[None],
                                   jnp.asarray(ref['block_anchor']),
                                   jnp.asarray(ref['block_tokens']), mask_id))


def test_config_follows_the_reference(drafter):
  dcfg, _, meta = drafter
  config = json.load(open(os.path.join(DRAFTER_DIR, 'config.json')))
  assert dcfg.feature_layers == tuple(i + 1 for i in config['dflash_config']['target_layer_ids'])
  assert dcfg.gamma == config['block_size'] and dcfg.qk_norm and dcfg.head_vocab == 0
  assert dcfg.rope_base == config['rope_parameters']['rope_theta']
  assert dcfg.norm_eps == config['rms_norm_eps']
  assert meta['format'] == 'dflash' and meta['target_fingerprint'] is None


def test_block_logits_match_reference(target, drafter, ref):
  dcfg, dparams, _ = drafter
  np.testing.assert_allclose(block_logits(target, dcfg, dparams, ref), ref['block_logits'], **TOL)


def _interleave_query_heads(dcfg, lp):
  """HF's query heads regrouped as if head h served KV head h % Hkv (it serves h // Hg)."""
  Hkv, Hg = dcfg.n_kv_heads, dcfg.n_heads // dcfg.n_kv_heads
  q = lp['wqkv'][:, :Hg].reshape(Hkv * Hg, *lp['wqkv'].shape[2:])
  q = q.reshape(Hg, Hkv, *q.shape[1:]).swapaxes(0, 1)
  return {**lp, 'wqkv': lp['wqkv'].at[:, :Hg].set(q)}


def _mask_of(target, token):
  return lambda dcfg, p: (dcfg, {**p, 'mask_embed': target.params['embed'][token]})


WRONG = {
    'layer ids without the offset': lambda dcfg, p: (dataclasses.replace(
        dcfg, feature_layers=tuple(i - 1 for i in dcfg.feature_layers)), p),
    'no q/k norm': lambda dcfg, p: (dataclasses.replace(dcfg, qk_norm=False), p),
    "the target's RoPE base": lambda dcfg, p: (dataclasses.replace(dcfg, rope_base=1e6), p),
    'query heads interleaved over KV heads': lambda dcfg, p: (dcfg, {**p, 'layers': [
        _interleave_query_heads(dcfg, lp) for lp in p['layers']]}),
    'fc without its norm': lambda dcfg, p: (dcfg, {**p, 'fc_norm': p['fc_norm'] * 0 + 1}),
}


@pytest.mark.parametrize('name', list(WRONG) + ['mask id off by one', 'mask token 0'])
def test_wrong_conversions_are_caught(target, drafter, ref, name):
  """The recorded logits tell each wrong conversion from the right one."""
  dcfg, dparams, meta = drafter
  mask_id = meta['dflash']['mask_token_id']
  wrong = {**WRONG, 'mask id off by one': _mask_of(target, mask_id - 1),
           'mask token 0': _mask_of(target, 0)}[name]
  bad_cfg, bad_params = wrong(dcfg, dparams)
  if not bad_cfg.qk_norm:
    bad_params = {**bad_params, 'layers': [
        {k: v for k, v in lp.items() if k not in ('q_norm', 'k_norm')}
        for lp in bad_params['layers']]}
  assert not np.allclose(block_logits(target, bad_cfg, bad_params, ref), ref['block_logits'],
                         **TOL)


@pytest.mark.slow
def test_greedy_dflash_matches_reference_loop(target, drafter, ref):
  """Our `dflash` method (batch of 3, one cycle at a time, caches checked against a fresh
  prefill at the end) commits what the reference loop commits, cycle by cycle, and outputs the
  same tokens. The reference shortens its last blocks to the room left before the length limit
  (the drafts of a shorter bidirectional block differ); ours keeps gamma, so those cycles are
  compared by their tokens only."""
  dcfg, dparams, _ = drafter
  prompts = [row[row >= 0].tolist() for row in ref['gen_prompts']]
  n_new = int(ref['max_new_tokens'])
  spec = SP.SpecSettings(generation=AR.GenerationSettings(max_new_tokens=n_new, eos_ids=(),
                                                         pad_id=0),
                         method='dflash', gamma=dcfg.gamma, drafter1=dcfg)
  bundle = {'target': target.params, 'drafter1': dparams}
  committed, last = [[] for _ in prompts], []

  def on_cycle(state, tree, acc, new_state):
    del tree, acc
    n_B = np.asarray(new_state.seq_len_B - state.seq_len_B)
    for b in np.flatnonzero(~np.asarray(state.done_B)):
      committed[b].append(int(n_B[b]))
    last[:] = [new_state]

  # Caches are checked once, at the end (after every cycle they cost 15 times the run).
  outs, _ = loop_checks.run_cycles(target.cfg, bundle, spec, prompts, check_caches=False,
                                    on_cycle=on_cycle)
  loop_checks.assert_caches_fresh(target.cfg, bundle, spec, last[0])
  for b in range(len(prompts)):
    assert outs[b] == ref['gen_output'][b].tolist() == ref['gen_ar'][b].tolist()
    want = ref['gen_accept'][b][ref['gen_accept'][b] >= 0]
    full = ref['gen_full_block'][b][:len(want)]
    n_full = int(full.sum())
    assert full[:n_full].all() and not full[n_full:].any()  # full blocks come first
    assert committed[b][:n_full] == want[:n_full].tolist(), f'row {b}'
    assert sum(committed[b]) == n_new - 1  # the prefill commits the first token
  # The fixture is worth something only if drafts are accepted, and not always equally often.
  accepted = ref['gen_accept'][ref['gen_accept'] >= 0]
  assert accepted.max() >= 3 and len(set(accepted.tolist())) >= 3


def test_decode_path_takes_the_dflash_folder(tmp_path):
  """generate_lib.generate (decode.py's and the notebook API's path) with the DFlash folder as
  drafter 1: the same completion as AR, drafts accepted. The target gets a character-level
  tokenizer (ids 0..62 = ' '..'^', EOS 63)."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  from tokenizers import decoders, models  # pylint: disable=import-outside-toplevel
  folder = tmp_path / 'target'
  shutil.copytree(os.path.join(FIXTURE, 'target'), folder)
  bpe = tokenizers.Tokenizer(models.BPE(vocab={chr(32 + i): i for i in range(63)}, merges=[]))
  bpe.add_special_tokens(['<eos>'])
  bpe.decoder = decoders.Fuse()
  bpe.save(str(folder / 'tokenizer.json'))
  (folder / 'generation_config.json').write_text(json.dumps({'eos_token_id': 63}))
  tgt = loaders.load_target(str(folder))
  drafters = {'drafter1': load_drafter(DRAFTER_DIR, tgt)[:2]}
  runs = {m: generate_lib.generate(tgt, drafters, ['HELLO, WORLD'], options_lib.Options(
      method=m, max_new_tokens=24, chat=False)) for m in ('ar', 'dflash')}
  assert runs['dflash'][0][0]['completion_ids'] == runs['ar'][0][0]['completion_ids']
  assert runs['dflash'][1]['gamma'] == 6 and runs['dflash'][1]['tau'] > 1
  # decode.py's config leaves spec.gamma unset: the drafter's block, as in the notebook API
  import io  # pylint: disable=import-outside-toplevel
  sys.path.insert(0, os.path.join(ROOT, 'configs'))
  import smollm2 as smollm2_config  # pylint: disable=import-outside-toplevel
  config = smollm2_config.get_config()
  config.update(target=str(folder), method='dflash', drafter1=DRAFTER_DIR, drafter2='',
                prompt='HELLO, WORLD', chat=False, max_new_tokens=24)
  stats = generate_lib.run(config, out=io.StringIO())
  assert stats['gamma'] == 6 and stats['tau'] == runs['dflash'][1]['tau']


# ----------------------------------------------------------------------------------------------
# Export


def _our_drafter(target, mask_token, **overrides):
  """A random drafter in DFlash's shape with every tensor perturbed (no all-ones norms), its
  mask embedding the target's embedding of `mask_token`."""
  dcfg = D.DrafterConfig(**{**dict(gamma=5, n_layers=2, d_model=target.cfg.d_model, n_heads=4,
                                   n_kv_heads=1, head_dim=8, d_ff=40, feature_layers=(0, 2, 3),
                                   rope_base=500000.0, norm_eps=1e-5,
                                   confidence_temperature=1.25, qk_norm=True), **overrides})
  params = D.init_params(dcfg, target.cfg, jax.random.PRNGKey(3))
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(4), len(leaves))
  params = jax.tree.unflatten(tree, [
      x if jnp.issubdtype(x.dtype, jnp.integer) else x + 0.05 * jax.random.normal(k, x.shape)
      for x, k in zip(leaves, keys)])
  params['mask_embed'] = target.params['embed'][mask_token]
  return dcfg, params


def _assert_same_params(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))


def test_export_import_round_trip_is_exact(target, tmp_path):
  dcfg, params = _our_drafter(target, mask_token=17)
  info = DF.save_folder(dcfg, params, target, str(tmp_path / 'hf'))
  assert info['mask_token_id'] == 17 and info['mask_embed_max_diff'] == 0.0
  assert info['target_layer_ids'] == [-1, 1, 2]  # layer 0 (embeddings) is DFlash's id -1
  dcfg2, params2, meta = load_drafter(str(tmp_path / 'hf'), target)
  assert dcfg2 == dcfg
  _assert_same_params(params2, params)
  assert meta['target_fingerprint'] == ckpt.target_fingerprint(target)


def test_sharded_prefixed_and_bfloat16_folders_load(target, drafter, tmp_path):
  """A sharded index whose names keep the base-model prefix loads as the single file does; a
  bfloat16 export loads as the bfloat16-rounded drafter."""
  from safetensors.numpy import load_file, save_file  # pylint: disable=import-outside-toplevel
  _, dparams, _ = drafter
  folder = tmp_path / 'sharded'
  folder.mkdir()
  shutil.copy(os.path.join(DRAFTER_DIR, 'config.json'), folder)
  tensors = load_file(os.path.join(DRAFTER_DIR, 'model.safetensors'))
  names = sorted(tensors)
  shards = {'model-00001-of-00002.safetensors': names[::2],
            'model-00002-of-00002.safetensors': names[1::2]}
  weight_map = {}
  for file, part in shards.items():
    save_file({f'model.{n}': tensors[n] for n in part}, str(folder / file),
              metadata={'format': 'pt'})
    weight_map.update({f'model.{n}': file for n in part})
  (folder / 'model.safetensors.index.json').write_text(json.dumps({'weight_map': weight_map}))
  _assert_same_params(load_drafter(str(folder), target)[1], dparams)

  dcfg, params = _our_drafter(target, mask_token=17)
  DF.save_folder(dcfg, params, target, str(tmp_path / 'bf16'), dtype='bfloat16')
  _, loaded, meta = load_drafter(str(tmp_path / 'bf16'), target)
  assert meta['param_dtype'] == 'bfloat16'
  rounded = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), params)
  rounded['mask_embed'] = params['mask_embed']  # the target's own row, whatever was stored
  _assert_same_params(loaded, rounded)


def test_import_export_reproduces_the_reference_folder(target, ref, tmp_path):
  """DFlash folder -> our Orbax checkpoint (CLI) -> DFlash folder (CLI): the same tensors, bit
  for bit, under the names, dtypes, safetensors metadata and config fields the reference reads;
  and the exported folder still gives the reference's logits."""
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  orbax_dir, hf_dir = str(tmp_path / 'orbax'), str(tmp_path / 'hf')
  target_dir = os.path.join(FIXTURE, 'target')
  for argv in (['import', DRAFTER_DIR, orbax_dir], ['export', orbax_dir, hf_dir]):
    sys_argv = sys.argv
    sys.argv = ['dflash_format', *argv, '--target', target_dir]
    try:
      load_script('dflash').main()
    finally:
      sys.argv = sys_argv
  _, _, meta = load_drafter(orbax_dir, target)  # ours now: tied to the target's fingerprint
  assert meta['target_fingerprint'] == ckpt.target_fingerprint(target)

  def tensors(folder):
    with safe_open(os.path.join(folder, 'model.safetensors'), framework='np') as f:
      return f.metadata(), {k: f.get_tensor(k) for k in f.keys()}

  ref_meta, ref_tensors = tensors(DRAFTER_DIR)
  our_meta, our_tensors = tensors(hf_dir)
  assert our_meta == ref_meta == {'format': 'pt'}  # transformers refuses other metadata
  assert sorted(our_tensors) == sorted(ref_tensors)
  for name, x in ref_tensors.items():
    assert our_tensors[name].dtype == x.dtype and np.array_equal(our_tensors[name], x), name

  theirs = json.load(open(os.path.join(DRAFTER_DIR, 'config.json')))
  ours = json.load(open(os.path.join(hf_dir, 'config.json')))
  read_by_reference = ('architectures', 'model_type', 'vocab_size', 'hidden_size',
                       'intermediate_size', 'num_hidden_layers', 'num_attention_heads',
                       'num_key_value_heads', 'head_dim', 'hidden_act', 'rms_norm_eps',
                       'rope_parameters', 'attention_bias', 'attention_dropout', 'layer_types',
                       'num_target_layers', 'block_size', 'tie_word_embeddings')
  for key in read_by_reference:
    assert ours[key] == theirs[key], key
  for key in ('mask_token_id', 'target_layer_ids'):
    assert ours['dflash_config'][key] == theirs['dflash_config'][key], key
  dcfg, dparams, _ = load_drafter(hf_dir, target)
  np.testing.assert_allclose(block_logits(target, dcfg, dparams, ref), ref['block_logits'], **TOL)


def test_export_refusals_and_their_ways_out(target, tmp_path):
  out = str(tmp_path / 'hf')
  dcfg, params = _our_drafter(target, mask_token=5)
  learned = {**params, 'mask_embed': params['mask_embed'] + 0.01}
  with pytest.raises(ValueError, match='mask embedding is its own learned vector'):
    DF.save_folder(dcfg, learned, target, out)
  info = DF.save_folder(dcfg, learned, target, out, mask_token_id=5)  # the way out, reported
  assert info['mask_token_id'] == 5 and abs(info['mask_embed_max_diff'] - 0.01) < 1e-6

  plain, plain_params = _our_drafter(target, mask_token=5, qk_norm=False)
  with pytest.raises(ValueError, match='no q/k norms'):
    DF.save_folder(plain, plain_params, target, out)

  sub, sub_params = _our_drafter(target, mask_token=5, head_vocab=40)
  with pytest.raises(ValueError, match='head_vocab=40'):
    DF.save_folder(sub, sub_params, target, out)
  DF.save_folder(sub, sub_params, target, out, full_head=True)
  assert load_drafter(out, target)[0].head_vocab == 0

  last, last_params = _our_drafter(target, mask_token=5, feature_layers=(1, 4))
  with pytest.raises(ValueError, match='after the final norm'):
    DF.save_folder(last, last_params, target, out)


# ----------------------------------------------------------------------------------------------
# Bad input


def _edited_copy(tmp_path, edit):
  folder = tmp_path / 'edited'
  shutil.copytree(DRAFTER_DIR, folder)
  config = json.loads((folder / 'config.json').read_text())
  edit(config)
  (folder / 'config.json').write_text(json.dumps(config))
  return str(folder)


def test_folder_without_dflash_config_is_refused(target):
  with pytest.raises(ValueError, match='has no dflash_config: .* is not a DFlash drafter'):
    load_drafter(os.path.join(FIXTURE, 'target'), target)


def test_drafter_for_another_target_is_refused(target, tmp_path):
  other = loaders.load_hf(os.path.join(FIXTURES, 'hf_tiny', 'qwen3'))
  with pytest.raises(ValueError, match=r'vocab_size=64 but the target has 96; hidden_size=32 but '
                     r'the target has 64; num_target_layers=4 but the target has 2: load it with '
                     r'the target it was trained for'):
    load_drafter(DRAFTER_DIR, other)
  wrong_vocab = _edited_copy(tmp_path, lambda c: c.update(vocab_size=100))
  with pytest.raises(ValueError, match='vocab_size=100 but the target has 64'):
    load_drafter(wrong_vocab, target)


def test_exported_folder_is_tied_to_its_target(target, tmp_path):
  dcfg, params = _our_drafter(target, mask_token=17)
  DF.save_folder(dcfg, params, target, str(tmp_path / 'hf'), target_source='tiny-qwen3')
  twin = dataclasses.replace(target, fingerprint=None, params={
      **target.params, 'final_norm': target.params['final_norm'] * 1.5})
  with pytest.raises(ValueError, match="exported for target 'tiny-qwen3'.*fingerprint"):
    load_drafter(str(tmp_path / 'hf'), twin)


@pytest.mark.parametrize('edit, message', [
    (lambda c: c['dflash_config'].update(conv_kernel_size=4), 'DFlash-2 drafter'),
    (lambda c: c.update(final_logit_softcapping=30.0), 'final_logit_softcapping'),
    (lambda c: c.update(layer_types=['full_attention', 'sliding_attention']), 'sliding-window'),
    (lambda c: c['dflash_config'].update(target_layer_ids=[0, 3]), 'final-norm output'),
    (lambda c: c['dflash_config'].pop('mask_token_id'), 'mask_token_id=None'),
])
def test_unsupported_dflash_configs_are_refused(target, tmp_path, edit, message):
  with pytest.raises(ValueError, match=message):
    load_drafter(_edited_copy(tmp_path, edit), target)


def test_output_multiplier_folds_into_the_final_norm(target, drafter, tmp_path):
  dcfg, dparams, _ = drafter
  folder = _edited_copy(tmp_path, lambda c: c['dflash_config'].update(output_multiplier=2.0))
  _, scaled, _ = load_drafter(folder, target)
  tokens = jnp.asarray([[3, 7, 9, 11, 2, 5]])
  args = (tokens, tokens < 0, jnp.arange(6)[None], D.init_context_cache(dcfg, 1, 4),
          jnp.zeros((1, 4), bool), jnp.ones((1, 6, 6), bool))
  np.testing.assert_allclose(D.forward(scaled, dcfg, target.params, target.cfg, *args),
                             2.0 * D.forward(dparams, dcfg, target.params, target.cfg, *args),
                             rtol=1e-5, atol=1e-5)
