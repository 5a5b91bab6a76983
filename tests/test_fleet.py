"""The run as deployed: every engine server is started outside the run, as a cluster's are, and given to it as URLs
in the recipe (`target.endpoints`, `serving.extract.urls`, `serving.draft`). The run starts no engine itself, which
is checked by watching its processes, and every engine phase still writes its record with the figures those servers
counted. One SGLang server generates and is the baseline, one vLLM server returns hidden states, and a second SGLang
server serves the exported draft, started (as a user would, from the export) between the two halves of the run."""

import json, os, subprocess, sys, threading, time, uuid, shutil
from pathlib import Path
import psutil, pytest, yaml
from eagle3nb.engine import SglangServer, engine_available, sglang_available
from eagle3nb.engine_extract import extract_server
from eagle3nb.server import free_port
from eagle3nb.target import target_summary
from eagle3nb.toy import ensure_toy

ROOT = Path(__file__).resolve().parent.parent
EAGLE3NB = str(Path(sys.executable).parent / 'eagle3nb')


def engine_server(argv: list) -> bool:
    "Is this process an engine server or one of its workers? By its argv's head, not by a word in a script it runs"
    head = ' '.join(argv[1:3])
    cli = len(argv) > 1 and Path(argv[0]).name == 'vllm' and argv[1] == 'serve'
    return (
        head in ('-m sglang.launch_server', '-m vllm.entrypoints.openai.api_server')
        or cli
        or (bool(argv) and argv[0].startswith(('sglang::', 'VLLM::')))
    )


pytestmark = pytest.mark.skipif(
    not (sglang_available() and engine_available()) and not os.environ.get('EAGLE3NB_REQUIRE_ENGINE'),
    reason='needs vLLM and SGLang: run `make engine` (make test builds both and sets EAGLE3NB_REQUIRE_ENGINE=1)',
)


@pytest.fixture
def run_id():
    rid = f'pytest-fleet-{uuid.uuid4().hex[:8]}'
    yield rid
    shutil.rmtree(ROOT / 'papermill_runs' / rid, ignore_errors=True)


def watched(args: list) -> tuple:  # (completed process, engine command lines seen among its descendants)
    "`eagle3nb ARGS`, its process tree sampled until it ends: any engine server it started is seen"
    p = subprocess.Popen(
        [EAGLE3NB, *map(str, args)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, 'OMP_NUM_THREADS': '1'},
    )
    seen, me = set(), psutil.Process(p.pid)

    def watch():
        while p.poll() is None:
            try:
                for c in me.children(recursive=True):
                    argv = c.cmdline()
                    if engine_server(argv):  # (doctor hands lines to the engines' parsers: no server)
                        seen.add(' '.join(argv)[:300])
            except psutil.Error:
                pass
            time.sleep(0.1)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    out, err = p.communicate(timeout=2400)  # a ceiling for a hang, not a wait
    t.join()
    return subprocess.CompletedProcess(p.args, p.returncode, out, err), seen


def test_the_run_on_servers_it_did_not_start(tmp_path, run_id):
    target = ensure_toy('qwen3-tiny-trained')
    ts = target_summary(target)
    spool, spec_port = tmp_path / 'spool', free_port()
    gen = SglangServer(target, log_path=tmp_path / 'sglang-generate.log')  # generation, and the baseline
    ext = extract_server(target, spool, ts['aux_layers'] + [ts['num_hidden_layers']], log_path=tmp_path / 'vllm.log')
    spec = None
    try:
        gen.start(), ext.start()  # both start at once; each is ready when it answers
        gen.wait_ready(), ext.wait_ready()
        r = yaml.safe_load((ROOT / 'recipes' / 'demo-sglang.yaml').read_text())
        r.update(data_root=str(tmp_path / 'data'), catalog=str(tmp_path / 'catalog.duckdb'))
        r['target'].update(model=str(target), endpoints=[gen.base_url])
        spec_url = f'http://127.0.0.1:{spec_port}/v1'  # started by the user once the draft is exported
        r['serving'] = dict(
            extract=dict(engine='vllm', urls=[ext.base_url]),
            draft=dict(engine='sglang', baseline=gen.base_url, speculative=spec_url),
        )
        ph = r['phases']
        ph['extract'] = dict(engine='vllm', spool=str(spool))
        ph['train'].pop('served_eval_every')  # a checkpoint cannot be served on a server the run does not start
        ph['serve_bench'] = dict(concurrencies='1', max_k=0)
        (tmp_path / 'fleet.yaml').write_text(yaml.safe_dump(r))
        first = 'target_check,download,prepare,render,catalog,generate,merge,vocab,extract,train,export,doctor'
        p1, seen1 = watched(['run', tmp_path / 'fleet.yaml', '--run-id', run_id, '--phases', first])
        assert p1.returncode == 0, p1.stderr[-4000:]
        rd = ROOT / 'papermill_runs' / run_id
        export = tmp_path / 'data' / 'export'
        spec = SglangServer(target, port=spec_port, draft=export, k=3, log_path=tmp_path / 'sglang-spec.log')
        spec.start().wait_ready()  # the user's speculative server, as launch_sglang.sh says (port ours)
        p2, seen2 = watched(['run', tmp_path / 'fleet.yaml', '--run-id', run_id, '--phases', 'verify,serve_bench'])
        assert p2.returncode == 0, p2.stderr[-4000:]
        # doctor's engine row on the same servers, as the user runs it once the draft is served
        urls = ['--baseline', gen.base_url, '--speculative', spec_url, '--server', spec_url]
        d, seen3 = watched(['doctor', export, '--target', target, *urls])
        assert d.returncode == 0, d.stdout[-3000:] + d.stderr[-2000:]
        said = ' '.join(d.stdout.split())  # the report wraps its details: words in order, one space apart
        assert f'engine ok {spec_url} (SGLang serves EAGLE3 with' in said and '(its own counters)' in said, d.stdout
        assert seen1 == seen2 == seen3 == set(), seen1 | seen2 | seen3  # no engine server under the run, ever
        rec = lambda k: json.loads((rd / f'{k}.json').read_text())
        # target_check asked every role's servers: the extraction server returns the right final state
        checks = {c['check']: c for c in rec('target_check')['checks']}
        probe = checks[f'extract_states {ext.base_url}']
        assert probe['ok'] and probe['observed'].startswith('4/4 probes'), probe
        # generation and extraction went to the servers named for them
        caps = rec('generate')['summary']['caps']
        assert list(caps) == [gen.base_url] and rec('generate')['summary']['failed'] == 0, caps
        ex = rec('extract')
        assert ex['engine'] == 'vllm' and sum(x['requests'] for x in ex['rows']) == sum(
            x['new_samples'] for x in ex['rows'] if x['mode'] == 'bf16'
        ), ex['rows']
        # verify and serve-bench measured on the user's servers, the acceptance as SGLang counted it
        v = rec('verify')
        assert v['loaded'] and v['greedy_identical'] == v['n_prompts'] and v['accept_length'] > 1.2, v
        assert v['engine'] == 'sglang' and v['draft_check']['ok'] is True, v['draft_check']
        sb = rec('serve_bench')
        assert (sb['baseline'], sb['speculative']) == (gen.base_url, spec_url), sb
        acc = [x['accept_len'] for x in sb['rows'] if x['endpoint'] == 'speculative']
        print(
            f"fleet: verify accept {v['accept_length']:.3f} (SGLang's counters; offline {v['offline_accept_length']}), "
            f"serve-bench accept {acc}, {v['drafts']} rounds"
        )
        assert acc and all(a > 1.2 for a in acc), sb['rows']
    finally:
        for s in (spec, ext, gen):
            if s is not None:
                s.stop()
