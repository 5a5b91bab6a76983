"Render on a slow remote-code tiktoken target (kimi-k25-tiny): its own chat-template method, linear via a checked twin"

import json, shutil, time, types, warnings
from collections import Counter

import pytest

from eagle3nb.prepare import conversations
from eagle3nb.render import (
    REFUSED,
    TEMPLATE_RENDERS,
    _compiled,
    load_tokenizer,
    render_conversations,
    render_dataset,
    render_encoding,
    render_stats,
    render_tokenizer,
    _stat_table,
    template_messages,
    template_render,
    template_sha256,
    tokenizer_sha256,
)
from eagle3nb.toy import ensure_toy
from test_render import loop_chat, prepared  # noqa: F401 (fixtures)
from test_render_linear import drop, per_event, trajectory

OWN = 'tokenizer overrides apply_chat_template'
DECLARE = '<|im_system|>tool_declare<|im_middle|>'


@pytest.fixture(scope='session')
def k25():
    "The kimi-k25-tiny folder and its remote-code slow tokenizer (cached per process, as render loads it)"
    d = ensure_toy('kimi-k25-tiny')
    return d, load_tokenizer(d, trust_remote_code=True)


@pytest.fixture(scope='session')
def corpus(prepared):  # noqa: F811
    "The render test corpus: the demo recipe datasets with answers, prepared, plus a tool loop and a 10-turn trajectory"
    convs = [c for d in sorted(prepared.iterdir()) if (d / 'manifest.json').exists() for c in conversations(d)]
    return convs + [loop_chat('kimi'), trajectory(10)]


def fresh(d):
    "Another instance of the target's tokenizer: its own twin, its own state"
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(d, trust_remote_code=True)


def declaration(text: str) -> str:
    "The tool declaration of a rendered prompt, '' if it has none"
    return text.split(DECLARE, 1)[1].split('<|im_end|>', 1)[0] if DECLARE in text else ''


def test_the_tokenizer_brings_its_own_method(k25):
    "The toy is what the issue is about: slow, remote code, an apply_chat_template of its own; render says so"
    _, tok = k25
    assert type(tok).__name__ == 'TikTokenTokenizer' and not tok.is_fast
    assert template_render(tok) == f'apply_chat_template: {OWN}'
    twin, why = render_tokenizer(tok)
    assert why == '' and twin.is_fast and render_encoding(tok).startswith('fast twin of the slow tokenizer')


@pytest.mark.parametrize('thinking', [True, False])
def test_rows_equal_the_tokenizers_own_apply_chat_template(k25, corpus, thinking):
    "Each event's prompt ids in the rows == tok.apply_chat_template(..., tokenize=True), for the whole corpus"
    _, tok = k25
    n0, direct0 = TEMPLATE_RENDERS[OWN], TEMPLATE_RENDERS['direct']
    rows = render_conversations(corpus, tok, thinking)
    assert TEMPLATE_RENDERS[OWN] > n0 and TEMPLATE_RENDERS['direct'] == direct0  # every render through its method
    assert not [r for r in rows if 'reject' in r]
    by, seen = {}, Counter()
    for r in rows:
        by.setdefault(r['conversation_id'], []).append(r)
    for c in corpus:
        ms, tools = template_messages(c['messages'], 'kimi', thinking), c.get('tools') or None
        turns = [i for i, m in enumerate(ms) if m['role'] == 'assistant']
        for r in by[c['sample_id']]:
            first = int(r['sample_id'].rsplit('-e', 1)[1])
            assert r['template_sha256'] == template_sha256(tok)
            for j, (s, _) in enumerate(r['spans']):
                ref = tok.apply_chat_template(
                    ms[: turns[first + j]], tools=tools, tokenize=True, add_generation_prompt=True, thinking=thinking
                )['input_ids']
                assert r['input_ids'][:s] == ref, (c['sample_id'], first + j)
                seen['with tools' if tools else 'without tools'] += 1
    print(
        f'\nthinking={thinking}: {len(corpus)} conversations, event prompts equal to apply_chat_template: {dict(seen)}'
    )
    assert seen['with tools'] >= 20 and seen['without tools'] >= 10
    assert drop(rows) == per_event(corpus, tok, thinking)  # and the linear rows are the per-event path's


def test_tool_declaration_is_typescript_not_json(k25, corpus):
    "Every tool-bearing prompt declares its tools in TypeScript, as the tokenizer's method does; the JSON only directly"
    _, tok = k25
    tooled = [c for c in corpus if c.get('tools')]
    rows = render_conversations(tooled, tok)
    firsts = {r['conversation_id']: r for r in rows if r['sample_id'].endswith('-e00')}
    for c in tooled:
        r = firsts[c['sample_id']]
        decl = declaration(tok.decode(r['input_ids'][: r['spans'][0][0]]))
        assert decl.startswith('# Tools\n\n## functions\nnamespace functions {\n') and decl.rstrip().endswith('}')
        assert 'type ' in decl and '=> any;' in decl and '"parameters"' not in decl
        ms = template_messages(c['messages'], 'kimi')[:1]
        direct = _compiled(tok.chat_template).render(
            messages=ms, tools=c['tools'], add_generation_prompt=True, **tok.special_tokens_map
        )
        json.loads(declaration(direct))  # what the bypass wrote: the tools' JSON
    print(f'\n{len(tooled)} tool-bearing conversations: TypeScript declarations, no JSON')
    assert len(tooled) >= 5


def test_slow_tokenizer_renders_linearly_through_its_twin(k25, corpus):
    "No per-event path, every text the twin encoded checked, one render per trajectory, tokens/s flat in the turns"
    _, tok = k25
    rows = render_conversations(corpus, tok)
    st = render_stats(_stat_table(rows))
    assert st['fallback'] == dict(conversations=0, reasons={}) and st['twin_checked'] >= len(corpus)
    assert all(r['twin_checked'] > 0 for r in rows if r['renders'])
    long = trajectory(100, seed=1)
    assert [(r['n_events'], r['renders'], r['fallback']) for r in render_conversations([long], tok)] == [(101, 1, '')]

    def rate(c):
        best = float('inf')
        for _ in range(3):
            t0 = time.perf_counter()
            n = len(render_conversations([c], tok)[0]['input_ids'])
            best = min(best, time.perf_counter() - t0)
        return n / best

    assert rate(long) > rate(trajectory(10, seed=1)) / 3  # linear: tokens/s within 3x from 10 to 100 turns


def test_a_twin_that_disagrees_is_refused(k25, corpus):
    "A slow tokenizer whose encode does more than its ranks: its twin is refused, rows are the slow per-event path's"
    d, _ = k25
    cut = fresh(d)
    whole = cut._tokenize
    cut._tokenize = lambda text, **kw: [t for i in range(0, len(text), 8) for t in whole(text[i : i + 8], **kw)]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter('always')
        rows = render_conversations(corpus, cut)
    assert render_tokenizer(cut) == (None, REFUSED)
    assert {r['fallback'] for r in rows if r['renders']} == {REFUSED} and not any(r['twin_checked'] for r in rows)
    assert drop(rows) == per_event(corpus, cut)
    assert any('fast twin of TikTokenTokenizer is refused' in str(w.message) for w in said)


def test_no_twin_without_tiktoken_ranks(k25, corpus):
    "A slow tokenizer that keeps no tiktoken Encoding gets no twin: per-event on the slow tokenizer, saying why"
    d, _ = k25
    odd = fresh(d)
    odd.model = types.SimpleNamespace(encode_ordinary=odd.model.encode_ordinary)  # encodes as before, no ranks to read
    rows = render_conversations(corpus[:3], odd)
    why = 'slow tokenizer (no offsets), no fast twin: TikTokenTokenizer keeps no tiktoken Encoding at .model'
    assert render_tokenizer(odd) == (None, why) and {r['fallback'] for r in rows if r['renders']} == {why}
    assert drop(rows) == per_event(corpus[:3], odd)


def test_render_dataset_on_the_remote_code_target(k25, prepared, tmp_path):  # noqa: F811
    "render_dataset with trust_remote_code and two workers: linear, checked, its method named, the real target's hashes"
    from datasets import load_from_disk

    d, tok = k25
    m = render_dataset(prepared / 'lf_reason_tool_use', d, tmp_path / 'r', num_proc=2, trust_remote_code=True)
    assert m['rejected'] == 0 and m['fallback'] == dict(conversations=0, reasons={}) and m['twin_checked'] > 0
    assert m['template_render'] == f'apply_chat_template: {OWN}' and m['encoding'].startswith('fast twin')
    assert m['params']['template_sha256'] == template_sha256(tok) and m['params'][
        'tokenizer_sha256'
    ] == tokenizer_sha256(d)
    assert set(load_from_disk(str(tmp_path / 'r'))['template_sha256']) == {template_sha256(tok)}


def test_tokenizer_hash_covers_its_code(k25, tmp_path):
    "The tokenizer's own module is part of the tokenizer: changing it changes tokenizer_sha256"
    d, _ = k25
    for f in d.iterdir():
        if f.suffix != '.safetensors' and f.is_file():
            shutil.copy(f, tmp_path / f.name)
    h = tokenizer_sha256(tmp_path)
    assert h == tokenizer_sha256(d)
    with open(tmp_path / 'tokenization_kimi.py', 'a') as f:
        f.write('\n# changed\n')
    assert tokenizer_sha256(tmp_path) != h
