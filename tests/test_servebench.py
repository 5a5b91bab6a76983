"serve-bench against the live toy server (as baseline and speculative), fake SGLang / vLLM stats endpoints, break-even"

import http.server, json, math, threading
from pathlib import Path
from types import SimpleNamespace
import pytest
from eagle3nb import servebench
from eagle3nb.merge import load_corpus, merge_recipe, smoke_recipe
from eagle3nb.server import free_port
from eagle3nb.servebench import (
    accept_length,
    bench_endpoint,
    break_even,
    break_even_table,
    serve_bench,
    serve_bench_cli,
    eval_prompts,
    spec_state,
    WORKED_EXAMPLE,
)

PROMPTS = [
    'Say hello.',
    'Count to five.',
    [dict(role='system', content='Be brief.'), dict(role='user', content='Name a colour.')],
    {'messages': [dict(role='user', content='One word, please.')]},
]


class _Fake(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = self.server.routes.get(self.path)
        if body is None:
            return self.send_error(404)
        b = (body if isinstance(body, str) else json.dumps(body)).encode()
        self.send_response(200)
        self.send_header('Content-Length', str(len(b)))
        self.end_headers()
        self.wfile.write(b)

    def log_message(self, *a):
        pass


@pytest.fixture
def fake_engine():
    "Start loopback servers that answer GETs from a mutable `routes` dict; yields a factory (routes) -> (server, base URL)"
    started = []

    def make(routes):
        srv = http.server.ThreadingHTTPServer(('127.0.0.1', 0), _Fake)
        srv.routes = routes
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        started.append(srv)
        return srv, f'http://127.0.0.1:{srv.server_port}/v1'

    yield make
    for s in started:
        s.shutdown()
        s.server_close()


def test_toy_server_as_both_endpoints(toy_server):
    df = serve_bench(
        toy_server.base_url, toy_server.base_url, toy_server.model, PROMPTS, concurrencies=(1, 2), max_tokens=8
    )
    assert list(zip(df.endpoint, df.concurrency)) == [
        ('baseline', 1),
        ('speculative', 1),
        ('baseline', 2),
        ('speculative', 2),
    ]
    assert (df.ok == len(PROMPTS)).all() and (df.failed == 0).all(), df.errors.tolist()
    assert (df.output_tokens > 0).all() and (df.out_tok_s > 0).all() and (df.req_tok_s_p50 > 0).all()
    assert (df.tokens_counted_by == 'usage').all()  # transformers serve sends usage on its last chunk
    assert (
        (df.ttft_p50_ms > 0).all()
        and (df.ttft_p50_ms <= df.ttft_p90_ms).all()
        and (df.ttft_p90_ms <= df.seconds * 1000).all()
    )
    assert (df.speedup[df.endpoint == 'baseline'] == 1.0).all()
    sp = df.speedup[df.endpoint == 'speculative']
    assert sp.map(math.isfinite).all() and ((sp > 0.2) & (sp < 5)).all(), sp.tolist()  # the same server: noise around 1
    assert df.accept_len.isna().all() and len(break_even_table(df)) == 0


def test_failures_are_counted_not_raised(toy_server):
    bad = bench_endpoint(toy_server.base_url, 'no-such-model', PROMPTS[:2], concurrency=2, max_tokens=8)
    assert (bad['ok'], bad['failed'], bad['out_tok_s'], bad['output_tokens']) == (0, 2, 0.0, 0)
    assert bad['ttft_p50_ms'] is None and 'no-such-model' in bad['errors'][0], bad['errors']
    url = f'http://127.0.0.1:{free_port()}/v1'  # nobody listens there
    down = bench_endpoint(url, toy_server.model, PROMPTS[:2], concurrency=1, max_tokens=8, timeout=5)
    assert down['failed'] == 2 and 'Connection' in down['errors'][0], down['errors']
    df = serve_bench(url, toy_server.base_url, toy_server.model, PROMPTS[:2], concurrencies=(1,), max_tokens=8)
    assert (
        df.failed.tolist() == [2, 0] and df.speedup.isna().all()
    )  # no baseline throughput: NaN, not ZeroDivisionError


def test_sglang_accept_length(fake_engine):
    srv, url = fake_engine(
        {
            '/get_server_info': dict(
                version='0.5.5',
                internal_states=[
                    dict(last_gen_throughput=80.0, avg_spec_accept_length=2.5),
                    dict(last_gen_throughput=81.0, avg_spec_accept_length=3.0),
                ],
            )
        }
    )
    assert spec_state(url) == dict(engine='sglang', avg_spec_accept_length=2.75)  # mean over data-parallel schedulers
    assert accept_length(url, spec_state(url)) == 2.75  # a since-start average: `before` cannot be subtracted
    srv.routes['/get_server_info'] = dict(
        internal_states=[dict(last_gen_throughput=80.0)]
    )  # SGLang without speculation
    assert accept_length(url) is None
    srv.routes = {'/server_info': dict(internal_states=[dict(avg_spec_accept_length=1.9)])}  # newer SGLang's path
    assert accept_length(url) == 1.9


def test_vllm_accept_length_delta(fake_engine):
    def prom(acc, drafts):
        return ''.join(
            f'# TYPE vllm:spec_decode_num_{n} counter\n'
            f'vllm:spec_decode_num_{n}_total{{engine="0",model_name="m"}} {v * 0.25}\n'
            f'vllm:spec_decode_num_{n}_total{{engine="1",model_name="m"}} {v * 0.75}\n'
            f'vllm:spec_decode_num_{n}_created{{engine="0",model_name="m"}} 1.7e9\n'
            for n, v in (('drafts', drafts), ('accepted_tokens', acc))
        )

    srv, url = fake_engine(
        {'/metrics': prom(100.0, 50.0) + 'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 9\n'}
    )
    before = spec_state(url)
    assert before == dict(engine='vllm', accepted=100.0, drafts=50.0)
    srv.routes['/metrics'] = prom(100.0 + 66.0, 50.0 + 40.0)  # the run: 40 drafts, 66 accepted tokens
    assert accept_length(url, before) == pytest.approx(1 + 66 / 40)
    assert accept_length(url) == pytest.approx(1 + 166 / 90)  # without `before`: since the server started
    assert accept_length(url, spec_state(url)) is None  # no drafts in the window: unknown
    srv.routes['/metrics'] = 'vllm:num_requests_running{model_name="m"} 0.0\n'  # vLLM without speculation
    assert spec_state(url) is None and accept_length(url) is None


def test_break_even_worked_example():
    b = break_even(**WORKED_EXAMPLE)  # 90 tok/s baseline, 82.3 tok/s speculative at accept length 2.1
    assert round(b['cost'], 3) == 2.296 and round(b['break_even_accept_len'], 3) == 2.296  # 2.1 * 90 / 82.3 = 2.29648
    assert round(b['speedup'], 3) == 0.914
    assert 2.1 / b['cost'] == pytest.approx(b['speedup'])  # speedup(a) = a / c passes through the measurement
    with pytest.raises(ValueError, match='positive tok/s'):
        break_even(90, 0, 2.1)
    with pytest.raises(ValueError, match='accept length'):
        break_even(90, 82.3, None)


def test_cli_writes_record(toy_server, tmp_path):
    (tmp_path / 'prompts.json').write_text(json.dumps(['Say hi.', [dict(role='user', content='Say bye.')]]))
    out = tmp_path / 'bench' / 'serve_bench.json'
    df = serve_bench_cli(
        toy_server.base_url,
        toy_server.base_url,
        prompts=str(tmp_path / 'prompts.json'),
        concurrency='1,2',
        max_tokens=4,
        out=str(out),
    )
    rec = json.loads(out.read_text())
    assert len(df) == 4 and len(rec['rows']) == 4 and rec['model'] == toy_server.model and rec['break_even'] == []
    assert all(r['ok'] == 2 for r in rec['rows']) and (out.parent / 'break_even.png').stat().st_size > 0
    with pytest.raises(ValueError, match='--prompts'):
        serve_bench_cli(toy_server.base_url, toy_server.base_url)


def test_cli_prints_launch_commands_first(toy_server, tmp_path, capsys):
    "`eagle3nb serve-bench --draft DIR` says how to launch the speculative server before it benches"
    from eagle3nb.cli import main

    (tmp_path / 'prompts.json').write_text(json.dumps(['Say hi.']))
    main(
        [
            'serve-bench',
            '--baseline',
            toy_server.base_url,
            '--speculative',
            toy_server.base_url,
            '--prompts',
            str(tmp_path / 'prompts.json'),
            '--concurrency',
            '1',
            '--max-tokens',
            '4',
            '--draft',
            str(tmp_path / 'draft'),
            '--target',
            '/models/T',
            '--tp',
            '8',
        ]
    )
    out = capsys.readouterr().out
    assert out.index('# sglang') < out.index('# vllm') < out.index('out_tok_s')  # the commands, then the table
    spec = f'--speculative-algorithm EAGLE3 --speculative-draft-model-path {tmp_path / "draft"}'
    assert '--model-path /models/T ' in out and spec in out and '--tp 8' in out, out


def test_eval_prompts(tmp_path):
    r = smoke_recipe(tmp_path, Path(__file__).parent / 'fixtures' / 'datasets')
    pre = eval_prompts(r, n=3)  # no corpus yet: the prepared conversations
    assert len(pre) == 3 and all(p[-1]['role'] == 'user' for p in pre)
    merge_recipe(r, eval_fraction=0.2)
    ev = load_corpus(Path(r.data_root) / 'corpus', 'eval')
    ps = eval_prompts(r.data_root, n=16)
    assert 0 < len(ps) == len(ev)
    for p in ps:  # what any chat API accepts: text turns only, ending with the user
        assert p[-1]['role'] == 'user' and all(
            set(m) == {'role', 'content'} and m['role'] in ('system', 'user', 'assistant') and m['content'] for m in p
        )


class _Clock:
    "The bench's clock, moved only by the fake engines' steps: its seconds are theirs, whatever the machine's load"

    def __init__(self):
        self.t, self.lock = 0.0, threading.Lock()

    def __call__(self) -> float:
        with self.lock:
            return self.t

    def advance(self, s: float):
        with self.lock:
            self.t += s


class _Engine(http.server.BaseHTTPRequestHandler):
    "A streaming chat server: `tokens_per_step` tokens a step of `step_s` (clock) seconds; spec counters on /metrics"

    protocol_version = 'HTTP/1.1'

    def do_GET(self):
        if self.path != '/metrics' or self.server.tokens_per_step == 1:
            return self.send_error(404)
        with self.server.lock:
            d, a = self.server.drafts, self.server.accepted
        b = (
            f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {d}\n'
            f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {a}\n'
        ).encode()
        self.send_response(200)
        self.send_header('Content-Length', str(len(b)))
        self.end_headers()
        self.wfile.write(b)

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers['Content-Length'])))
        n, k = req.get('max_tokens') or 8, self.server.tokens_per_step
        self.send_response(200)
        self.send_header('Content-Type', 'text/event-stream')
        self.send_header('Connection', 'close')
        self.end_headers()
        chunk = lambda **kw: self.wfile.write(
            b'data: '
            + json.dumps(dict(id='c', object='chat.completion.chunk', created=0, model=req['model'], **kw)).encode()
            + b'\n\n'
        )
        sent = 0
        while sent < n:
            self.server.clock.advance(self.server.step_s)  # the step's time passes on the bench's clock, not the wall
            m = min(k, n - sent)
            sent += m
            for _ in range(m):
                chunk(choices=[dict(index=0, delta=dict(content='tok '), finish_reason=None)])
            self.wfile.flush()
            if k > 1:
                with self.server.lock:
                    self.server.drafts += 1
                    self.server.accepted += k - 1  # k - 1 accepted + the bonus token
        chunk(choices=[dict(index=0, delta={}, finish_reason='length')])
        chunk(choices=[], usage=dict(prompt_tokens=5, completion_tokens=n, total_tokens=n + 5))
        self.wfile.write(b'data: [DONE]\n\n')
        self.wfile.flush()

    def log_message(self, *a):
        pass


@pytest.fixture
def engines(monkeypatch):
    "A baseline engine (1 token a 10 ms step) and a speculative one (2 tokens a 12 ms step: accept length 2, 20% draft"
    "overhead), on a clock only their steps move"
    clock, srvs = _Clock(), []
    monkeypatch.setattr(servebench, 'time', SimpleNamespace(perf_counter=clock))  # the bench times on this clock
    for k, s in ((1, 0.010), (2, 0.012)):
        srv = http.server.ThreadingHTTPServer(('127.0.0.1', 0), _Engine)
        srv.tokens_per_step, srv.step_s, srv.drafts, srv.accepted, srv.lock = k, s, 0, 0, threading.Lock()
        srv.clock = clock
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        srvs.append(srv)
    yield [f'http://127.0.0.1:{s.server_port}/v1' for s in srvs]
    for s in srvs:
        s.shutdown()
        s.server_close()


def test_speculative_engine_end_to_end(engines):
    "A speculative endpoint that reports its counters: accept length, speedup and break-even come out of one serve_bench"
    base, spec = engines
    df = serve_bench(base, spec, 'm', PROMPTS, concurrencies=(1, 2), max_tokens=12)
    assert (df.ok == len(PROMPTS)).all() and (df.tokens_counted_by == 'usage').all()
    assert df.accept_len[df.endpoint == 'baseline'].isna().all()
    assert (df.accept_len[df.endpoint == 'speculative'] == 2.0).all()  # 1 + accepted / drafts over each run's window
    # 12 tokens a request: baseline 12 steps of 10 ms, speculative 6 of 12 ms; the same at every concurrency, since the
    # clock adds every step of every request in flight
    base_tok_s, spec_tok_s = 12 / (12 * 0.010), 12 / (6 * 0.012)  # 100 and 166.7 tok/s
    assert df.out_tok_s[df.endpoint == 'baseline'].tolist() == pytest.approx([base_tok_s] * 2)
    assert df.out_tok_s[df.endpoint == 'speculative'].tolist() == pytest.approx([spec_tok_s] * 2)
    sp = df.speedup[df.endpoint == 'speculative']
    assert sp.tolist() == pytest.approx([2 / 1.2] * 2)  # 2 tokens a step that costs 1.2 baseline steps
    be = break_even_table(df)
    assert list(be.concurrency) == [1, 2]
    for r in be.itertuples():  # the draft pays above a = c = accept_len x base / spec: the step's cost, 1.2
        assert r.cost == pytest.approx(r.accept_len * r.base_tok_s / r.spec_tok_s) and r.break_even_accept_len == r.cost
        assert r.speedup == pytest.approx(r.spec_tok_s / r.base_tok_s) and r.cost == pytest.approx(1.2)
