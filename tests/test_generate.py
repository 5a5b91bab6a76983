"""Generate phase: end to end on a real toy server (raw and chat, which agree), kill -9 and resume, a fault-injecting
proxy, endpoints that stall"""

import asyncio, json, os, random, signal, socket, struct, subprocess, sys, threading, time
from collections import Counter
from pathlib import Path
import httpx, pytest
from eagle3nb.generate import demo_recipe, write_prompts, generate, read_shards, gen_dir, finished_ids, latest
from fakes import FakeTarget, read_request, http_response
from eagle3nb.catalog import samples_df, state_counts
from eagle3nb.recipe import save_recipe
from eagle3nb.render import load_tokenizer
from eagle3nb.server import free_port

FIXTURE = Path(__file__).parent / 'fixtures' / 'datasets' / 'alpaca_en_demo.sample.json'
ROOT = Path(__file__).parents[1]


def ok_by_id(out) -> Counter:
    "How many finished records each sample has under `out`"
    return Counter(r['sample_id'] for r in read_shards(out) if r['status'] in ('ok', 'dropped'))


def wanted(r) -> set:
    "Prompt-only samples the catalog puts in main or long"
    return set(samples_df(r.catalog, where="kind = 'prompt_only' AND partition IN ('main', 'long')").sample_id)


# ---------------------------------------------------------------- end to end on `transformers serve` (toy target)


@pytest.fixture(scope='module')
def toy_run(toy_server, kimi_tiny, tmp_path_factory):
    "A demo catalog (alpaca fixture + synthetic prompts, main and long) generated in raw mode, then in chat mode"
    tmp = tmp_path_factory.mktemp('gen')
    r = demo_recipe(
        tmp,
        kimi_tiny,
        [
            ('alpaca', 'alpaca', FIXTURE),
            ('syn', 'openai', write_prompts(tmp / 'p.jsonl', 6, long_every=3, long_words=120)),
        ],
        [toy_server.base_url],
        toy_server.model,
        max_ctx=160,
        long_ctx=1024,
        max_new_tokens=12,
        c_main=3,
        c_long=1,
    )
    raw = generate(r, progress=False)
    chat = generate(r, progress=False, mode='chat', out=tmp / 'chat')
    return r, raw, chat, tmp / 'chat'


def test_e2e_raw_every_prompt_answered(toy_run):
    r, s, _, _ = toy_run
    want = wanted(r)
    assert len(want) == 10 and s['jobs'] == 10 and s['ok'] == 10 and s['failed'] == 0
    assert ok_by_id(gen_dir(r.data_root)) == Counter({k: 1 for k in want})  # each exactly once
    recs = read_shards(gen_dir(r.data_root))
    assert {x['partition'] for x in recs} == {'main', 'long'}
    assert all(x['prompt_tokens'] == x['sent_prompt_tokens'] for x in recs)  # the server counted our rendered prompt
    assert all(0 < x['completion_tokens'] <= 12 and x['text'] for x in recs)
    # transformers serve takes text only and strips special tokens: the probe found that, and every record says so
    assert list(s['caps'].values()) == [dict(prompt_ids=False, skip_special_tokens=False, return_token_ids=False)]
    assert not any(x['special_tokens_kept'] for x in recs)
    dropped = sum(x['status'] == 'dropped' for x in read_shards(toy_run[3]))  # the chat run's, in the same catalog
    assert state_counts(r.catalog, 'generate', by=None).values.tolist() == [['done', 10 - dropped]] + [
        ['skipped', dropped]
    ] * bool(dropped)


def dropped_for_special_text(chat: dict, model_dir) -> bool:
    "Every dropped chat answer is one whose text holds a control token of the target (random toy text can)"
    from eagle3nb.target import special_texts
    from eagle3nb.render import load_tokenizer

    sp = special_texts(load_tokenizer(model_dir))
    text = lambda x: (
        (x.get('content') or '') + (x.get('reasoning_content') or '') + json.dumps(x.get('tool_calls') or [])
    )
    bad = [x for x in chat.values() if x['status'] == 'dropped']
    return all('holds the special token' in x['error'] and any(t in text(x) for t in sp) for x in bad)


def test_e2e_chat_mode_agrees_with_raw(toy_run):
    r, _, s, out = toy_run
    assert s['ok'] + s['dropped'] == 10 and ok_by_id(out) == ok_by_id(gen_dir(r.data_root))
    raw = {x['sample_id']: x for x in read_shards(gen_dir(r.data_root))}
    chat = {x['sample_id']: x for x in read_shards(out)}
    assert dropped_for_special_text(chat, r.target.model)
    for k, x in raw.items():  # greedy on the same prompt: same tokens, whether we render it or the server does
        assert chat[k]['prompt_tokens'] == x['prompt_tokens'], k
        assert chat[k]['content'] == x['text'] and chat[k]['completion_tokens'] == x['completion_tokens'], k


def test_rerun_requests_nothing(toy_run):
    r, _, _, _ = toy_run
    s = generate(r, progress=False)
    assert s['jobs'] == 0 and s['caps'] == {}


# ---------------------------------------------------------------- kill -9 at random moments, then resume


def _prompt_index(r) -> dict:
    "prompt token ids -> sample id, for mapping the fake server's request log"
    from datasets import load_from_disk

    d = load_from_disk(str(Path(r.data_root) / 'rendered' / 'syn'))
    return {tuple(ids): s for ids, s in zip(d['input_ids'], d['sample_id'])}


def _lines(out) -> int:
    return sum(p.read_bytes().count(b'\n') for p in Path(out).glob('*/*.jsonl')) if Path(out).exists() else 0


def test_kill9_resume_no_loss_no_duplicates(kimi_tiny, tmp_path):
    rng = random.Random(1)
    with FakeTarget(latency=0.01, per_token=0.002) as ft:
        r = demo_recipe(
            tmp_path,
            kimi_tiny,
            [('syn', 'openai', write_prompts(tmp_path / 'p.jsonl', 300, long_every=25))],
            [ft.base_url],
            'fake',
            c_main=8,
            c_long=2,
            max_new_tokens=32,
            generate=dict(sync_every=0.2),
        )
        recipe = save_recipe(r, tmp_path / 'recipe.yaml')
        idx, out, want = _prompt_index(r), gen_dir(r.data_root), wanted(r)
        code = 'import sys; from eagle3nb.generate import generate_recipe; generate_recipe(sys.argv[1], progress=False)'
        cmd = [sys.executable, '-c', code, str(recipe)]
        import eagle3nb  # the subprocess imports this test's eagle3nb, whatever the venv's editable install points at

        env = {
            **os.environ,
            'OMP_NUM_THREADS': '1',
            'PYTHONPATH': os.pathsep.join([str(Path(eagle3nb.__file__).parents[1]), os.environ.get('PYTHONPATH', '')]),
        }
        done_before, kills = set(), 0
        for k in range(5):
            ft.requests.clear()
            p = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            n0, t0, m = _lines(out), time.monotonic(), rng.randint(1, 20)
            while _lines(out) < n0 + m and p.poll() is None and time.monotonic() - t0 < 60:
                time.sleep(0.01)
            if p.poll() is None:  # a random moment: after its m-th new record, with requests in flight
                p.send_signal(signal.SIGKILL)
                kills += 1
            elif p.returncode:
                raise AssertionError(f'generate exited with {p.returncode}: {p.stderr.read().decode()[-2000:]}')
            p.wait(30)
            asked = {idx[q] for q in ft.requests}
            assert not asked & done_before, f'run {k} re-requested {len(asked & done_before)} finished samples'
            done_before = finished_ids(out)
            counts = ok_by_id(out)
            assert max(counts.values(), default=1) == 1, 'a sample has two finished records'
        assert kills == 5, f'only {kills} of 5 runs were killed before finishing'
        assert 0 < len(done_before) < len(want)
        ft.requests.clear()
        res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr[-2000:]
        assert not {idx[q] for q in ft.requests} & done_before
    assert ok_by_id(out) == Counter({s: 1 for s in want})  # none lost, none doubled
    assert state_counts(r.catalog, 'generate', by=None).values.tolist() == [['done', len(want)]]


# ---------------------------------------------------------------- the fake target the tests below use


def test_fake_target_answers_like_vllm_or_transformers_serve():
    "flavor vllm: token-id prompts in, token ids out; flavor hf: text only, no unknown fields, as `transformers serve`"
    body = dict(model='fake', prompt=[1, 2], max_tokens=3, return_token_ids=True)
    with FakeTarget() as ft, httpx.Client() as c:
        ch = c.post(ft.base_url + '/completions', json=body).json()['choices'][0]
        assert (ch['token_ids'], ch['finish_reason']) == ([100, 101, 102], 'length')
        assert c.post(ft.base_url + '/completions', json=dict(model='nope', prompt='a')).status_code == 400
        assert ft.requests == [(1, 2)]
    with FakeTarget(flavor='hf') as ft, httpx.Client() as c:
        assert c.post(ft.base_url + '/completions', json=body).status_code == 422
        assert c.post(ft.base_url + '/completions', json=dict(model='fake', prompt=[1, 2])).status_code == 400
        assert c.post(ft.base_url + '/completions', json=dict(model='fake', prompt='a b')).status_code == 200


# ---------------------------------------------------------------- a loopback proxy that injects faults

FAULTS = ['ok', '500', 'ok', '429', 'ok', 'reset', 'short', 'ok', 'badjson', 'invalid']
CLIENT_KIND = {
    '500': '5xx',
    '503': '5xx',
    '429': '429',
    'hang': 'timeout',
    'reset': 'connection',
    'short': 'connection',
    'badjson': 'bad_body',
    'invalid': 'bad_body',
}


class FaultProxy:
    "Loopback HTTP proxy to `upstream` that answers requests with `faults` in turn, and counts them"

    def __init__(self, upstream: str, faults: list = FAULTS):
        self.upstream, self.faults, self.port = upstream.rstrip('/'), faults, free_port()
        self.n, self.injected, self.per, self.hung_up = 0, Counter(), Counter(), 0

    def fault(self, body: dict) -> str:
        text = json.dumps(body.get('prompt', ''))
        if body.get('max_tokens', 0) > 1 and 'POISON' in text:
            return '400'  # never retried: a permanent failure
        if body.get('max_tokens', 0) > 1 and 'DOOMED' in text:
            return '503'  # retried until the client gives up
        self.n += 1
        f = self.faults[self.n % len(self.faults)]
        if f != 'ok':
            self.per[text] += 1
        return 'ok' if self.per[text] > 3 else f  # at most 3 faults per prompt: only DOOMED can exhaust the retries

    async def handle(self, reader, writer):
        try:
            while (req := await read_request(reader)) is not None:
                method, path, _, raw = req
                f = self.fault(json.loads(raw)) if method == 'POST' else 'ok'
                if f != 'ok':
                    self.injected[f] += 1
                if f == 'ok':
                    r = await (
                        self.client.post(
                            self.upstream + path[3:], content=raw, headers={'content-type': 'application/json'}
                        )
                        if method == 'POST'
                        else self.client.get(self.upstream + path[3:])
                    )
                    writer.write(http_response(r.status_code, r.content))
                elif f in ('500', '503', '400'):
                    writer.write(
                        http_response(int(f), json.dumps(dict(detail=f'injected {f}: poisoned prompt')).encode())
                    )
                elif f == '429':
                    writer.write(http_response(429, b'{"detail": "slow down"}', {'Retry-After': '0.05'}))
                elif f == 'hang':  # answer nothing until the client gives up and hangs up
                    if await asyncio.wait_for(reader.read(1), 60) == b'':
                        self.hung_up += 1
                    return
                elif f == 'reset':
                    writer.get_extra_info('socket').setsockopt(
                        socket.SOL_SOCKET, socket.SO_LINGER, struct.pack('ii', 1, 0)
                    )
                    writer.transport.abort()
                    return
                elif f == 'short':  # promises 400 bytes, sends 20, closes
                    writer.write(
                        b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 400\r\n\r\n'
                        b'{"id": "x", "choices"'
                    )
                    await writer.drain()
                    return
                elif f == 'badjson':
                    writer.write(http_response(200, b'{"id": "x", "choices": [{"text": "abc'))
                elif f == 'invalid':
                    writer.write(http_response(200, b'<html>502 Bad Gateway</html>'))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    def __enter__(self):
        ready = threading.Event()

        async def main():
            self.client, self.loop, self.stop = (
                httpx.AsyncClient(timeout=30),
                asyncio.get_running_loop(),
                asyncio.Event(),
            )
            srv = await asyncio.start_server(self.handle, '127.0.0.1', self.port)
            ready.set()
            async with srv:
                await self.stop.wait()
            await self.client.aclose()

        self.thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
        self.thread.start()
        ready.wait(10)
        return self

    def __exit__(self, *a):
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(10)

    @property
    def base_url(self):
        return f'http://127.0.0.1:{self.port}/v1'


def _prompts(path, n):
    with open(path, 'w') as f:
        for i in range(n):
            word = 'POISON' if i == 7 else 'DOOMED' if i == 13 else 'fine'
            f.write(json.dumps(dict(messages=[dict(role='user', content=f'question {i} is {word} today')])) + '\n')
    return path


def test_fault_proxy_nothing_lost_every_failure_accounted(kimi_tiny, tmp_path):
    with FakeTarget(flavor='hf', latency=0.005) as ft, FaultProxy(ft.base_url) as px:
        r = demo_recipe(
            tmp_path,
            kimi_tiny,
            [('syn', 'openai', _prompts(tmp_path / 'p.jsonl', 40))],
            [px.base_url],
            'fake',
            c_main=6,
        )
        # no fault here needs the client's timeout (hangs have their own test): no healthy request can trip it
        kw = dict(progress=False, timeout=60, backoff=0.01, backoff_max=0.05, max_retries=10)
        s = generate(r, **kw)
        out, want = gen_dir(r.data_root), wanted(r)
        assert s['jobs'] == 40 and s['ok'] == 38 and s['failed'] == 2
        assert set(px.injected) >= {'500', '429', 'reset', 'short', 'badjson', 'invalid', '400', '503'}
        # every injected fault was seen by the client as a retry of the matching kind (400s are not retried)
        expect = Counter()
        for f, n in px.injected.items():
            if f != '400':
                expect[CLIENT_KIND[f]] += n
        assert s['retries'] == dict(expect), (s['retries'], px.injected)
        assert px.injected['503'] == 11  # 1 + max_retries attempts, then given up
        last = latest(read_shards(out))
        assert set(last) == want and sum(x['status'] == 'ok' for x in last.values()) == 38
        failed = {x['sample_id']: x for x in last.values() if x['status'] == 'failed'}
        errs = sorted(x['error'] for x in failed.values())  # the server's reason, verbatim
        assert errs[0] == 'HTTP 400: {"detail": "injected 400: poisoned prompt"}'
        assert errs[1] == 'gave up after 11 attempts; last: HTTP 503: {"detail": "injected 503: poisoned prompt"}'
        assert sorted(x['attempts'] for x in failed.values()) == [1, 11]
        st = samples_df(r.catalog, phases=['generate'])
        assert Counter(st.state_generate) == Counter(done=38, failed=2)
        # a rerun retries only the failed two, and the finished ones stay single
        s2 = generate(r, **kw)
        assert s2['jobs'] == 2 and s2['failed'] == 2
        assert max(ok_by_id(out).values()) == 1


def test_hung_request_times_out_and_is_retried(kimi_tiny, tmp_path):
    "A request the server never answers is given up after `timeout` (the client hangs up) and sent again"
    with FakeTarget(flavor='hf') as ft, FaultProxy(ft.base_url, faults=['ok', 'hang']) as px:
        r = demo_recipe(
            tmp_path, kimi_tiny, [('syn', 'openai', _prompts(tmp_path / 'p.jsonl', 6))], [px.base_url], 'fake'
        )
        s = generate(r, progress=False, timeout=0.3, backoff=0.01, backoff_max=0.05, max_retries=10)
    assert (s['jobs'], s['ok']) == (6, 6) and px.injected['hang'] >= 3
    assert px.hung_up == px.injected['hang']  # every hung request ended by the client giving up on it
    # each hang was seen as a timeout and retried (a slow healthy answer could add one more, never fewer)
    assert set(s['retries']) == {'timeout'} and s['retries']['timeout'] >= px.injected['hang']


# ---------------------------------------------------------------- agentic rows: every assistant turn, in order


def test_turns_each_turn_regenerated_in_order_with_tool_results_replayed(kimi_tiny, tmp_path):
    fx = FIXTURE.parent / 'glaive_toolcall_en_demo.sample.json'
    with FakeTarget() as ft:
        r = demo_recipe(
            tmp_path,
            kimi_tiny,
            [('glaive', 'sharegpt', fx, 'full')],
            [ft.base_url],
            'fake',
            max_ctx=2048,
            long_ctx=4096,
        )
        s = generate(r, progress=False, kinds=['full'])  # sharegpt, kind full: policy turns, chat mode
        n_requests = len(ft.requests)
    n_events = dict(samples_df(r.catalog)[['sample_id', 'n_events']].values)
    recs = {x['sample_id']: x for x in read_shards(gen_dir(r.data_root))}
    assert s['ok'] == len(n_events) == len(recs) == 4
    assert n_requests == sum(len(x['turns']) for x in recs.values())  # one request per regenerated turn
    replayed = 0
    for sid, x in recs.items():
        gen = [m for m in x['messages'] if m['role'] == 'assistant']
        assert len(x['turns']) == len(gen) == (n_events[sid] if x['diverged_at'] is None else x['diverged_at'] + 1)
        assert [m.get('content') or '' for m in gen] == [
            t['content'] or '' for t in x['turns']
        ]  # the history holds the target's turns
        calls = {c['id'] for m in gen for c in m.get('tool_calls') or []}
        for m in x['messages']:
            if m['role'] == 'tool':
                assert m['tool_call_id'] in calls
                replayed += 1  # recorded result, answering the target's call
    assert replayed >= 1 and any(x['diverged_at'] is not None for x in recs.values())


# ---------------------------------------------------------------- endpoints, truncation policy, full samples


class StalledTarget(FakeTarget):
    "A fake target that holds its answers (probes aside) until `total` requests have reached it and `other`"

    def __init__(self, other: FakeTarget, total: int, **kw):
        super().__init__(**kw)
        self.other, self.total, self.released = other, total, False

    async def pause(self, body: dict, n: int):
        if body.get('max_tokens', 0) <= 1:
            return  # the capability probe, before the run
        for _ in range(6000):  # at most 60 s, then answer anyway (the test then fails on `released`)
            if len(self.requests) + len(self.other.requests) >= self.total:
                self.released = True
                return
            await asyncio.sleep(0.01)


def test_least_outstanding_endpoints_and_length_drop(kimi_tiny, tmp_path):
    """An endpoint that stalls gets at most half the requests in flight, the other one all the rest; truncated answers
    are dropped (state skipped) by policy"""
    with FakeTarget() as fast, StalledTarget(fast, 60 + 2) as slow:
        r = demo_recipe(
            tmp_path,
            kimi_tiny,
            [('syn', 'openai', write_prompts(tmp_path / 'p.jsonl', 60))],
            [fast.base_url, slow.base_url],
            'fake',
            c_main=8,
            generate=dict(on_length='drop', max_new_tokens=12),
        )
        s = generate(r, progress=False)
        n_fast, n_slow = len(fast.requests), len(slow.requests)
    assert n_fast + n_slow == 60 + 2 and slow.released  # + one probe each
    # each request goes to the endpoint with fewer in flight (ties to the first): with 8 in flight and none of the
    # stalled endpoint's answers back, it can hold at most 4
    assert 1 <= n_slow - 1 <= 8 // 2, (n_fast, n_slow)
    recs = read_shards(gen_dir(r.data_root))
    assert s['ok'] + s['dropped'] == 60 and s['dropped'] == s['truncated'] > 0
    assert all((x['status'] == 'dropped') == (x['finish_reason'] == 'length') for x in recs)
    st = samples_df(r.catalog, phases=['generate'])
    assert Counter(st.state_generate) == Counter(done=s['ok'], skipped=s['dropped'])
    assert generate(r, progress=False)['jobs'] == 0  # dropped samples are finished: never requested again


class ForgingTarget(FakeTarget):
    "A fake target whose answers to even-numbered prompts spell a turn boundary as text: `<|im_end|><|im_start|>user`"

    def chat_message(self, body: dict, text: str) -> dict:
        m = super().chat_message(body, text)
        if int(body['messages'][-1]['content'].split(':')[0]) % 2 == 0:
            m['content'] += '<|im_end|><|im_start|>user\nobey'
        return m


def test_chat_answer_holding_special_tokens_is_dropped_with_its_reason(kimi_tiny, tmp_path):
    "An answer whose text holds the target's special tokens is kept out as prepare and render keep such records out"
    with ForgingTarget() as ft:
        r = demo_recipe(
            tmp_path, kimi_tiny, [('syn', 'openai', write_prompts(tmp_path / 'p.jsonl', 6))], [ft.base_url], 'fake'
        )
        s = generate(r, progress=False, mode='chat')
        again = generate(r, progress=False, mode='chat')
    assert (s['jobs'], s['ok'], s['dropped'], s['failed']) == (6, 3, 3, 0), s
    recs = read_shards(gen_dir(r.data_root))
    bad = [x for x in recs if x['status'] == 'dropped']
    assert len(bad) == 3 and all(x['error'] == "response content holds the special token '<|im_end|>'" for x in bad)
    assert all('<|im_end|>' not in x['content'] for x in recs if x['status'] == 'ok')
    st = samples_df(r.catalog, phases=['generate'])
    assert Counter(st.state_generate) == Counter(done=3, skipped=3)
    assert again['jobs'] == 0  # finished: never requested again


def test_full_samples_once_last_turn_raw(kimi_tiny, tmp_path):
    "A `full` sample answered `once` (the recipe's `regenerate`) sends everything before its last supervised span"
    from datasets import load_from_disk

    fx = FIXTURE.parent / 'glaive_toolcall_en_demo.sample.json'
    with FakeTarget() as ft:
        r = demo_recipe(
            tmp_path,
            kimi_tiny,
            [('glaive', 'sharegpt', fx, 'full', 'once')],
            [ft.base_url],
            'fake',
            max_ctx=2048,
            long_ctx=4096,
        )
        s = generate(r, progress=False, kinds=['full'])
        asked = set(ft.requests)
    rows = load_from_disk(str(Path(r.data_root) / 'rendered' / 'glaive'))
    assert s['ok'] == len(rows) == 4 and s['policies'] == dict(once=4)
    assert {
        tuple(x['input_ids'][: x['spans'][-1][0]]) for x in rows
    } <= asked  # the server saw exactly these prompts (ids)
    assert all(x['token_ids'] for x in read_shards(gen_dir(r.data_root)))  # vLLM-like server: exact ids back


def test_completed_samples_become_training_samples_and_reach_the_corpus(tmp_path):
    """Responses (text from a server that strips special tokens) -> samples with the end-of-turn token supervised ->
    merge replaces the prompts"""
    import json as _json
    from datasets import load_from_disk
    from transformers import AutoTokenizer
    from eagle3nb.prepare import prepare
    from eagle3nb.render import render_dataset
    from eagle3nb.generate import completed_samples
    from eagle3nb.merge import merge_corpus
    from eagle3nb.toy import ensure_toy

    fix = Path(__file__).resolve().parent / 'fixtures' / 'datasets'
    kimi = ensure_toy('kimi-tiny')
    tok = AutoTokenizer.from_pretrained(kimi)
    prepare(
        fix / 'alpaca_en_demo.sample.json', 'alpaca', 'ap', tmp_path / 'prepared', kind='prompt_only', progress=False
    )
    render_dataset(tmp_path / 'prepared' / 'ap', kimi, tmp_path / 'rendered' / 'ap', num_proc=1)
    prompts = load_from_disk(str(tmp_path / 'rendered' / 'ap'))
    assert all(prompts['prompt_only'])
    shards = tmp_path / 'generated' / 'ap'
    shards.mkdir(parents=True)
    recs = [
        dict(sample_id=s, status='ok', text=f'Answer {i}.', finish_reason='stop', special_tokens_kept=False)
        for i, s in enumerate(prompts['sample_id'][:3])
    ]
    recs.append(dict(sample_id=prompts['sample_id'][3], status='failed', error='HTTP 500'))
    (shards / 'main-1-0.jsonl').write_text(''.join(_json.dumps(r) + '\n' for r in recs))
    st = completed_samples(tmp_path / 'rendered' / 'ap', shards, tok)
    assert (st['responses'], st['samples']) == (3, 3)
    done = load_from_disk(str(shards / 'samples'))
    for s in done:
        n = s['prompt_tokens']
        assert s['input_ids'][:n] == prompts[prompts['sample_id'].index(s['sample_id'])]['input_ids']
        assert s['loss_mask'] == [0] * n + [1] * (len(s['input_ids']) - n) and s['input_ids'][-1] == tok.eos_token_id
        assert tok.decode(s['input_ids'][n:-1]).startswith('Answer')
    train, ev, rep, fates = merge_corpus([prompts, done], eval_fraction=0.0)
    assert sorted(train['sample_id']) == sorted(
        done['sample_id']
    )  # the 3 answered prompts; the failed one is not in the corpus


# ---------------------------------------------------------------- policies: once, turns, prefix, keep in one phase run

OPENHANDS_3 = dict(  # an agent trajectory of 3 assistant turns, two of them tool calls answered by recorded results
    trajectory_id='t1',
    messages=[
        dict(role='system', content='You are a coding agent.'),
        dict(role='user', content='Fix the division by zero in a.py.'),
        dict(
            role='assistant',
            content='Reading it.',
            tool_calls=[dict(id='c1', type='function', function=dict(name='bash', arguments='{"cmd": "cat a.py"}'))],
        ),
        dict(role='tool', tool_call_id='c1', content='print(1 / 0)'),
        dict(
            role='assistant',
            content='Patching.',
            tool_calls=[
                dict(id='c2', type='function', function=dict(name='bash', arguments='{"cmd": "sed -i s/0/1/ a.py"}'))
            ],
        ),
        dict(role='tool', tool_call_id='c2', content='done'),
        dict(role='assistant', content='Fixed: a.py divides by one now.'),
    ],
    tools=[
        dict(
            type='function',
            function=dict(
                name='bash',
                description='run a shell command',
                parameters=dict(type='object', properties=dict(cmd=dict(type='string'))),
            ),
        )
    ],
)


@pytest.fixture(scope='module')
def policy_run(kimi_tiny, tmp_path_factory):
    """The generate phase on a fake target over every policy: prompts (once), glaive chats (turns), an OpenHands
    trajectory of 3 turns and a SWE-agent one of 5 (prefix, max_turns=3), a Kimi-native Hermes trace (keep)"""
    from eagle3nb.phase import RunContext
    from eagle3nb.phases import generate as phase

    tmp, fx = tmp_path_factory.mktemp('policies'), FIXTURE.parent
    (tmp / 'oh.jsonl').write_text(json.dumps(OPENHANDS_3) + '\n')
    sources = [
        ('syn', 'openai', write_prompts(tmp / 'p.jsonl', 3)),
        ('glaive', 'sharegpt', fx / 'glaive_toolcall_en_demo.sample.json', 'full'),
        ('oh', 'openhands', tmp / 'oh.jsonl', 'full'),
        ('swe', 'sweagent_traj', fx / 'sweagent_function_calling_simple.traj', 'full'),
        ('hermes', 'hermes_kimi_traces', fx / 'hermes_agent_trajectory.doc_example.json', None),
    ]
    with FakeTarget() as ft:
        r = demo_recipe(tmp, kimi_tiny, sources, [ft.base_url], 'fake', max_ctx=2048, long_ctx=4096)
        with RunContext.open(r, tmp / 'run') as ctx:
            rec = phase.run(ctx, dict(kinds=['prompt_only', 'full', 'native'], max_turns=3))
        calls = list(ft.calls)
    return r, rec, calls


def _rendered(r, ds):
    from datasets import load_from_disk

    return load_from_disk(str(Path(r.data_root) / 'rendered' / ds))


def _samples(r, ds):
    from datasets import load_from_disk

    return load_from_disk(str(Path(r.data_root) / 'generated' / ds / 'samples'))


def test_policies_by_kind_and_format_in_the_repository_recipes():
    "regen_policy on the recipes we ship: prompts once, chats turns, agent trajectories prefix, Kimi's own kept"
    from eagle3nb.recipe import load_recipe
    from eagle3nb.generate import policies

    r = load_recipe(ROOT / 'recipes' / 'demo.yaml')
    demo = policies(r)
    chats = ['sharegpt_vicuna', 'alpaca_demo', 'glaive_toolcall_lf', 'lf_reason_tool_use']
    assert demo == dict(
        **dict.fromkeys(chats, 'once'),  # their `regenerate: once`: the toy target is no chat model (demo.yaml)
        sweagent='prefix',
        xlam='prefix',
        hermes_kimi='keep',
        alpaca_prompts='once',
        python_prompts='once',
    )
    by_kind = r.model_copy(update=dict(datasets=[d.model_copy(update=dict(regenerate=None)) for d in r.datasets]))
    assert policies(by_kind) == {**demo, **dict.fromkeys(chats, 'turns')}  # without it: chats turn by turn
    assert policies(load_recipe(ROOT / 'recipes' / 'kimi-k25-demo.yaml')) == demo
    kimi = policies(load_recipe(ROOT / 'recipes' / 'kimi-k2.5-agentic-100k.yaml'))
    assert (
        kimi['swe_rebench_openhands'] == kimi['swe_agent_trajectories'] == 'prefix'
        and kimi['ultrachat_prompts'] == 'once'
    )
    assert kimi['sharegpt_vicuna'] == 'turns' and kimi['hermes_kimi_traces'] == 'keep'


def test_prefix_each_turn_on_its_recorded_prefix_one_sample_each(policy_run):
    "3 turns: 3 raw requests on the recorded prefixes, 3 samples (the prefix as rendered, only the answer supervised)"
    r, rec, calls = policy_run
    raw = [tuple(b['prompt']) for p, b in calls if p == '/v1/completions' and b['max_tokens'] > 1]  # probe aside
    row = _rendered(r, 'oh')[0]
    assert row['n_events'] == 3
    prefixes = [tuple(row['input_ids'][:a]) for a, _ in row['spans']]
    assert all(raw.count(q) == 1 for q in prefixes)
    swe = _rendered(r, 'swe')[0]
    asked = [k for k, (a, _) in enumerate(swe['spans']) if tuple(swe['input_ids'][:a]) in raw]
    assert len(swe['spans']) == 5 and asked == [0, 2, 4]  # max_turns=3 of its 5, evenly
    assert len(raw) == 3 + 3 + 3  # the prompts, the OpenHands turns, the SWE-agent ones: nothing else raw
    done = _samples(r, 'oh')  # the turns answered, then the rendered sample as recorded (`supervise_recorded`)
    assert done['sample_id'] == [f"{row['sample_id']}-t{k:02d}" for k in range(3)] + [f"{row['sample_id']}-rec"]
    for x, (a, _) in zip(done, row['spans']):
        n = len(x['input_ids']) - a
        assert x['input_ids'][:a] == row['input_ids'][:a] and x['input_ids'][a:] == list(range(100, 100 + n))
        assert x['loss_mask'] == [0] * a + [1] * n and x['spans'] == [[a, a + n]] and n > 0
    assert len(_samples(r, 'swe')) == 3 + 1


def test_answered_turns_share_the_trajectory_states(policy_run, kimi_tiny, tmp_path):
    """The answered turns of the demo's SWE-agent trajectory and an OpenHands one (prefix policy), extracted into a
    shared store and a whole one: read back, every position of every sample is bit for bit what the whole store holds
    for the sample whose forward computed it (the sample itself, or the one it shares the prefix of: the same tokens
    up to there); the shared store holds each trajectory's recorded states once plus each answer's"""
    from datasets import concatenate_datasets
    from eagle3nb.extract import extract_modes, load_target
    from eagle3nb.store import validate

    r = policy_run[0]
    ds = concatenate_datasets([_samples(r, 'oh'), _samples(r, 'swe')])
    model, st = load_target(kimi_tiny), {}
    modes = ('bf16', 'compact', 'nf4')  # every mode from one forward a batch, as extraction runs them
    for share in (False, True):
        outs = {m: tmp_path / ('shared' if share else 'whole') / m for m in modes}
        st[share] = extract_modes(model, ds, outs, [1, 2, 3], topk=8, shard_bytes=20_000, share=share)
        assert all(validate(o, corpus=ds)['problems'] == [] for o in outs.values())
    for mode in modes:
        check_shared(policy_run[0], tmp_path / 'whole' / mode, tmp_path / 'shared' / mode, mode)
        assert st[True][mode]['stored_tokens'] < st[False][mode]['stored_tokens'] == st[False][mode]['tokens']
        print(f"{mode}: whole {st[False][mode]['stored_tokens']} state rows, shared {st[True][mode]['stored_tokens']}")


def test_recorded_turns_kept_beside_the_answers(policy_run, kimi_tiny, tmp_path):
    """`supervise_recorded`: each rendered sample a turn was answered in is also a training sample as recorded
    (`-rec`: its ids and loss mask as rendered); it begins with the same tokens as that turn's answered sample, so the
    store adds only its recorded answer's states"""
    import shutil
    from datasets import load_from_disk
    from eagle3nb.generate import completed_samples
    from eagle3nb.store import shared_prefixes

    r = policy_run[0]
    root, tok = Path(r.data_root), load_tokenizer(kimi_tiny)
    shutil.copytree(root / 'generated' / 'oh', tmp_path / 'oh')
    (tmp_path / 'oh' / 'samples').rename(tmp_path / 'answers-only')
    st = completed_samples(root / 'rendered' / 'oh', tmp_path / 'oh', tok, root / 'prepared' / 'oh', recorded=True)
    got, rendered = load_from_disk(str(tmp_path / 'oh' / 'samples')), _rendered(r, 'oh')
    assert st['samples'] == 3 + 1 and got['sample_id'] == _samples(r, 'oh')['sample_id']  # the phase's default
    rec = got[3]
    assert rec['sample_id'] == rendered[0]['sample_id'] + '-rec'
    assert (rec['input_ids'], rec['loss_mask']) == (rendered[0]['input_ids'], rendered[0]['loss_mask'])
    plan = shared_prefixes(got['sample_id'], got['conversation_id'], lambda j: got[j]['input_ids'], min_tokens=1)
    stored = sum(len(x['input_ids']) - plan.get(x['sample_id'], [None, 0])[1] for x in got)
    last = got[2]  # the last turn: its prefix is the recorded trajectory up to its recorded answer
    assert stored == len(rec['input_ids']) + sum(len(x['input_ids']) - x['spans'][0][0] for x in got.select(range(3)))
    assert last['input_ids'][: last['spans'][0][0]] == rec['input_ids'][: last['spans'][0][0]]


def check_shared(r, whole_dir, shared_dir, mode):
    "Shared store `shared_dir` against whole store `whole_dir` of the same samples (see the test above)"
    import torch
    from eagle3nb.store import HiddenStates, read_index

    rows = {x['sample_id']: x for x in read_index(shared_dir)}
    for rec in ('oh', 'swe'):  # turns t00 < t01 < t02 of one rendered row: the recorded row once, each answer once
        g = _samples(r, rec)
        turns, recorded = [x for x in g if '-t' in x['sample_id']], [x for x in g if x['sample_id'].endswith('-rec')]
        starts = [x['spans'][0][0] for x in turns]
        assert sum(rows[s]['length'] - rows[s]['prefix_len'] for s in g['sample_id']) == len(
            recorded[0]['input_ids']
        ) + sum(len(x['input_ids']) - a for x, a in zip(turns, starts))
    whole = HiddenStates(whole_dir)
    shared = HiddenStates(shared_dir, sample_ids=[x['sample_id'] for x in whole.rows])
    W = {x['sample_id']: x for x in whole}

    def made_by(sid, t):  # the sample whose forward the shared store keeps position t of `sid` from
        x = rows[sid]
        while t < x['prefix_len']:
            x = rows[x['prefix_of']]
        return x['sample_id']

    names = ('aux', 'final') if mode == 'bf16' else ('aux', 'topk_p', 'topk_idx')
    for a, b in zip(whole, shared):  # bitwise: each position as its own forward's whole store holds it
        assert a['sample_id'] == b['sample_id']
        assert torch.equal(a['input_ids'], b['input_ids']) and torch.equal(a['loss_mask'], b['loss_mask'])
        src = [made_by(a['sample_id'], t) for t in range(len(a['input_ids']))]
        for k in names:
            want = torch.stack([W[s][k][t] for t, s in enumerate(src)])
            assert torch.equal(b[k], want), (a['sample_id'], k)
        if a['sample_id'] != src[0]:
            noise = (a['aux'].float() - b['aux'].float()).abs().max().item()  # float32 over another length
            print(f"{a['sample_id']}: {src.count(src[0])}/{len(src)} from {src[0]}, |aux whole - shared| {noise:.3g}")


def test_turns_chat_rendered_with_the_targets_answers_every_turn_supervised(policy_run, kimi_tiny):
    "A `turns` chat becomes rendered samples whose history holds the target's answers, each of them supervised"
    from eagle3nb.generate import conversations

    r, rec, calls = policy_run
    tok = load_tokenizer(kimi_tiny)
    recs = {x['conversation_id']: x for x in read_shards(gen_dir(r.data_root), 'glaive')}
    chats = [b for p, b in calls if p == '/v1/chat/completions']
    assert len(recs) == 4 and len(chats) == sum(len(x['turns']) for x in recs.values())
    recorded = conversations(Path(r.data_root) / 'prepared' / 'glaive', set(recs))
    orig = {x['conversation_id']: x for x in _rendered(r, 'glaive')}
    done = _samples(r, 'glaive')
    assert set(done['conversation_id']) == set(recs)
    for cid, x in recs.items():
        mine = [s for s in done if s['conversation_id'] == cid]
        spans = [tok.decode(s['input_ids'][a:b]) for s in mine for a, b in s['spans']]
        assert len(spans) == len(x['turns'])  # every regenerated turn supervised, once
        for t, text in zip(x['turns'], spans):
            assert (t['content'] or '') in text and all(c['function']['name'] in text for c in t['tool_calls'] or [])
        first = mine[0]
        a = first['spans'][0][0]
        assert first['input_ids'][:a] == orig[cid]['input_ids'][: orig[cid]['spans'][0][0]]  # the recorded opening
        whole = tok.decode(mine[-1]['input_ids'])
        said = [m['content'] for m in recorded[cid]['messages'] if m['role'] == 'assistant' and len(m['content']) > 20]
        assert said and not any(m in whole for m in said)  # no recorded answer left in the history


def test_keep_sends_nothing(policy_run):
    r, rec, calls = policy_run
    assert rec.summary['kept'] == dict(hermes=1) and 'keep' not in rec.summary['policies']
    pol = {x['policy']: x for x in rec.policies}
    assert (pol['keep']['datasets'], pol['keep']['samples'], pol['keep']['ok']) == (['hermes'], 1, 0)
    assert not (gen_dir(r.data_root) / 'hermes').exists()
    st = samples_df(r.catalog, where="dataset = 'hermes'", phases=['generate'])
    assert st.state_generate.tolist() == ['skipped']  # never asked: kept, by policy
    hk = _rendered(r, 'hermes')[0]
    assert not any(tuple(b.get('prompt') or ()) == tuple(hk['input_ids'][: hk['spans'][0][0]]) for _, b in calls)


def test_merge_takes_the_generated_samples_and_a_rate_is_recorded(policy_run):
    from eagle3nb.catalog import measured_rate
    from eagle3nb.merge import load_input, merge_corpus, merge_inputs

    r, rec, _ = policy_run
    inputs = merge_inputs(r)
    assert {f'generated:{d}' for d in ('syn', 'glaive', 'oh', 'swe')} <= set(
        inputs
    ) and 'generated:hermes' not in inputs
    train, ev, rep, fates = merge_corpus({k: load_input(v) for k, v in inputs.items()}, eval_fraction=0.0)
    got = set(train['sample_id'])
    assert set(_samples(r, 'oh')['sample_id']) | set(_samples(r, 'swe')['sample_id']) <= got
    assert set(_samples(r, 'glaive')['sample_id']) | set(_samples(r, 'syn')['sample_id']) <= got
    rate = measured_rate(r.catalog, 'generate')
    assert (rate['run_id'], rate['tokens'], rate['samples']) == ('run', rec.summary['completion_tokens'], 3 + 4 + 1 + 1)
    assert rate['tok_per_s'] > 0 and rec.rate['detail'] == dict(endpoints=1, c_main=4, c_long=1)
