"Render: token-exactness per template family, masks = completion tokens, spans, prefix merge, render_jsonl / render_dataset end to end"

import json
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from eagle3nb.render import (
    BOUNDARY,
    check_event,
    conversation_events,
    family_tokenizer,
    load_tokenizer,
    read_render_manifest,
    render_conversations,
    render_dataset,
    render_jsonl,
    template_messages,
    tokenize_events,
)
from eagle3nb.schema import Reject, conversation, message, tool_call
from eagle3nb.target import template_family
from eagle3nb.toy import SAMPLE_TOOLS, ensure_toy, sample_chat, template

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / 'tests' / 'fixtures' / 'datasets'
REFS = ROOT / 'tests' / 'fixtures' / 'reference_ids'  # SpecForge's reference renders, copied in (see each .SOURCE.txt)
FILES = dict(
    kimi='kimi-k2-thinking.jinja',
    qwen3='qwen3-0.6b.jinja',
    llama3='llama-3.1-8b-instruct.jinja',
    deepseek='deepseek-v3.1.jinja',
    glm='glm-4.6.jinja',
)
FAMILIES = list(FILES)


@pytest.fixture(scope='session')
def toys():
    "Paths of the two toy targets (built once, cached)"
    return dict(kimi=ensure_toy('kimi-tiny'), qwen3=ensure_toy('qwen3-tiny'))


@pytest.fixture(scope='session')
def toks(toys):
    "A tokenizer per family: the toys' own, and toy BPE + family special tokens + verbatim template for the others"
    kimi, qwen = load_tokenizer(toys['kimi']), load_tokenizer(toys['qwen3'])
    out = dict(
        kimi=kimi,
        qwen3=qwen,
        **{f: family_tokenizer(qwen, f, template(FILES[f])) for f in ('llama3', 'deepseek', 'glm')},
    )
    assert {f: template_family(t.chat_template) for f, t in out.items()} == {f: f for f in out}
    return out


def chat(f):
    return sample_chat('kimi-tiny' if f == 'kimi' else 'qwen3-tiny')


def loop_chat(f):
    "system, user, a tool-call turn (two calls for all but Llama), its results, a second tool-call turn, its result, the answer"
    calls = [
        tool_call('get_weather', {'city': 'Beijing'}),
        tool_call('get_weather', {'city': 'Paris', 'days': 2, 'units': ['c']}),
    ]
    calls = calls[:1] if f == 'llama3' else calls
    ms = [
        message('system', 'You are a helpful assistant.'),
        message('user', 'Weather in Beijing and Paris?'),
        message('assistant', 'Let me look.', reasoning_content='Two cities: two calls.', tool_calls=calls),
    ]
    ms += [message('tool', f'{{"weather": "sunny {i}"}}', tool_call_id=None) for i in range(len(calls))]
    ms += [
        message(
            'assistant',
            '',
            reasoning_content='One more check.',
            tool_calls=[tool_call('get_weather', {'city': 'Oslo'})],
        ),
        message('tool', '{"weather": "snow"}'),
        message('assistant', 'Sunny, sunny, snow.', reasoning_content='Summarise.'),
    ]
    return conversation('t', 0, ms, tools=SAMPLE_TOOLS)


# --- token-exactness: prompt + completion == the template's own rendering where the template keeps the turn ---


@pytest.mark.parametrize('f', FAMILIES)
@pytest.mark.parametrize('thinking', [True, False])
def test_tool_loop_turn_is_template_exact(toks, f, thinking):
    "Every tool-call turn of an in-progress loop: prompt ids + completion ids == template ids (DeepSeek: thinking off only)"
    c = loop_chat(f)
    turns = [i for i, m in enumerate(c['messages']) if m['role'] == 'assistant' and m.get('tool_calls')]
    assert len(turns) == 2
    for (
        i
    ) in turns:  # DeepSeek-V3.1 writes a turn after a user message as non-thinking: its thinking turns are never shown
        a, b = check_event(toks[f], c['messages'], i, c['tools'], thinking)
        after_user = c['messages'][i - 1]['role'] == 'user'
        assert (a == b) == (not (f == 'deepseek' and thinking and after_user)), (f, thinking, i)


@pytest.mark.parametrize('f', FAMILIES)
def test_final_answer_template_exact_where_kept(toks, f):
    "The answer after a tool result: all templates but Kimi-K2-Thinking keep it; without reasoning all do"
    ms = chat(f)
    a, b = check_event(toks[f], ms, 4, SAMPLE_TOOLS)
    assert (a == b) == (f != 'kimi')
    plain = [{**m, 'reasoning_content': None} for m in ms]
    a, b = check_event(toks[f], plain, 4, SAMPLE_TOOLS)
    assert a == b


@pytest.mark.parametrize('f', FAMILIES)
@pytest.mark.parametrize('thinking', [True, False])
def test_completion_is_token_prefix_of_template_with_next_message(toks, f, thinking):
    "The completion ends where the template's next message begins (GLM: the `<|observation|>` we emit)"
    c = loop_chat(f)
    ms, tok = c['messages'], toks[f]
    i = next(i for i, m in enumerate(ms) if m['role'] == 'assistant')
    a, _ = check_event(tok, ms, i, c['tools'], thinking)
    nxt = tok.apply_chat_template(
        template_messages(ms[: i + 2], f, thinking),
        tools=c['tools'],
        tokenize=False,
        add_generation_prompt=False,
        thinking=thinking,
        enable_thinking=thinking,
    )
    ids = tok(nxt, add_special_tokens=False)['input_ids']
    assert (ids[: len(a)] == a) == ((f, thinking) not in (('deepseek', True), ('qwen3', False)))


# --- masks and spans ---


def supervised(r):
    return [i for i, m in zip(r['input_ids'], r['loss_mask']) if m]


@pytest.mark.parametrize('f', FAMILIES)
@pytest.mark.parametrize('merge', [True, False])
def test_mask_is_exactly_the_completion_tokens(toks, f, merge):
    "Mask = union of spans; each span's ids = the completion's own tokenization; reasoning and tool calls supervised"
    c, tok = loop_chat(f), toks[f]
    rows = render_conversations([c], tok, merge=merge)
    evs = tokenize_events(tok, conversation_events(c, tok))
    assert not [r for r in rows if 'reject' in r]
    comps = [e['completion_ids'] for e in evs]
    got = [r['input_ids'][s:t] for r in rows for s, t in r['spans']]
    assert got == comps
    for r in rows:
        assert r['loss_mask'] == [int(any(s <= i < t for s, t in r['spans'])) for i in range(len(r['input_ids']))]
        assert r['completion_tokens'] == sum(r['loss_mask']) and r['prompt_tokens'] == r['spans'][0][0]
    text = tok.decode([i for r in rows for i in supervised(r)])
    if f != 'llama3':  # Llama-3.1 has no reasoning
        for rc in ('Two cities: two calls.', 'One more check.', 'Summarise.'):
            assert (rc in text) == (f != 'deepseek' or rc == 'Two cities: two calls.'), (
                rc
            )  # V3.1: no thinking after tool results
    for city in ('Beijing', 'Oslo'):
        assert city in text
    marker = dict(
        kimi='<|tool_call_begin|>',
        qwen3='<tool_call>',
        llama3='"parameters"',
        deepseek='<｜tool▁call▁begin｜>',
        glm='<tool_call>',
    )[f]
    assert text.count(marker) == (2 if f == 'llama3' else 3)


def test_kimi_tool_loop_merges_and_answer_is_separate(toks):
    "Kimi: the tool loop (kept with reasoning) is one sample; a second user turn after a reasoned answer starts a new one"
    c = loop_chat('kimi')
    ms = c['messages'] + [message('user', 'And tomorrow?'), message('assistant', 'Rain.', reasoning_content='Guess.')]
    rows = render_conversations([conversation('t', 1, ms, tools=SAMPLE_TOOLS)], toks['kimi'])
    assert [(r['sample_id'][-3:], r['n_events']) for r in rows] == [('e00', 3), ('e03', 1)]
    unmerged = render_conversations([conversation('t', 1, ms, tools=SAMPLE_TOOLS)], toks['kimi'], merge=False)
    assert [r['sample_id'][-3:] for r in unmerged] == ['e00', 'e01', 'e02', 'e03']
    assert (
        sum(r['stored_merged'] for r in unmerged)
        == sum(r['stored_merged'] for r in rows)
        < sum(r['stored_unmerged'] for r in rows)
    )
    assert sum(r['completion_tokens'] for r in unmerged) == sum(r['completion_tokens'] for r in rows)


def test_prompt_only_and_rejects(toks):
    "prompt_only: the prompt with the generation prompt, mask all 0; a boundary merge or template refusal rejects one event"
    po = render_conversations([conversation('t', 2, chat('kimi')[:2], kind='prompt_only')], toks['kimi'])[0]
    assert po['prompt_only'] and po['spans'] == [] and set(po['loss_mask']) == {0} and po['sample_id'].endswith('-e00')
    assert toks['kimi'].decode(po['input_ids']).endswith('<|im_assistant|>assistant<|im_middle|>')
    raw = family_tokenizer(
        toks['qwen3'],
        'qwen3',
        "{% for m in messages %}{{ m.role }}:{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}",
    )
    rows = render_conversations(
        [
            conversation(
                't',
                3,
                [message('user', 'q'), message('assistant', '\nx'), message('user', 'r'), message('assistant', 'y')],
            )
        ],
        raw,
    )
    assert [r.get('reject') for r in rows] == [BOUNDARY, None] and rows[1]['sample_id'].endswith('-e01')


# --- the SpecForge reference ids: same supervised structure (ids at the same special-token offsets) ---


def spans_of(mask):
    out, s = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and s is None:
            s = i
        if not m and s is not None:
            out.append((s, i))
            s = None
    return out


def test_kimi_spans_match_specforge_reference_structure(toks):
    "Kimi-K2-Thinking reference: each span runs from `<think>` to `<|im_end|>`; so do ours (toy specials sit at the real offsets)"
    tok = toks['kimi']
    base_real, base_toy = 163584, tok.convert_tokens_to_ids('<|im_middle|>') - (163601 - 163584)
    for name in (
        'specforge_kimi-k2-thinking_standard_ref.json',
        'specforge_kimi-k2-thinking_reasoning-multi-turn_ref.json',
    ):
        ref = json.loads((REFS / name).read_text())
        ids, mask = ref['input_ids'], ref['loss_mask']
        for s, t in spans_of(mask):
            assert [ids[s] - base_real, ids[t - 1] - base_real] == [
                tok.convert_tokens_to_ids(x) - base_toy for x in ('<think>', '<|im_end|>')
            ]
            assert ids[s - 1] - base_real == tok.convert_tokens_to_ids('<|im_middle|>') - base_toy
    for r in render_conversations(
        [conversation('t', 4, chat('kimi'), tools=SAMPLE_TOOLS), loop_chat('kimi')], tok, merge=False
    ):
        ((s, t),) = r['spans']
        assert tok.convert_ids_to_tokens([r['input_ids'][s - 1], r['input_ids'][s], r['input_ids'][t - 1]]) == [
            '<|im_middle|>',
            '<think>',
            '<|im_end|>',
        ]


def test_qwen3_reference_shows_the_history_rewrite(toks):
    "SpecForge's one-pass Qwen3 render trains turn 1 without `<think>`; our per-event render gives turn 1 its think block"
    ref = json.loads((REFS / 'specforge_qwen3-thinking_reasoning-multi-turn_ref.json').read_text())
    (s1, _), (s2, _) = spans_of(ref['loss_mask'])
    assert ref['input_ids'][s1] != 151667 and ref['input_ids'][s2] == 151667  # 151667 = <think>
    ms = [
        message('user', 'q1'),
        message('assistant', 'a1', reasoning_content='r1'),
        message('user', 'q2'),
        message('assistant', 'a2', reasoning_content='r2'),
    ]
    rows = render_conversations([conversation('t', 5, ms)], toks['qwen3'])
    think = toks['qwen3'].convert_tokens_to_ids('<think>')
    assert [(r['n_events'], r['input_ids'][r['spans'][0][0]]) for r in rows] == [(1, think), (1, think)]


# --- hypothesis: invariants on random conversations, every family ---

text = st.text(alphabet='ab xyz.:\n{}"', max_size=12)
turn = st.fixed_dictionaries(
    dict(
        user=text.filter(str.strip),
        content=text,
        reasoning=st.none() | text,
        calls=st.lists(st.dictionaries(st.sampled_from('kvw'), st.integers(0, 9) | text, max_size=2), max_size=2),
        answer=st.none() | text.filter(str.strip),
        answer_reasoning=st.none() | text,
    )
)


def build(turns):
    "A conversation from random turns: user, assistant (reasoning, tool calls), tool results, maybe an answer to them"
    ms = []
    for t in turns:
        ms.append(message('user', t['user']))
        calls = [tool_call('fn', a) for a in t['calls']]
        ms.append(message('assistant', t['content'], reasoning_content=t['reasoning'], tool_calls=calls))
        ms += [message('tool', 'ok') for _ in calls]
        if calls and t['answer']:
            ms.append(message('assistant', t['answer'], reasoning_content=t['answer_reasoning']))
    return conversation('h', 0, ms, tools=SAMPLE_TOOLS)


def template_keeps(f, thinking, ms, i):
    "Whether the family's template renders turn `i` as the target emitted it (so check_event must agree), None if not known"
    if not thinking or f in ('qwen3', 'glm', 'llama3'):
        return True
    if f == 'deepseek':
        return ms[i - 1]['role'] == 'tool'  # V3.1 thinks only after a user message, and never shows it
    return True if ms[i].get('tool_calls') else None  # Kimi: an in-progress tool loop is kept with its reasoning


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(turns=st.lists(turn, min_size=1, max_size=3), f=st.sampled_from(FAMILIES), thinking=st.booleans())
def test_token_exact_on_random_conversations(toks, turns, f, thinking):
    "Wherever the template keeps the turn, prompt ids + completion ids == the template's ids, on random text and tool calls"
    try:
        c = build(turns)
    except Reject:
        assume(
            False
        )  # a conversation the schema rejects is no example: Hypothesis draws another (and fails if most are)
    ms = c['messages']
    for i, m in enumerate(ms):
        if m['role'] != 'assistant' or (f == 'llama3' and any(len(x.get('tool_calls') or []) > 1 for x in ms[: i + 1])):
            continue
        a, b = check_event(toks[f], ms, i, c['tools'], thinking)
        keeps = template_keeps(f, thinking, ms, i)
        if keeps is not None:
            assert (a == b) == keeps, (f, thinking, i)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(
    turns=st.lists(turn, min_size=1, max_size=3),
    f=st.sampled_from(FAMILIES),
    thinking=st.booleans(),
    merge=st.booleans(),
)
def test_mask_and_span_invariants(toks, turns, f, thinking, merge):
    "mask sum == sum of completion lengths, spans sorted, disjoint, inside the sample, after a prompt; merge changes no supervision"
    try:
        c = build(turns)
    except Reject:
        assume(
            False
        )  # a conversation the schema rejects is no example: Hypothesis draws another (and fails if most are)
    tok = toks[f]
    rows = render_conversations([c], tok, thinking, merge)
    evs = tokenize_events(tok, conversation_events(c, tok, thinking))
    ok = {e['event']: e for e in evs if 'reject' not in e}
    samples = [r for r in rows if 'reject' not in r]
    assert sum(r['n_events'] for r in samples) == len(ok)
    assert sum(r['completion_tokens'] for r in samples) == sum(len(e['completion_ids']) for e in ok.values())
    for r in samples:
        n, spans = len(r['input_ids']), r['spans']
        assert len(r['loss_mask']) == n and sum(r['loss_mask']) == sum(t - s for s, t in spans)
        assert all(0 < s < t <= n for s, t in spans) and all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        assert spans[-1][1] == n  # a sample ends with its last completion
    for r in (r for r in rows if 'reject' in r):
        assert r['reject'] == BOUNDARY or r['reject'].startswith(('llama3:', 'template', 'Cannot', 'This model')), r[
            'reject'
        ]
    other = render_conversations([c], tok, thinking, not merge)
    assert sum(r.get('completion_tokens', 0) for r in other) == sum(r.get('completion_tokens', 0) for r in rows)


# --- end to end on the toy targets ---


@pytest.fixture(scope='session')
def prepared(tmp_path_factory):
    "The demo recipe's fixture datasets, prepared"
    from eagle3nb.prepare import prepare

    out = tmp_path_factory.mktemp('prepared')
    for d in yaml.safe_load((ROOT / 'recipes' / 'demo.yaml').read_text())['datasets']:
        if d['path'].endswith('demo_prompts.jsonl'):
            continue  # prompts without answers: nothing to supervise until generate
        prepare(ROOT / d['path'], d['format'], d['name'], out, progress=False)
    return out


@pytest.mark.parametrize('toy', ['kimi', 'qwen3'])
def test_render_jsonl_end_to_end(toys, toks, prepared, tmp_path, toy):
    "Prepared conversations -> JSONL -> render_jsonl: one line per sample, masks within ids, thinking off drops reasoning"
    from eagle3nb.prepare import conversations

    convs = [c for d in sorted(prepared.iterdir()) if (d / 'manifest.json').exists() for c in conversations(d)]
    src = tmp_path / 'convs.jsonl'
    src.write_text(''.join(json.dumps(c) + '\n' for c in convs))
    r = render_jsonl(toys[toy], src, tmp_path / 'out')
    lines = [json.loads(l) for l in (tmp_path / 'out' / 'samples.jsonl').read_text().splitlines()]
    assert len(lines) == r['samples'] > len(convs) // 2 and r['rejected'] == 0
    assert {l['sample_id'].rsplit('-', 1)[0] for l in lines} == {c['sample_id'] for c in convs}
    for l in lines:
        assert set(l) == {'sample_id', 'input_ids', 'loss_mask', 'spans'} and len(l['input_ids']) == len(l['loss_mask'])
        assert sum(l['loss_mask']) == sum(t - s for s, t in l['spans']) > 0
    assert r['with_think'] > 0 and r['with_tools'] > 0
    assert r['amplification']['merged'] <= r['amplification']['unmerged']
    off = render_jsonl(toys[toy], src, tmp_path / 'off', thinking=False)
    assert off['with_think'] == 0 and off['events'] == r['events']


def test_render_dataset_end_to_end(toys, prepared, tmp_path):
    "render_dataset on every demo dataset: Arrow samples, manifest with amplification, idempotent, rebuilt on change"
    from datasets import load_from_disk

    for d in sorted(p for p in prepared.iterdir() if (p / 'manifest.json').exists()):
        m = render_dataset(d, toys['kimi'], tmp_path / d.name, num_proc=1)
        assert m == read_render_manifest(tmp_path / d.name) and m['rejected'] == 0
        ds = load_from_disk(str(tmp_path / d.name))
        assert len(ds) == m['samples'] and sum(ds['completion_tokens']) == m['tokens']['supervised']
        if m['tokens']['supervised']:
            assert m['amplification']['merged'] <= m['amplification']['unmerged']
            assert m['tokens']['stored'] == sum(len(x) for x in ds['input_ids'])
    d = prepared / 'lf_reason_tool_use'
    m = render_dataset(d, toys['kimi'], tmp_path / 'lf')
    assert render_dataset(d, toys['kimi'], tmp_path / 'lf') == m  # same inputs: no work
    m2 = render_dataset(d, toys['kimi'], tmp_path / 'lf', merge=False)
    assert (
        m2['samples'] == m2['events'] == m['events'] > m['samples']
        and m2['tokens']['stored'] == m['tokens']['unmerged']
    )
    assert m2['amplification'] == m['amplification']
    assert not list(tmp_path.glob('.*'))  # no temp dirs left behind


def test_render_dataset_rejects_are_listed(toks, prepared, tmp_path):
    "Llama-3.1 refuses parallel tool calls: those events (and later ones whose prompt holds them) go to rejects.jsonl"
    target = tmp_path / 'llama3-tiny'
    toks['llama3'].save_pretrained(target)
    seen = 0
    for d in sorted(p for p in prepared.iterdir() if (p / 'manifest.json').exists()):
        m = render_dataset(d, target, tmp_path / 'r' / d.name, num_proc=1)
        rej = [json.loads(l) for l in (tmp_path / 'r' / d.name / 'rejects.jsonl').read_text().splitlines()]
        assert len(rej) == m['rejected'] == sum(m['reject_reasons'].values())
        assert all(r['sample_id'].startswith(r['conversation_id'] + '-e') for r in rej)
        seen += len(rej)
    assert seen > 0


def test_render_cli_writes_samples_jsonl(tmp_path):
    "`eagle3nb render --target DIR --input CONVERSATIONS.jsonl --out DIR --thinking off`: one JSON line per sample"
    import subprocess, sys
    from eagle3nb.prepare import prepare, conversations

    fix = Path(__file__).resolve().parent / 'fixtures' / 'datasets'
    prepare(fix / 'glaive_toolcall_en_demo.sample.json', 'sharegpt', 'g', tmp_path / 'prepared', progress=False)
    convs = list(conversations(tmp_path / 'prepared' / 'g'))
    (tmp_path / 'c.jsonl').write_text('\n'.join(json.dumps(c) for c in convs))
    exe = str(Path(sys.executable).parent / 'eagle3nb')
    p = subprocess.run(
        [
            exe,
            'render',
            '--target',
            str(ensure_toy('kimi-tiny')),
            '--input',
            str(tmp_path / 'c.jsonl'),
            '--out',
            str(tmp_path / 'out'),
            '--thinking',
            'off',
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    lines = [json.loads(l) for l in open(tmp_path / 'out' / 'samples.jsonl')]
    assert lines and all(
        set(l) >= {'sample_id', 'input_ids', 'loss_mask'} and len(l['input_ids']) == len(l['loss_mask']) for l in lines
    )
    assert {l['sample_id'].rsplit('-e', 1)[0] for l in lines} == {c['sample_id'] for c in convs}
    assert all(sum(l['loss_mask']) > 0 for l in lines)
