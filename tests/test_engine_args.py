"Every command line eagle3nb builds or prints passes its engine's own argument parser; doctor refuses those that fail"

import os, shlex, subprocess, sys
from pathlib import Path
import pytest
import eagle3nb.doctor, eagle3nb.engine, eagle3nb.engine_args
from eagle3nb.doctor import doctor, toy_export
from eagle3nb.engine import settle, sglang_command, vllm_command
from eagle3nb.recipe import Launch
from eagle3nb.engine_args import launch_of, parse_launches, parse_wanted
from eagle3nb.engine_extract import extract_kv_config, extract_spec
from eagle3nb.export import export_draft, launch_commands, random_checkpoint, write_launch_scripts
from eagle3nb.plan import plan_facts
from eagle3nb.toy import ensure_toy

ROOT = Path(__file__).resolve().parent.parent

KIMI = 'moonshotai/Kimi-K2.5'  # the Kimi recipe's target, as the cluster's engines load it (a hub id: parsing only)


def need(*engines):
    "Skip unless the engines are here; under EAGLE3NB_REQUIRE_ENGINE=1 (make test) run, so a missing one fails"
    missing = [e for e in engines if not parse_wanted(e)]
    if missing:
        pytest.skip(
            f"no {' or '.join(missing)} here: run `make engine` (make test builds both, EAGLE3NB_REQUIRE_ENGINE=1)"
        )


@pytest.fixture(scope='module')
def demo(tmp_path_factory):
    "A demo-like export: the qwen3 toy target and a Llama draft with fc_norm, as recipes/demo.yaml trains it"
    d = tmp_path_factory.mktemp('engine-args-demo')
    target = ensure_toy('qwen3-tiny', out=d / 'qwen3-tiny')
    export_draft(random_checkpoint(target, d / 'run', fc_norm=True), d / 'draft', target)
    return target, d / 'draft'


@pytest.fixture(scope='module')
def kimi_draft(kimi_tiny, tmp_path_factory):
    "The Kimi recipe's draft family (MLA, fc_norm, norm_output), exported for the kimi toy"
    d = tmp_path_factory.mktemp('engine-args-kimi')
    ck = random_checkpoint(kimi_tiny, d / 'run', arch='mla', fc_norm=True, norm_output=True)
    export_draft(ck, d / 'draft', kimi_tiny)
    return d / 'draft'


@pytest.fixture(scope='module')
def good(kimi_tiny, tmp_path_factory):
    "An export that passes every doctor check, with its training record"
    return toy_export(kimi_tiny, tmp_path_factory.mktemp('engine-args-doctor') / 'good')


def printed_lines(demo, kimi_draft) -> dict:
    "The launch lines `eagle3nb launch` prints and export writes: the demo's (TP 1) and the Kimi recipe's (TP 8)"
    target, draft = demo
    out = {f'demo {e}': c for e, c in launch_commands(draft, target, tp=1).items()}
    out.update({f'kimi-tp8 {e}': c for e, c in launch_commands(kimi_draft, KIMI, tp=8, thinking=True).items()})
    return out


def started_lines(demo) -> dict:
    "The argv of the servers eagle3nb starts itself: vLLM with a draft, vLLM extracting hidden states, SGLang"
    target, draft = demo
    spec = dict(method='eagle3', model=str(draft), num_speculative_tokens=3)
    kw = dict(python='python')  # argv[0] only: the parser is the engine install's
    return {
        'vllm_command speculative': vllm_command(target, 8000, speculative=spec, **kw),
        'vllm_command kimi': vllm_command(
            KIMI, 8000, speculative=spec, trust_remote_code=True, language_model_only=True, **kw
        ),
        'vllm_command kv_transfer cpu': vllm_command(
            target,
            8000,
            speculative=extract_spec([2, 4, 5, 8]),
            kv_transfer=extract_kv_config('/tmp/spool', cpu=True),
            extra=['--no-enable-chunked-prefill'],
            **kw,
        ),
        'vllm_command kv_transfer gpu': vllm_command(
            target,
            8000,
            speculative=extract_spec([2, 4, 5, 8]),
            kv_transfer=extract_kv_config('/tmp/spool', cpu=False),
            **kw,
        ),
        'vllm_command cpu build': vllm_command(target, 8000, speculative=spec, launch=settle(cpu=True), **kw),
        'vllm_command kimi tp8 settings': vllm_command(
            KIMI,
            8000,
            speculative=spec,
            launch=Launch(tp=8, context=32768, memory=0.85, extra=['--max-num-seqs', '64']),
            **kw,
        ),
        'sglang_command draft': sglang_command(target, 30000, draft=draft, **kw),
        'sglang_command kimi tp8 settings': sglang_command(
            KIMI, 30000, draft=draft, launch=Launch(tp=8, context=32768, memory=0.85, eager=True), **kw
        ),
        'sglang_command aux_layers': sglang_command(
            target, 30000, aux_layers=[2, 4, 5], launch=Launch(context=2048), **kw
        ),
        'sglang_command cpu': sglang_command(target, 30000, draft=draft, cpu=True, trust_remote_code=True, **kw),
        'sglang_command cpu aux_layers': sglang_command(target, 30000, aux_layers=[2, 4, 5], cpu=True, **kw),
    }


def test_every_line_we_build_parses(demo, kimi_draft, tmp_path):
    need('sglang', 'vllm')
    printed, started = printed_lines(demo, kimi_draft), started_lines(demo)
    assert {'demo vllm', 'kimi-tp8 sglang', 'kimi-tp8 vllm'} <= set(printed), printed  # the MLA draft: both engines
    kimi = printed['kimi-tp8 sglang'].split() + printed['kimi-tp8 vllm'].split()
    assert kimi.count('--trust-remote-code') == 2 and kimi.count('--reasoning-parser') == 2 and 'kimi_k2' in kimi
    assert '--tp 8' in printed['kimi-tp8 sglang'] and '--tensor-parallel-size 8' in printed['kimi-tp8 vllm']
    scripts = write_launch_scripts(tmp_path, launch_commands(kimi_draft, KIMI, tp=8, thinking=True))
    texts = {f'script {p.name}': p.read_text() for p in scripts}  # JSON in single quotes, a comment line first
    lines = {**printed, **started, **texts}
    rs = dict(zip(lines, parse_launches(list(lines.values()))))
    for k, r in rs.items():  # the verdicts, for the record (pytest -s)
        line = lines[k] if isinstance(lines[k], str) else shlex.join(lines[k][1:])
        print(f"{r['engine']:6} {r['ok']!s:5} {r['seconds']:5.1f}s {k}: {line}")
    assert {k: r['error'] for k, r in rs.items() if r['ok'] is not True} == {}
    assert {k for k, r in rs.items() if r['engine'] == 'sglang'} == {k for k in lines if 'sglang' in k}
    assert rs['script launch_vllm.sh']['args'] == launch_of(printed['kimi-tp8 vllm'])['args']  # the quoting survives


def test_the_kimi_plan_prints_lines_its_engines_accept():
    """Every engine line the Kimi recipe's plan prints (its generation servers, its extraction servers, the draft's
    launch lines) comes from the recipe's `serving` settings and passes that engine's own parser (nothing started)"""
    need('sglang', 'vllm')
    f = plan_facts(ROOT / 'recipes' / 'kimi-k2.5-agentic-100k.yaml', version=4)
    lines = {
        f'{ph} {i}': ln
        for ph, _, ls in f['commands']
        for i, ln in enumerate(ls)
        if not ln.startswith('#') and ('sglang.launch_server' in ln or 'openai.api_server' in ln)
    }
    assert [k.split()[0] for k in lines] == ['target_check', 'extract', 'export', 'export'], list(lines)
    for (k, ln), r in zip(lines.items(), parse_launches(list(lines.values()))):
        print(f"{r['engine']:6} {r['ok']!s:5} {k}: {ln}")  # the verdicts, for the closing note (pytest -s)
        assert r['ok'] is True, (k, r['error'])
        w = shlex.split(ln)
        assert w[w.index('--tp' if r['engine'] == 'sglang' else '--tensor-parallel-size') + 1] == '8', ln
        assert '--trust-remote-code' in w and ('--mem-fraction-static' in w or '--gpu-memory-utilization' in w), ln
    gen = [ln for k, ln in lines.items() if k.startswith('target_check')]
    assert '--context-length 32768' in gen[0]  # serving.generate.launch: the long partition's context


def test_refused_in_the_engines_own_words(demo):
    need('sglang', 'vllm')
    target, draft = demo
    sg, vl = launch_commands(draft, target)['sglang'], launch_commands(draft, target)['vllm']
    rs = parse_launches(
        [
            sg + ' --no-such-flag',
            sg.replace('--speculative-algorithm', '--speculative-algoritm'),
            sg + ' --tp one',  # TP 1 is the engine's default: the builder writes no --tp
            vl + ' --speculative-model /d',
            vl + ' --tensor-parallel-size one',
        ]
    )
    for r in rs:
        print(r['engine'], r['ok'], r['error'])
    assert [r['ok'] for r in rs] == [False] * 5, rs
    assert rs[0]['error'] == 'unrecognized arguments: --no-such-flag'
    assert rs[1]['error'] == 'unrecognized arguments: --speculative-algoritm EAGLE3'
    assert rs[2]['error'].endswith("--tensor-parallel-size: invalid int value: 'one'")
    assert rs[3]['error'].startswith('unrecognized arguments: --speculative-model')  # vLLM 0.32's old flag
    assert rs[4]['error'].endswith("invalid int value: 'one'"), rs[4]


def _write(tmp_path, cmd) -> Path:
    f = tmp_path / 'launch_sglang.sh'
    f.write_text(f'#!/bin/sh\n# the draft, as served\n{cmd}\n')
    return f


def test_eagle_is_refused_before_any_engine_starts(good, kimi_tiny, tmp_path, monkeypatch):
    "--speculative-algorithm EAGLE for an EAGLE-3 export: the speculative_algorithm row fails, before the engine row"
    events = []
    spec, parse = eagle3nb.doctor.check_speculative_algorithm, eagle3nb.engine_args.parse_launch
    monkeypatch.setattr(eagle3nb.doctor, 'check_speculative_algorithm', lambda *a: events.append('spec') or spec(*a))
    monkeypatch.setattr(eagle3nb.engine_args, 'parse_launch', lambda *a: events.append('args') or parse(*a))
    monkeypatch.setattr(eagle3nb.engine, 'engine_available', lambda *a, **k: True)
    served = dict(loaded=True, warnings=[], greedy_identical=4, accepted=5, draft_tokens=9, accept_length=1.5)
    monkeypatch.setattr(eagle3nb.engine, 'verify_served', lambda *a, **k: events.append('engine') or served)
    sg = launch_commands(good, kimi_tiny)['sglang'].replace('EAGLE3', 'EAGLE')
    df = doctor(good, kimi_tiny, server_args=_write(tmp_path, sg), engine=True).set_index('check')
    assert events == ['spec', 'args', 'engine'], events  # both launch checks ran before the engine row
    assert df.status['speculative_algorithm'] == 'FAIL' and 'not EAGLE3' in df.detail['speculative_algorithm']
    assert df.status['engine_args'] == ('ok' if parse_wanted('sglang') else 'n/a'), df.detail['engine_args']


def test_unknown_flag_fails_the_engine_args_row(good, kimi_tiny, tmp_path):
    need('sglang', 'vllm')
    sg = launch_commands(good, kimi_tiny)['sglang'] + ' --no-such-flag'
    vl = launch_commands(good, kimi_tiny)['vllm'] + ' --speculative-model /d'
    parse_launches([sg, vl])  # both engines' parsers side by side; doctor's rows below reuse the verdicts
    for cmd, words in ((sg, 'SGLang 0.'), (vl, 'vLLM 0.')):
        df = doctor(good, kimi_tiny, server_args=_write(tmp_path, cmd)).set_index('check')
        assert list(df.index[df.status == 'FAIL']) == ['engine_args'], df.to_dict('index')
        assert (
            words in df.detail['engine_args']
            and 'own argument parser refuses the launch command' in df.detail['engine_args']
        )
    assert 'unrecognized arguments: --no-such-flag' in doctor(good, kimi_tiny, server_args=sg).detail[1]


def test_cli_exits_1(good, kimi_tiny, tmp_path):
    "`eagle3nb doctor DRAFT --target T --server-args FILE --no-engine`, as a user runs it"
    need('sglang')
    eagle3nb_cli = str(Path(sys.executable).parent / 'eagle3nb')
    sg = launch_commands(good, kimi_tiny)['sglang']
    for cmd, words in (
        (sg.replace('EAGLE3', 'EAGLE'), 'eagle3nb doctor: error: speculative_algorithm: sglang serves the draft with'),
        (sg + ' --no-such-flag', 'eagle3nb doctor: error: engine_args: SGLang 0.5'),
    ):
        f = _write(tmp_path, cmd)
        argv = [eagle3nb_cli, 'doctor', str(good), '--target', str(kimi_tiny), '--server-args', str(f), '--no-engine']
        p = subprocess.run(
            argv, capture_output=True, text=True, timeout=600, env={**os.environ, 'OMP_NUM_THREADS': '1'}
        )
        assert p.returncode == 1 and words in p.stderr, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    assert 'unrecognized arguments: --no-such-flag' in p.stderr
