"""The draft family in the real engine: the EAGLE-3.1 flags on qwen3-tiny and the MLA draft on kimi-tiny, served by vLLM.

Each variant is trained on its toy target's own greedy continuations (the `train` loop), exported with `export_draft`
and served beside the target alone by `verify`: loaded, greedy output identical, acceptance counted, and our offline
simulation of the same continuations beside the served figure (the engine computes what we trained only if the two
agree). qwen3-tiny shares one baseline server across the module; at most two engine servers run at once.
Doctor's planted faults per variant need no engine and run first.
"""

import json, os, shutil
from pathlib import Path
import pytest, torch
from safetensors.torch import load_file, save_file

from eagle3nb.doctor import doctor, toy_export, CHECKS
from eagle3nb.engine import VllmServer, engine_available

N_PROMPTS, MAX_TOKENS = 6, 24
needs_engine = pytest.mark.skipif(
    not engine_available() and not os.environ.get('EAGLE3NB_REQUIRE_ENGINE'),
    reason='no vLLM engine: run `make engine` or set EAGLE3NB_VLLM',
)


def variant_export(name: str, out: Path, steps: int = 150, **opts) -> tuple:  # export dir, prompts, target dir
    "Train a full-vocabulary draft of one variant on toy `name`'s greedy continuations and export it"
    from eagle3nb.draft import new_draft, draft_options
    from eagle3nb.train import toy_samples, train, TrainConfig, latest_checkpoint
    from eagle3nb.export import export_draft
    from eagle3nb.toy import ensure_toy

    ts = toy_samples(n=N_PROMPTS, new_tokens=MAX_TOKENS + 8, name=name)
    V = ts['V']
    dr = new_draft(
        ts['config'],
        ts['embed'],
        torch.zeros(V, dtype=torch.long),
        torch.ones(V, dtype=torch.bool),
        lm_head=ts['lm_head'],
        **draft_options(opts),
    )
    cfg = TrainConfig(
        max_steps=steps, warmup_steps=10, lr=3e-3, ckpt_every=steps, eval_every=steps, log_every=steps, ttt_steps=5
    )
    train(dr, ts['train'], out / 'run', cfg, log=lambda *a: None)
    export_draft(latest_checkpoint(out / 'run'), out / 'export', ensure_toy(name))
    return out / 'export', [s['input_ids'][:16].tolist() for s in ts['train']], ensure_toy(name)


# --- doctor: each variant's silent failures, planted in a copy of a good export (no engine) ---


@pytest.fixture(scope='module')
def exports(kimi_tiny, tmp_path_factory):
    "Good toy exports of kimi-tiny: a llama draft with every Llama 3.1 flag, an mla draft with the MLA ones"
    d = tmp_path_factory.mktemp('variants')
    return dict(
        llama=toy_export(kimi_tiny, d / 'llama', fc_norm=True, norm_before_fc=True, norm_output=True),
        mla=toy_export(kimi_tiny, d / 'mla', arch='mla', fc_norm=True, norm_output=True),
    )


def _copy(src, dst, config=None, tensors=None):
    shutil.copytree(src, dst)
    if config:
        c = json.loads((dst / 'config.json').read_text())
        config(c)
        (dst / 'config.json').write_text(json.dumps(c))
    if tensors:
        w = load_file(str(dst / 'model.safetensors'))
        tensors(w)
        save_file(w, str(dst / 'model.safetensors'))
    return dst


def test_variant_exports_pass_doctor(exports, kimi_tiny):
    "Both variants pass every check; the config carries the flags, the target's YaRN and (mla) its MLA sizes"
    for arch, d in exports.items():
        df = doctor(d, kimi_tiny).set_index('check')
        assert (df.status != 'FAIL').all(), df.to_dict('index')
        assert df.status['draft_variant'] == 'ok' and df.status['rope'] == 'ok'
        c = json.loads((d / 'config.json').read_text())
        assert c['rope_scaling']['rope_type'] == 'yarn' and c['rope_scaling']['factor'] == 32.0
        assert c['fc_norm'] and c['norm_output'] and c.get('norm_before_fc', False) == (arch == 'llama')
    c = json.loads((exports['mla'] / 'config.json').read_text())
    assert (c['architectures'], c['model_type'], c['kv_lora_rank'], c['qk_rope_head_dim']) == (
        ['Eagle3DeepseekV2ForCausalLM'],
        'deepseek_v2',
        512,
        64,
    )


def _drop(*names):
    return lambda w: [w.pop(n) for n in names]


# name: (variant, config edit, tensor edit), the check that must fail, words its FAIL row must hold
PLANTS = {
    'fc_norm_without_tensors': (
        'llama',
        None,
        _drop('fc_norm.0.weight', 'fc_norm.1.weight', 'fc_norm.2.weight'),
        'draft_variant',
        'fc_norm is set but fc_norm.0.weight',
    ),
    'input_norm_without_flag': (
        'llama',
        lambda c: (c.pop('norm_before_fc'), c['eagle_config'].pop('norm_before_fc')),
        None,
        'draft_variant',
        'input_norm.weight present but norm_before_fc is not set',
    ),
    'norm_output_dropped': (
        'llama',
        lambda c: c.pop('norm_output'),
        None,
        'draft_variant',
        'norm_output (config False, trained True)',
    ),
    'mla_fc_norm_without_flag': (
        'mla',
        lambda c: c.pop('fc_norm'),
        None,
        'draft_variant',
        'present but fc_norm is not set',
    ),
    'mla_under_llama_name': (
        'mla',
        lambda c: c.update(architectures=['LlamaForCausalLMEagle3'], model_type='llama'),
        None,
        'draft_variant',
        'holds an MLA layer (q_a_proj, kv_a_proj_with_mqa, ...) but config.json names LlamaForCausalLMEagle3',
    ),
    'mla_as_deepseek_v3': (
        'mla',
        lambda c: c.update(model_type='deepseek_v3'),
        None,
        'draft_variant',
        "model_type 'deepseek_v3' for an MLA draft",
    ),
    'mla_sizes_differ': (
        'mla',
        lambda c: c.update(q_lora_rank=16),
        None,
        'draft_variant',
        'q_lora_rank 16 (target 32)',
    ),
    'mla_norm_before_fc': (
        'mla',
        lambda c: c.update(norm_before_fc=True),
        lambda w: w.update({'input_norm.weight': torch.ones(192).bfloat16()}),
        'draft_variant',
        "norm_before_fc on an MLA draft",
    ),
    'llama_rope_plain': (
        'llama',
        lambda c: c.pop('rope_scaling'),
        None,
        'rope',
        'served with rope (theta 50000, plain) but the target rotates with (theta 50000, yarn factor 32',
    ),
    'mla_rope_factor': ('mla', lambda c: c['rope_scaling'].update(factor=64.0), None, 'rope', 'yarn factor 64'),
}


def test_flagged_llama_draft_gets_an_sglang_command(exports, kimi_tiny, tmp_path):
    "SGLang 0.5.23's llama_eagle3.py reads the 3.1 flags: both engines get a command; an older SGLang is refused"
    from eagle3nb.export import launch_commands, sglang_problem

    assert sorted(launch_commands(exports['llama'], kimi_tiny)) == ['sglang', 'vllm']
    assert sorted(launch_commands(exports['mla'], kimi_tiny)) == ['sglang', 'vllm']  # kimi_k25_eagle3.py reads them
    sg = tmp_path / 'launch_sglang.sh'
    sg.write_text(launch_commands(exports['llama'], kimi_tiny)['sglang'])
    df = doctor(exports['llama'], kimi_tiny, server_args=sg).set_index('check')
    assert df.status['speculative_algorithm'] == 'ok', df.detail['speculative_algorithm']
    cfg = json.loads((exports['llama'] / 'config.json').read_text())
    assert 'reads no EAGLE-3.1 flag' in sglang_problem(cfg, '0.5.9')
    vl = tmp_path / 'launch_vllm.sh'
    vl.write_text(launch_commands(exports['llama'], kimi_tiny)['vllm'])
    assert (
        doctor(exports['llama'], kimi_tiny, server_args=vl).set_index('check').status['speculative_algorithm'] == 'ok'
    )


@pytest.mark.parametrize('name', PLANTS)
def test_variant_plant_is_caught(name, exports, kimi_tiny, tmp_path):
    arch, cfg, ts, check, words = PLANTS[name]
    d = _copy(exports[arch], tmp_path / 'bad', cfg, ts)
    df = doctor(d, kimi_tiny).set_index('check')
    assert set(df.index[df.status == 'FAIL']) == {check}, df.to_dict('index')
    assert words in df.detail[check], df.detail[check]


# --- vLLM serves each variant ---


@pytest.fixture(scope='module')
def qwen3_engines():
    "One engine session of qwen3-tiny for the module: its baseline server starts once and serves every test"
    from eagle3nb.phase import EngineSession
    from eagle3nb.toy import ensure_toy

    with EngineSession.of(ensure_toy('qwen3-tiny')) as es:
        yield es


def _served_as_trained(r, df, log: Path):
    assert list(df.status) == ['ok'] * 4, df.to_string()
    assert r['greedy_identical'] == N_PROMPTS and r['drafts'] > 0 and r['accepted'] > 0
    assert abs(r['accept_length'] - r['offline_accept_length']) < 0.1 * r['offline_accept_length'], (
        r['accept_length'],
        r['offline_accept_length'],
    )
    assert 'Using auxiliary layers' in log.read_text() or 'Eagle3' in log.read_text()


# norm_before_fc alone, and EAGLE-3.1's pair (fc_norm + norm_output, as the Kimi demo's draft); fc_norm alone is the
# demo's draft (tests/test_demo.py: served within 10% of offline). One engine server each.
@needs_engine
@pytest.mark.parametrize('flags', [('norm_before_fc',), ('fc_norm', 'norm_output')], ids=lambda f: '+'.join(f))
def test_verify_llama_flag_qwen3(flags, qwen3_engines, tmp_path):
    "A Llama draft trained with 3.1 flags loads in vLLM, greedy output is identical, served acceptance = offline"
    from eagle3nb.verify import verify, verify_rows

    d, prompts, target = variant_export('qwen3-tiny', tmp_path, **{f: True for f in flags})
    cfg = json.loads((d / 'config.json').read_text())
    assert all(cfg[f] is True for f in flags), cfg
    r = verify(d, target, prompts, MAX_TOKENS, 3, engines=qwen3_engines, log_dir=tmp_path)
    df = verify_rows(r)
    print(f"qwen3-tiny {'+'.join(flags)}\n{df.to_string(index=False)}")
    _served_as_trained(r, df, tmp_path / 'spec.log')


# The MLA draft served on an MLA target (Eagle3DeepseekV2ForCausalLM, MLA kept: no VLLM_MLA_DISABLE), accepted as
# trained: tests/test_demo_kimi.py checks it on the Kimi-K2.5-packaged toy, from its own run's export.


def test_phase_train_takes_draft_block(tmp_path):
    "phases.train.draft reaches the train phase: a smoke run with {arch: mla, fc_norm: true} checkpoints that draft"
    from pydantic import ValidationError
    from safetensors import safe_open
    from eagle3nb.phase import RunContext
    from eagle3nb.phases import train

    ctx = RunContext.open('', tmp_path / 'run')
    p = dict(max_steps=4, ckpt_every=4, eval_every=4, ttt_steps=2, draft={'arch': 'mla', 'fc_norm': True})
    rec = train.run(ctx, p)
    ck = Path(rec.checkpoint)
    assert ck == tmp_path / 'run' / 'checkpoints' / 'step_4'
    with safe_open(str(ck / 'model.safetensors'), 'pt') as f:
        dc, names = json.loads(f.metadata()['draft_config']), set(f.keys())
    assert (dc['arch'], dc['fc_norm'], dc['kv_lora_rank'], dc['rope_scaling']['rope_type']) == (
        'mla',
        True,
        512,
        'yarn',
    )
    assert 'midlayer.self_attn.kv_a_proj_with_mqa.weight' in names and 'fc_norm.2.weight' in names
    assert (rec.draft['arch'], rec.draft['fc_norm']) == ('mla', True)
    with pytest.raises(ValidationError, match='phases.train.draft.norm: unknown'):
        train.run(RunContext.open('', tmp_path / 'run2'), max_steps=2, draft={'norm': True})
    assert not (tmp_path / 'run2' / 'checkpoints').exists()  # refused before any training
