"Integration tests of `eagle3nb.server` against a real `transformers serve` on kimi-tiny, through the `openai` client"

import os, signal, subprocess, sys, time
from pathlib import Path
import httpx, pytest
from openai import OpenAI, APIStatusError
from transformers import AutoTokenizer
from eagle3nb.server import (
    LocalServer,
    ModelMismatch,
    ServerNotReady,
    free_port,
    list_models,
    port_in_use,
    wait_for_server,
)

PROMPT = 'The quick brown fox jumps over the lazy dog.'
MESSAGES = [{'role': 'system', 'content': 'You are terse.'}, {'role': 'user', 'content': 'What is 2+2?'}]


@pytest.fixture(scope='module')
def client(toy_server):
    return OpenAI(base_url=toy_server.base_url, api_key='none', max_retries=0, timeout=60)


@pytest.fixture(scope='module')
def tok(kimi_tiny):
    return AutoTokenizer.from_pretrained(kimi_tiny)


def check_usage(u, finish_reason, max_tokens):
    "Usage counts agree with each other and with `max_tokens`"
    assert 1 <= u.completion_tokens <= max_tokens
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert finish_reason in ('length', 'stop')
    if finish_reason == 'length':
        assert u.completion_tokens == max_tokens


def test_lists_only_the_toy(toy_server, client):
    assert [m.id for m in client.models.list().data] == [toy_server.model]
    assert toy_server.model == str(Path(toy_server.model_dir).resolve())  # the absolute path is the model id
    assert wait_for_server(toy_server.base_url, toy_server.model, timeout=5) == [toy_server.model]


@pytest.mark.parametrize('max_tokens', [1, 5, 16])
def test_completion_usage_and_max_tokens(toy_server, client, tok, max_tokens):
    r = client.completions.create(model=toy_server.model, prompt=PROMPT, max_tokens=max_tokens, temperature=0)
    assert r.usage.prompt_tokens == len(tok(PROMPT)['input_ids'])  # the prompt text, tokenized as the server does
    check_usage(r.usage, r.choices[0].finish_reason, max_tokens)


@pytest.mark.parametrize('max_tokens', [1, 8])
def test_chat_usage_and_max_tokens(toy_server, client, tok, max_tokens):
    r = client.chat.completions.create(model=toy_server.model, messages=MESSAGES, max_tokens=max_tokens, temperature=0)
    rendered = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True)[
        'input_ids'
    ]
    assert r.usage.prompt_tokens == len(rendered)  # rendered with the toy's (Kimi-K2-Thinking) chat template
    check_usage(r.usage, r.choices[0].finish_reason, max_tokens)


def test_chat_renders_tools(toy_server, client, tok):
    tools = [
        {
            'type': 'function',
            'function': {
                'name': 'add',
                'description': 'Add two integers',
                'parameters': {'type': 'object', 'properties': {'a': {'type': 'integer'}, 'b': {'type': 'integer'}}},
            },
        }
    ]
    r = client.chat.completions.create(
        model=toy_server.model, messages=MESSAGES, tools=tools, max_tokens=2, temperature=0
    )
    rendered = tok.apply_chat_template(
        MESSAGES, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=True
    )['input_ids']
    assert r.usage.prompt_tokens == len(rendered)


def test_greedy_is_deterministic(toy_server, client):
    texts = {
        client.completions.create(model=toy_server.model, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
        for _ in range(2)
    }
    assert len(texts) == 1


def test_other_model_names_are_refused(toy_server, client):
    with pytest.raises(APIStatusError) as e:
        client.completions.create(model='kimi-tiny', prompt=PROMPT, max_tokens=1)
    assert e.value.status_code == 400 and 'pinned' in e.value.response.json()['detail']


def test_not_ready_names_url_and_fix():
    url = f'http://127.0.0.1:{free_port()}/v1'
    with pytest.raises(ServerNotReady) as e:
        wait_for_server(url, timeout=0.5)
    msg = str(e.value)
    assert f'{url}/models' in msg and 'after 0.' in msg and 'eagle3nb serve MODEL_DIR --port' in msg


def test_detects_a_server_of_another_model(toy_server):
    t0 = time.monotonic()
    with pytest.raises(ModelMismatch) as e:
        wait_for_server(toy_server.base_url, '/models/qwen3-tiny', timeout=30)
    assert time.monotonic() - t0 < 5  # fails at once: waiting would not help
    assert "'/models/qwen3-tiny'" in str(e.value) and toy_server.model in str(e.value)


def test_refuses_a_taken_port(toy_server, kimi_tiny):
    with pytest.raises(OSError, match=f'port {toy_server.port} .* is in use'):
        LocalServer(kimi_tiny, port=toy_server.port).start()


def test_dead_server_fails_fast_with_its_log(tmp_path):
    srv = LocalServer(tmp_path, log_path=tmp_path / 'server.log')  # an empty dir: no model to load
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match='exited with code 1 before it was ready') as e:
        srv.__enter__()
    assert time.monotonic() - t0 < 60 and str(tmp_path / 'server.log') in str(e.value)
    assert not srv.running


def test_startup_timeout_says_how_long_and_where_the_log_is(kimi_tiny, tmp_path):
    srv = LocalServer(
        kimi_tiny, log_path=tmp_path / 'server.log'
    ).start()  # importing torch alone takes longer than 0.1 s
    try:
        with pytest.raises(
            ServerNotReady, match=f"within 0.1 s: still loading, or hung. Its log is {tmp_path / 'server.log'}"
        ):
            srv.wait_ready(timeout=0.1)
    finally:
        srv.stop()
    assert not srv.running


def test_stop_frees_port_and_pid(kimi_tiny, tmp_path):
    with LocalServer(kimi_tiny, log_path=tmp_path / 'server.log') as srv:
        pid, port, url = srv.pid, srv.port, srv.base_url
        assert os.getpgid(pid) == pid  # its own process group
        assert list_models(url) == [srv.model]
    assert srv.proc.returncode == -signal.SIGTERM  # clean exit on SIGTERM, no SIGKILL needed
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)
    assert not port_in_use(port)
    with pytest.raises(httpx.TransportError):  # nothing listens there any more
        list_models(url, timeout=2)


def test_serve_runs_in_the_foreground_until_ctrl_c(kimi_tiny):
    port = free_port()
    code = f'from eagle3nb.server import serve; raise SystemExit(serve({str(kimi_tiny)!r}, port={port}))'
    p = subprocess.Popen([sys.executable, '-c', code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        served = wait_for_server(f'http://127.0.0.1:{port}/v1', timeout=120)
        assert served == [str(Path(kimi_tiny).resolve())]
        seen = []
        for line in p.stdout:  # its banner, then Ctrl-C: readiness, not a clock
            seen.append(line)
            if 'Ctrl-C to stop' in line:
                break
        p.send_signal(signal.SIGINT)  # what Ctrl-C sends
        out, _ = p.communicate(timeout=120)
        out = ''.join(seen) + out
    finally:
        if p.poll() is None:  # SIGINT, not SIGKILL: `serve` must get to stop its server
            p.send_signal(signal.SIGINT)
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    assert f'base_url: http://127.0.0.1:{port}/v1' in out and 'Stopping the server' in out
    assert not port_in_use(port)
