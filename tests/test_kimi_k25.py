"""The toy packaged as Kimi-K2.5 ships, served as Kimi's deploy guide serves the real one: vLLM with
`--trust-remote-code` (and `--language-model-only`: text prompts only), one server for the module.

What must hold for a pipeline on the real target to be right: the engine's greedy ids are transformers' on the same
prompts, and the engine renders a chat (tools included) exactly as the tokenizer's own `apply_chat_template` does,
TypeScript tool declaration and all. The remote-code tokenizer also gives the same ids under the engine venv's
transformers (5.19) as under ours (5.24).
"""

import json, os, subprocess

import pytest, torch

from eagle3nb.engine import VllmServer, complete_ids, engine_available, group_pids, vllm_python
from eagle3nb.server import post_json, rss_mb
from eagle3nb.toy import CORPUS, SAMPLE_TOOLS, ensure_toy, sample_chat, toy_corpus

pytestmark = pytest.mark.skipif(
    not engine_available() and not os.environ.get('EAGLE3NB_REQUIRE_ENGINE'),
    reason='no vLLM engine: run `make engine` (make test builds it and sets EAGLE3NB_REQUIRE_ENGINE=1)',
)
NAME, MAX_TOKENS = 'kimi-k25-tiny-trained', 24
SEARCH_TOOL = {
    'type': 'function',
    'function': {
        'name': 'search_docs',
        'description': 'Search the Python docs.\nReturns the best matches.',
        'parameters': {
            'type': 'object',
            'required': ['query'],
            'properties': {
                'query': {'type': 'string', 'description': 'Search text', 'maxLength': 200},
                'filters': {
                    'type': 'object',
                    'properties': {'module': {'type': 'string'}, 'kind': {'type': 'string', 'enum': ['func', 'class']}},
                },
                'limit': {'type': 'integer', 'default': 5, 'minimum': 1},
                'tags': {'type': 'array', 'items': {'type': 'string'}},
            },
        },
    },
}


def chats() -> list:  # (messages, tools)
    "Conversations that exercise the template: tools or none, tool calls and results, kept reasoning, content parts"
    c = sample_chat(NAME)
    parts = [
        dict(role='user', content=[dict(type='text', text='Show part 2 of '), dict(type='text', text='`heapq.py`.')])
    ]
    return [
        (c[:2], SAMPLE_TOOLS),
        (c, SAMPLE_TOOLS),
        (c[:4], SAMPLE_TOOLS),  # ends at the tool result: the tool-calling turn keeps its reasoning
        (c[1:2], None),
        (parts, [SEARCH_TOOL, *SAMPLE_TOOLS]),
    ]


def as_request(messages: list) -> list:
    "Messages as an OpenAI client sends them: tool-call arguments as JSON strings, the reasoning as `reasoning`"
    out = []
    for m in messages:
        m = dict(m)
        if 'reasoning_content' in m:  # vLLM 0.32 reads `reasoning` and hands the template both names
            m['reasoning'] = m.pop('reasoning_content')
        if m.get('tool_calls'):
            m['tool_calls'] = [
                {**c, 'function': {**c['function'], 'arguments': json.dumps(c['function']['arguments'])}}
                for c in m['tool_calls']
            ]
        out.append(m)
    return out


@pytest.fixture(scope='module')
def k25():
    "The toy, from the cache (the first build trains kimi-tiny-trained: minutes, once per machine)"
    return ensure_toy(NAME)


@pytest.fixture(scope='module')
def tok(k25):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(k25, trust_remote_code=True)


@pytest.fixture(scope='module')
def server(k25, tmp_path_factory):
    "One vLLM server on the toy for the module; its start-up time and memory are printed"
    log = tmp_path_factory.mktemp('vllm') / 'server.log'
    with VllmServer(k25, extra=['--trust-remote-code', '--language-model-only'], log_path=log) as srv:
        mb = sum(rss_mb(p) or 0 for p in group_pids(srv.pid))
        print(f'\nvLLM on {NAME}: ready in {srv.ready_s:.1f} s, RSS {mb:.0f} MB')
        srv.rss_mb = mb
        yield srv


def test_served_greedy_equals_transformers(server, tok, k25):
    "vLLM's greedy ids equal transformers' `kimi_k25` model's on raw and chat prompts"
    from transformers import AutoModelForImageTextToText

    m = AutoModelForImageTextToText.from_pretrained(k25).eval()
    raw = [tok.encode('def heapify(x):'), tok.encode(toy_corpus()[:400])]
    chat = [tok.apply_chat_template(ms, tools=t, tokenize=True, return_dict=False) for ms, t in chats()[:2]]
    prompts = raw + chat
    got = complete_ids(server.base_url, server.model, prompts, max_tokens=MAX_TOKENS)
    for p, g in zip(prompts, got):
        with torch.no_grad():
            want = m.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(p) :].tolist()
        assert g == want, (tok.decode(p)[-80:], tok.decode(g), tok.decode(want))
    assert server.ready_s < 600 and server.rss_mb < 8000


def test_engine_renders_as_the_tokenizer(server, tok):
    "`POST /tokenize` with messages and tools gives the tokenizer's own `apply_chat_template` ids, TypeScript inside"
    url = server.base_url.rsplit('/v1', 1)[0] + '/tokenize'
    for ms, tools in chats():
        body = dict(model=server.model, messages=as_request(ms), add_generation_prompt=True)
        if tools:
            body['tools'] = tools
        got = post_json(url, body)['tokens']
        want = tok.apply_chat_template(ms, tools=tools, tokenize=True, return_dict=False)
        assert got == want, (tok.decode(got), tok.decode(want))
        if tools:
            assert '<|im_system|>tool_declare<|im_middle|># Tools\n\n## functions\nnamespace functions {' in tok.decode(
                got
            )
    ms, tools = chats()[0]
    off = dict(model=server.model, messages=ms, tools=tools, add_generation_prompt=True)
    got = post_json(url, off | dict(chat_template_kwargs={'thinking': False}))['tokens']
    assert got == tok.apply_chat_template(ms, tools=tools, tokenize=True, return_dict=False, thinking=False)
    assert tok.decode(got).endswith('<|im_middle|><think></think>')


SAME_IDS = """
import json, sys
from transformers import AutoTokenizer
d, corpus, chats = sys.argv[1], open(sys.argv[2], encoding='utf-8', newline='').read(), json.load(open(sys.argv[3]))
tok = AutoTokenizer.from_pretrained(d, trust_remote_code=True)
out = dict(cls=type(tok).__name__, corpus=tok.encode(corpus))
out['renders'] = [tok.apply_chat_template(ms, tools=t, tokenize=True, return_dict=False) for ms, t in chats]
print(json.dumps(out))
"""


def test_tokenizer_same_in_both_transformers(k25, tok, tmp_path):
    "The remote-code tokenizer gives the same ids under the engine venv's transformers as under ours"
    (tmp_path / 'chats.json').write_text(json.dumps(chats()))
    env = {**os.environ, 'HF_HUB_OFFLINE': '1', 'HF_MODULES_CACHE': str(tmp_path / 'modules')}
    argv = [str(vllm_python()), '-c', SAME_IDS, str(k25), str(CORPUS), str(tmp_path / 'chats.json')]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    theirs = json.loads(r.stdout.strip().splitlines()[-1])
    assert theirs['cls'] == 'TikTokenTokenizer'
    assert theirs['corpus'] == tok.encode(toy_corpus())
    assert theirs['renders'] == [
        tok.apply_chat_template(ms, tools=t, tokenize=True, return_dict=False) for ms, t in chats()
    ]
