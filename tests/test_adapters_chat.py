"""Chat adapters (`eagle3nb.adapters`) on every real fixture record, field by field, and on malformed records (hypothesis).

The notebook `nbs/11_adapters.ipynb` shows each reader on one small record; here every record of the saved
fixture files goes through its reader, and hypothesis throws garbage at every reader: each record is either a
valid conversation or a `Reject` with a short reason, never another exception (so kept + rejected = read), the
same outcome on every read, and the record left as it was.
"""

import copy, json, re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from eagle3nb.schema import ADAPTERS, KINDS, ROLES, Reject, sample_id
import eagle3nb.adapters  # registers the formats below

FIX = Path(__file__).parent / 'fixtures' / 'datasets'
FORMATS = {
    'sharegpt': 'full',
    'openai': 'full',
    'llamafactory_v1': 'full',
    'alpaca': 'full',
    'ultrachat': 'full',
    'prompt_only': 'prompt_only',
    'mixture_of_thoughts': 'full',
}
KIMI_ID = re.compile(r'^functions\.(.+):(\d+)$')


def load(name):
    "Records of a fixture file, as it is (JSON list, single JSON object, or JSONL)"
    text = (FIX / name).read_text()
    if name.endswith('.jsonl'):
        return [json.loads(l) for l in text.splitlines() if l.strip()]
    d = json.loads(text)
    return d if isinstance(d, list) else [d]


def run(fmt, recs, kind=None, dataset='fixture'):
    "`(kept conversations, reject reasons)` of `recs` read as `fmt`; checks the invariants of every kept one"
    kept, reasons = [], []
    for i, r in enumerate(recs):
        try:
            c = ADAPTERS[fmt](r, dataset, i, kind)
        except Reject as e:
            reasons.append(str(e))
            continue
        check_invariants(c, kind or FORMATS[fmt])
        kept.append(c)
    assert len(kept) + len(reasons) == len(recs)
    return kept, reasons


def check_invariants(c, kind):
    "What every canonical conversation guarantees, whatever record it came from"
    assert set(c) == {'sample_id', 'dataset', 'source_index', 'kind', 'tools', 'messages', 'license', 'meta'}
    assert c['kind'] == kind and re.fullmatch(r'[0-9a-f]{16}', c['sample_id'])
    assert json.loads(json.dumps(c)) == c  # JSON-serialisable as is (to_record)
    assert isinstance(c['meta'], dict) and isinstance(c['meta'].get('format'), str)
    assert c['license'] is None or isinstance(c['license'], str)
    for t in c['tools']:
        assert t['type'] == 'function' and isinstance(t['function']['name'], str) and t['function']['name']
    calls, answered, n = {}, set(), 0
    for m in c['messages']:
        assert set(m) == {'role', 'content', 'reasoning_content', 'tool_calls', 'tool_call_id', 'name'}
        assert m['role'] in ROLES and isinstance(m['content'], str)
        assert m['reasoning_content'] is None or (m['role'] == 'assistant' and isinstance(m['reasoning_content'], str))
        for tc in m['tool_calls'] or []:
            assert m['role'] == 'assistant' and tc['type'] == 'function'
            assert isinstance(tc['function']['arguments'], dict) and isinstance(tc['function']['name'], str)
            mt = KIMI_ID.match(tc['id'])
            assert mt and mt[1] == tc['function']['name'] and int(mt[2]) == n, tc['id']  # conversation-global counter
            calls[tc['id']], n = tc['function']['name'], n + 1
        if m['role'] == 'tool':
            assert m['tool_call_id'] in calls and m['name'] == calls[m['tool_call_id']]  # linked to an earlier call
            assert m['tool_call_id'] not in answered
            answered.add(m['tool_call_id'])
        else:
            assert m['tool_call_id'] is None
    roles = [m['role'] for m in c['messages']]
    assert 'user' in roles
    if kind == 'prompt_only':
        assert roles[-1] == 'user'
    else:
        assert 'assistant' in roles


def test_registry():
    "Every chat format is registered with its default kind"
    assert {n: ADAPTERS[n].default_kind for n in FORMATS} == FORMATS


# ---------------------------------------------------------------- real fixture records, field by field


def test_alpaca_en_demo():
    recs = load('alpaca_en_demo.sample.json')
    kept, reasons = run('alpaca', recs)
    assert (len(recs), len(kept), reasons) == (4, 4, [])
    for i, (r, c) in enumerate(zip(recs, kept)):
        assert [m['role'] for m in c['messages']] == ['user', 'assistant']
        assert c['messages'][0]['content'] == r['instruction']  # every input is empty: no joiner
        assert c['messages'][1]['content'] == r['output'] and c['messages'][1]['reasoning_content'] is None
        assert all(m['tool_calls'] is None for m in c['messages'])
        assert (c['source_index'], c['sample_id'], c['license'], c['meta']) == (
            i,
            sample_id('fixture', i),
            None,
            {'format': 'alpaca'},
        )


def test_alpaca_joiner_and_history():
    c = ADAPTERS['alpaca'](
        {
            'instruction': 'Translate to German.',
            'input': 'Good morning',
            'output': 'Guten Morgen',
            'history': [['Hi', 'Hello!']],
            'system': 'You translate.',
        },
        'd',
        0,
        None,
    )
    assert [(m['role'], m['content']) for m in c['messages']] == [
        ('system', 'You translate.'),
        ('user', 'Hi'),
        ('assistant', 'Hello!'),
        ('user', 'Translate to German.\n\nGood morning'),
        ('assistant', 'Guten Morgen'),
    ]


def sharegpt_expectations(r):
    "What a LLaMA-Factory ShareGPT record should become: (role, content, calls or None) per canonical message"
    out = []
    for t in r['conversations']:
        if t['from'] == 'function_call':
            v = json.loads(t['value'])
            call = (v['name'], v['arguments'])
            if out and out[-1][0] == 'assistant':
                out[-1] = ('assistant', out[-1][1], (out[-1][2] or []) + [call])
            else:
                out.append(('assistant', '', [call]))
        else:
            out.append(({'human': 'user', 'gpt': 'assistant', 'observation': 'tool'}[t['from']], t['value'], None))
    return out


def test_glaive_toolcall_en_demo():
    "LLaMA-Factory's ShareGPT with function_call/observation turns and a tools column (JSON text)"
    recs = load('glaive_toolcall_en_demo.sample.json')
    kept, reasons = run('sharegpt', recs)
    assert (len(recs), len(kept), reasons) == (4, 4, [])
    for r, c in zip(recs, kept):
        got = [
            (
                m['role'],
                m['content'],
                [(tc['function']['name'], tc['function']['arguments']) for tc in m['tool_calls']]
                if m['tool_calls']
                else None,
            )
            for m in c['messages']
        ]
        assert got == sharegpt_expectations(r)
        assert c['tools'] == [{'type': 'function', 'function': f} for f in json.loads(r['tools'])]
        assert c['meta'] == {'format': 'sharegpt'}
    first = kept[0]['messages']
    assert first[3]['tool_calls'] == [
        {
            'id': 'functions.search_recipes:0',
            'type': 'function',
            'function': {'name': 'search_recipes', 'arguments': {'ingredients': ['chicken', 'bell peppers', 'rice']}},
        }
    ]
    assert (first[4]['role'], first[4]['tool_call_id'], first[4]['name']) == (
        'tool',
        'functions.search_recipes:0',
        'search_recipes',
    )
    last = kept[3]['messages']  # three call/result rounds: the counter runs over the whole conversation
    assert [m['tool_calls'][0]['id'] for m in last if m['tool_calls']] == [
        f'functions.calculate_area:{i}' for i in range(3)
    ]
    assert [m['tool_call_id'] for m in last if m['role'] == 'tool'] == [
        f'functions.calculate_area:{i}' for i in range(3)
    ]
    assert [m['tool_calls'][0]['function']['arguments'] for m in last if m['tool_calls']] == [
        {'shape': 'rectangle', 'dimensions': [5, 3]},
        {'shape': 'circle', 'dimensions': [4]},
        {'shape': 'square', 'dimensions': [7]},
    ]


def test_sharegpt_axolotl_fixture():
    recs = load('sharegpt_conversation.axolotl_fixture.json')
    kept, reasons = run('sharegpt', recs)
    assert (len(recs), len(kept), reasons) == (1, 1, [])
    turns, ms = recs[0]['conversations'], kept[0]['messages']
    assert [m['role'] for m in ms] == ['user', 'assistant'] * 6
    assert [m['content'] for m in ms] == [t['value'] for t in turns]
    assert all(m['reasoning_content'] is None and m['tool_calls'] is None for m in ms)


def test_sharegpt_roles():
    "chatgpt/bing/bard are assistants; unknown roles are rejected by name, never skipped"
    turns = [
        {'from': 'system', 'value': 'S'},
        {'from': 'human', 'value': 'a'},
        {'from': 'chatgpt', 'value': 'b'},
        {'from': 'user', 'value': 'c'},
        {'from': 'bing', 'value': 'd'},
        {'from': 'human', 'value': 'e'},
        {'from': 'bard', 'value': 'f'},
    ]
    c = ADAPTERS['sharegpt']({'id': 'abc_0', 'conversations': turns}, 'sg', 0, None)
    assert [m['role'] for m in c['messages']] == [
        'system',
        'user',
        'assistant',
        'user',
        'assistant',
        'user',
        'assistant',
    ]
    assert (c['sample_id'], c['meta']) == (sample_id('sg', 'abc_0'), {'format': 'sharegpt', 'id': 'abc_0'})
    with pytest.raises(Reject, match="unknown sharegpt role 'narrator'"):
        ADAPTERS['sharegpt']({'conversations': turns + [{'from': 'narrator', 'value': 'x'}]}, 'sg', 0, None)


def test_sharegpt_parallel_calls_and_grouped_observation():
    "A function_call list is parallel calls; one observation holding a JSON list of their results is split"
    calls = [{'name': 'area', 'arguments': {'r': 1}}, {'name': 'area', 'arguments': {'r': 2}}]
    results = [{'name': 'area', 'content': '3.14'}, {'name': 'area', 'content': '12.57'}]
    rec = {
        'conversations': [
            {'from': 'human', 'value': 'areas?'},
            {'from': 'function_call', 'value': json.dumps(calls)},
            {'from': 'observation', 'value': json.dumps(results)},
            {'from': 'gpt', 'value': '3.14, 12.57'},
        ]
    }
    kept, _ = run('sharegpt', [rec])
    ms = kept[0]['messages']
    assert [tc['id'] for tc in ms[1]['tool_calls']] == ['functions.area:0', 'functions.area:1']
    assert [(m['tool_call_id'], m['content']) for m in ms[2:4]] == [
        ('functions.area:0', '3.14'),
        ('functions.area:1', '12.57'),
    ]


def fixed_specforge():
    "The SpecForge record with its one truncated `arguments` string completed (the only change)"
    rec = copy.deepcopy(load('specforge_tool_use_conversation.jsonl')[0])
    rec['conversations'][4]['tool_calls'][0]['function']['arguments'] = json.dumps(
        {'file_path': 'spec.pdf', 'replacements': [{'new_text': '<template>\n'}]}
    )
    return rec


def test_specforge_tool_use_conversation():
    "Its second call's arguments are truncated JSON: rejected with the reason, never repaired by guessing"
    recs = load('specforge_tool_use_conversation.jsonl')
    kept, reasons = run('openai', recs)
    assert (len(recs), len(kept), reasons) == (1, 0, ['tool call arguments are not valid JSON'])
    rec = fixed_specforge()
    kept, reasons = run('openai', [rec], dataset='specforge')
    c, raw = kept[0], rec['conversations']
    assert [m['role'] for m in c['messages']] == [m['role'] for m in raw]
    assert [m['content'] for m in c['messages']] == [m['content'] for m in raw]
    assert [m['reasoning_content'] for m in c['messages']] == [m.get('reasoning_content') for m in raw]  # '' kept as ''
    names = ['read_file', 'search_replace', 'search_replace', 'search_file', 'search_replace']
    ids = [f'functions.{n}:{i}' for i, n in enumerate(names)]
    assert [tc['id'] for m in c['messages'] for tc in m['tool_calls'] or []] == ids
    assert [(m['tool_call_id'], m['name']) for m in c['messages'] if m['role'] == 'tool'] == list(
        zip(ids, names)
    )  # positional links
    args = [tc['function']['arguments'] for m in c['messages'] for tc in m['tool_calls'] or []]
    assert args[0] == {'end_line': 120, 'file_path': 'xml.jpg', 'start_line': 1} and args[3] == {'query': 'Signal.vue'}
    assert c['tools'] == rec['tools']
    assert (c['sample_id'], c['meta']) == (sample_id('specforge', 9), {'format': 'openai', 'id': 9})


def test_llamafactory_v1_sft_demo():
    recs = load('llamafactory_v1_sft_demo.sample.jsonl')
    kept, reasons = run('llamafactory_v1', recs)
    assert (len(recs), len(kept), reasons) == (3, 3, [])
    for r, c in zip(recs, kept):
        assert [(m['role'], m['content']) for m in c['messages']] == [
            (m['role'], m['content'][0]['value']) for m in r['messages']
        ]
        assert all(m['reasoning_content'] is None and m['tool_calls'] is None for m in c['messages'])


def v1_expectations(r):
    "(role, text, reasoning, calls) per canonical message of a LLaMA-Factory v1 record; grouped results split"
    out = []
    for m in r['messages']:
        parts = m['content']
        text = ''.join(p['value'] for p in parts if p['type'] == 'text')
        reasoning = (
            ''.join(p['value'] for p in parts if p['type'] == 'reasoning')
            if any(p['type'] == 'reasoning' for p in parts)
            else None
        )
        calls = [
            (v['name'], v['arguments']) for v in (json.loads(p['value']) for p in parts if p['type'] == 'tool_call')
        ]
        if m['role'] == 'tool' and len(out[-1][3]) > 1:
            out += [('tool', it['content'], None, []) for it in json.loads(text)]
        else:
            out.append((m['role'], text, reasoning, calls))
    return out


@pytest.mark.parametrize('fmt', ['llamafactory_v1', 'openai'])
def test_llamafactory_reason_tool_use_demo(fmt):
    "Typed parts: reasoning -> reasoning_content, tool_call parts -> calls with object arguments, grouped results split"
    recs = load('llamafactory_reason_tool_use_demo.sample.jsonl')
    kept, reasons = run(fmt, recs)
    assert (len(recs), len(kept), reasons) == (4, 4, [])
    for r, c in zip(recs, kept):
        got = [
            (
                m['role'],
                m['content'],
                m['reasoning_content'],
                [(tc['function']['name'], tc['function']['arguments']) for tc in m['tool_calls'] or []],
            )
            for m in c['messages']
        ]
        assert got == v1_expectations(r)
        assert c['tools'] == json.loads(r['tools'])
    ms = kept[2]['messages']  # 2 then 3 parallel circle_area calls, each answered by one grouped tool message
    assert [tc['id'] for m in ms for tc in m['tool_calls'] or []] == [f'functions.circle_area:{i}' for i in range(5)]
    assert [(m['tool_call_id'], m['name']) for m in ms if m['role'] == 'tool'] == [
        (f'functions.circle_area:{i}', 'circle_area') for i in range(5)
    ]
    assert [m['content'] for m in ms if m['role'] == 'tool'][:2] == [
        "{'area': 7.0686, 'radius': 1.5, 'unit':'square meters'}",
        "{'area': 28.2743, 'radius': 3, 'unit':'square meters'}",
    ]
    assert kept[3]['messages'][-1]['tool_calls'][1]['function']['arguments'] == {
        'bucket_name': 'project-dataset-storage',
        'transition_to_infrequent_access': 30,
        'transition_to_glacier': 90,
    }
    assert kept[0]['tools'][0]['function']['parameters']['type'] == 'dict'  # xLAM-style specs kept as given


def test_preference_and_multimodal_records():
    "DPO pairs are prompts (kind prompt_only) or rejected; records with images are rejected"
    recs = load('llamafactory_dpo_en_demo.sample.json')
    assert run('sharegpt', recs)[1] == ['preference record (chosen/rejected): read it with kind prompt_only'] * 2
    kept, reasons = run('sharegpt', recs, kind='prompt_only')
    assert (len(kept), reasons) == (2, [])
    assert [m['role'] for m in kept[1]['messages']] == ['system', 'user']
    assert kept[1]['messages'][1]['content'] == recs[1]['conversations'][1]['value']
    assert run('openai', load('llamafactory_mllm_demo.sample.json'))[1] == ['multimodal record (images)'] * 2


def test_hermes_is_not_plain_sharegpt():
    "Hermes tool turns (XML in text) are not ShareGPT tool calls: rejected with a reason, not misread"
    assert run('sharegpt', load('hermes_agent_trajectory.doc_example.json'))[1] == [
        'tool result with no matching tool call'
    ]


def test_openai_null_filled_parquet_row():
    "Every key on every message, None where unused; arguments as a struct with union keys"
    none = dict(name=None, tool_call_id=None, function_call=None, tool_calls=None, reasoning_content=None)
    rec = {
        'messages': [
            {**none, 'role': 'system', 'content': 'S'},
            {**none, 'role': 'user', 'content': 'list it'},
            {
                **none,
                'role': 'assistant',
                'content': '',
                'tool_calls': [
                    {
                        'id': 'toolu_1',
                        'type': 'function',
                        'index': 0,
                        'function': {'name': 'ls', 'arguments': {'path': '.', 'command': None, 'old_str': None}},
                    }
                ],
            },
            {**none, 'role': 'tool', 'content': 'a.py', 'tool_call_id': 'toolu_1', 'name': 'ls'},
            {**none, 'role': 'assistant', 'content': 'One file.'},
        ],
        'tools': None,
        'instance_id': 'repo-1',
        'resolved': True,
    }
    c = run('openai', [rec])[0][0]
    assert c['messages'][2]['tool_calls'][0]['function']['arguments'] == {'path': '.'}
    assert (c['messages'][3]['tool_call_id'], c['tools']) == ('functions.ls:0', [])
    assert c['meta'] == {'format': 'openai', 'instance_id': 'repo-1', 'resolved': True}


def test_openai_through_parquet(tmp_path):
    "A real parquet round trip: Arrow null-fills the union of keys; the conversations come out as from the JSON"
    pa, pq = pytest.importorskip('pyarrow'), pytest.importorskip('pyarrow.parquet')

    def call(id, name, args):
        return [{'id': id, 'type': 'function', 'function': {'name': name, 'arguments': args}}]

    recs = [
        {
            'id': 'r0',
            'tools': None,
            'messages': [
                {'role': 'user', 'content': 'list'},
                {'role': 'assistant', 'content': '', 'tool_calls': call('a', 'sh', {'cmd': 'ls'})},
                {'role': 'tool', 'content': 'a.py', 'tool_call_id': 'a'},
                {'role': 'assistant', 'content': 'One file.'},
            ],
        },
        {
            'id': 'r1',
            'tools': [{'type': 'function', 'function': {'name': 'edit', 'description': 'Edit a file'}}],
            'messages': [
                {'role': 'system', 'content': 'S'},
                {'role': 'user', 'content': 'fix'},
                {
                    'role': 'assistant',
                    'content': 'On it.',
                    'tool_calls': call('b', 'edit', {'path': 'a.py', 'line': 3, 'opts': {'dry': False}}),
                },
                {'role': 'tool', 'content': 'ok', 'tool_call_id': 'b', 'name': 'edit'},
                {'role': 'assistant', 'content': 'Done.'},
            ],
        },
    ]
    pq.write_table(pa.Table.from_pylist(recs), tmp_path / 't.parquet')
    rows = pq.read_table(tmp_path / 't.parquet').to_pylist()
    assert rows[0]['messages'][1]['tool_calls'][0]['function']['arguments'] == {
        'cmd': 'ls',
        'path': None,
        'line': None,
        'opts': None,
    }
    assert run('openai', rows) == run('openai', recs)


def test_ultrachat():
    rec = {
        'prompt': 'How do plants grow?',
        'prompt_id': 'a1b2',
        'messages': [
            {'role': 'user', 'content': 'How do plants grow?'},
            {'role': 'assistant', 'content': 'Light.'},
            {'role': 'user', 'content': 'And?'},
            {'role': 'assistant', 'content': 'Water.'},
        ],
    }
    c = run('ultrachat', [rec], dataset='uc')[0][0]
    assert [(m['role'], m['content']) for m in c['messages']] == [(m['role'], m['content']) for m in rec['messages']]
    assert (c['sample_id'], c['license'], c['meta']) == (
        sample_id('uc', 'a1b2'),
        'mit',
        {'format': 'ultrachat', 'prompt_id': 'a1b2'},
    )
    p = run('ultrachat', [rec], kind='prompt_only')[0][0]
    assert [m['content'] for m in p['messages']] == ['How do plants grow?', 'Light.', 'And?']


def test_prompt_only_columns():
    recs = [
        {'prompt': 'Why is the sky blue?'},
        {'messages': [{'role': 'user', 'content': 'q'}, {'role': 'assistant', 'content': 'a'}]},
        {'question': 'What is 2+2?', 'system': 'Be exact.'},
        {'instruction': 'Sort.', 'input': '3 1 2'},
        {'text': 'no prompt'},
    ]
    kept, reasons = run('prompt_only', recs)
    assert [[m['content'] for m in c['messages']] for c in kept] == [
        ['Why is the sky blue?'],
        ['q'],
        ['Be exact.', 'What is 2+2?'],
        ['Sort.\n\n3 1 2'],
    ]
    assert reasons == ['no prompt column (prompt, messages, question or instruction)']


def test_mixture_of_thoughts():
    rec = {
        'messages': [
            {'role': 'system', 'content': 'Think first.'},
            {'role': 'user', 'content': 'Is 7 prime?'},
            {'role': 'assistant', 'content': '<think>\n\n7 has no divisors but 1 and 7.\n\n</think>\n\nYes.'},
        ],
        'num_tokens': 30,
        'source': 'math',
    }
    c = run('mixture_of_thoughts', [rec])[0][0]
    a = c['messages'][-1]
    assert (a['reasoning_content'], a['content']) == (
        '\n7 has no divisors but 1 and 7.\n',
        'Yes.',
    )  # one newline stripped each side
    assert (c['license'], c['meta']) == (
        'apache-2.0',
        {'format': 'mixture_of_thoughts', 'num_tokens': 30, 'source': 'math'},
    )
    bad = copy.deepcopy(rec)
    bad['messages'][-1]['content'] = '<think>never closed'
    assert run('mixture_of_thoughts', [bad])[1] == ['unclosed or misplaced <think> block']


# ---------------------------------------------------------------- malformed records (hypothesis)
# Three sources of records, mixed in every batch: (1) plausible records of the format, well-typed but with names,
# ids, arguments, links and <think> blocks that may be wrong (so the deep paths run); (2) any JSON value, or an
# object whose known fields hold anything; (3) real fixture records or plausible ones, mutated in one to three
# places (a value replaced by random JSON, deleted, nulled, turned into JSON text, truncated, duplicated, swapped).

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda ch: st.lists(ch, max_size=3) | st.dictionaries(st.text(max_size=6), ch, max_size=3),
    max_leaves=12,
)
texts = st.sampled_from(
    [
        '',
        ' ',
        'hi',
        'q',
        '<think>',
        '<think>\nr\n</think>\n\na',
        '<think></think>',
        'a <think>b</think>',
        '{"a": 1}',
        '[1]',
        '{',
        'null',
    ]
) | st.text(max_size=10)
# well-typed pieces: right shapes, but names, ids, arguments and links may still be wrong
arguments = st.sampled_from(
    ['{"x": 1}', '{}', '', '{"a": [1, {"b": null}]}', '{bad', '[]', '1' * 5000, '[' * 5000, {'y': None, 'z': 2}, {}]
)
call_objs = st.fixed_dictionaries({'name': st.sampled_from(['f', 'g', 'g', '']), 'arguments': arguments})
call_ids = st.sampled_from([None, 'c1', 'c2', 'c3', '', 'functions.f:0'])
openai_calls = st.fixed_dictionaries(
    {'function': call_objs},
    optional={'id': call_ids, 'type': st.sampled_from(['function', 'custom']), 'index': st.integers(0, 3)},
)
grouped = st.sampled_from(
    [
        json.dumps([{'name': 'f', 'content': '1'}, {'name': 'g', 'content': '2'}]),
        json.dumps([{'name': 'f', 'content': {'k': 1}}, {'content': '2'}, {'content': 3}]),
        json.dumps([{'name': 'h', 'content': '1'}, {'name': 'h', 'content': '2'}]),
        '[{"title": 1}]',
    ]
)
tool_texts = st.sampled_from(['ok', '']) | grouped
parts = st.one_of(
    st.fixed_dictionaries({'type': st.just('text'), 'value': texts}),
    st.fixed_dictionaries({'type': st.just('text'), 'text': texts}),
    st.fixed_dictionaries({'type': st.just('reasoning'), 'value': texts}),
    st.fixed_dictionaries({'type': st.just('tool_call'), 'value': st.builds(json.dumps, call_objs)}),
    st.fixed_dictionaries({'type': st.just('image_url'), 'image_url': st.just({'url': 'a.png'})}),
)
contents = texts | st.lists(parts, max_size=3)


def msg(role, content, **optional):
    return st.fixed_dictionaries({'role': st.just(role), 'content': content}, optional=optional)


openai_msgs = st.one_of(
    msg('system', contents),
    msg('developer', texts),
    msg('user', contents),
    msg('user', contents),
    msg('critic', texts),
    msg(
        'assistant',
        contents,
        tool_calls=st.lists(openai_calls, min_size=1, max_size=3),
        reasoning_content=texts,
        function_call=call_objs,
    ),
    msg('assistant', texts, tool_calls=st.lists(openai_calls, min_size=1, max_size=3)),
    msg('tool', tool_texts, tool_call_id=call_ids, name=st.sampled_from(['f', 'g', 'h'])),
    msg('function', tool_texts, name=st.sampled_from(['f', 'g'])),
)
sharegpt_turns = st.one_of(
    st.fixed_dictionaries(
        {
            'from': st.sampled_from(
                ['human', 'human', 'user', 'gpt', 'gpt', 'chatgpt', 'bing', 'bard', 'system', 'narrator']
            ),
            'value': texts,
        }
    ),
    st.fixed_dictionaries(
        {'from': st.just('function_call'), 'value': st.builds(json.dumps, call_objs | st.lists(call_objs, max_size=3))}
    ),
    st.fixed_dictionaries({'from': st.sampled_from(['observation', 'tool']), 'value': tool_texts}),
)
tool_specs = st.lists(
    st.fixed_dictionaries({'name': st.sampled_from(['f', 'g'])}, optional={'description': texts}), max_size=2
) | st.builds(
    json.dumps,
    st.lists(
        st.fixed_dictionaries(
            {'type': st.just('function'), 'function': st.fixed_dictionaries({'name': st.sampled_from(['f', ''])})}
        ),
        max_size=2,
    ),
)


@st.composite
def ultrachat_records(draw):
    "prompt + messages, the prompt usually equal to the first user message"
    ms = draw(st.lists(st.one_of(msg('user', st.sampled_from(['q', 'Hi?'])), msg('assistant', texts)), max_size=5))
    first = next((m['content'] for m in ms if m['role'] == 'user'), 'q')
    return {
        'prompt': draw(st.sampled_from([first, first, first, 'other'])),
        'prompt_id': draw(call_ids),
        'messages': ms,
    }


@st.composite
def dialogues(draw):
    "A tool-using dialogue that is right by construction: rounds of user, calls with their results, answer"
    d, n = ([('system', 'Be brief.')] if draw(st.booleans()) else []), 0
    for _ in range(draw(st.integers(1, 3))):
        d.append(('user', draw(st.sampled_from(['q', 'Weather in Oslo?', 'hello']))))
        k = draw(st.integers(0, 3))
        if k:
            calls = [
                (
                    f'call_{n + i}' if draw(st.booleans()) else None,
                    draw(st.sampled_from(['f', 'g'])),
                    draw(st.sampled_from([{'x': 1}, {}, {'a': [1, {'b': 'c'}]}])),
                )
                for i in range(k)
            ]
            n += k
            d.append(
                (
                    'assistant',
                    draw(st.sampled_from(['', 'Let me check.'])),
                    draw(st.sampled_from([None, 'plan'])),
                    calls,
                )
            )
            if k > 1 and draw(st.booleans()):
                d.append(('grouped', json.dumps([{'name': c[1], 'content': 'r'} for c in calls])))
            else:
                d += [('tool', 'r', c[0], draw(st.sampled_from([c[1], None]))) for c in calls]
        d.append(('assistant', draw(st.sampled_from(['Sunny.', '<think>\nok\n</think>\n\nSunny.'])), None, []))
    return d


def as_openai(d, v1=False):
    "OpenAI messages (or LLaMA-Factory v1 typed parts) of a dialogue"
    out = []
    for t in d:
        if t[0] == 'assistant':
            _, text, reasoning, calls = t
            if v1:
                content = (
                    [{'type': 'reasoning', 'value': reasoning}] * (reasoning is not None)
                    + [{'type': 'text', 'value': text}]
                    + [{'type': 'tool_call', 'value': json.dumps({'name': c[1], 'arguments': c[2]})} for c in calls]
                )
                out.append({'role': 'assistant', 'content': content})
            else:
                out.append(
                    {
                        'role': 'assistant',
                        'content': text,
                        'reasoning_content': reasoning,
                        'tool_calls': [
                            {'id': c[0], 'type': 'function', 'function': {'name': c[1], 'arguments': json.dumps(c[2])}}
                            for c in calls
                        ]
                        or None,
                    }
                )
        elif t[0] == 'tool' and v1:
            out.append({'role': 'tool', 'content': [{'type': 'text', 'value': t[1]}]})  # v1 has no ids
        elif t[0] == 'tool':
            out.append({'role': 'tool', 'content': t[1], 'tool_call_id': t[2], 'name': t[3]})
        else:
            out.append(
                {
                    'role': 'tool' if t[0] == 'grouped' else t[0],
                    'content': [{'type': 'text', 'value': t[1]}] if v1 else t[1],
                }
            )
    return out


def as_sharegpt(d):
    "ShareGPT turns (LLaMA-Factory's function_call/observation) of a dialogue"
    out = []
    for t in d:
        if t[0] == 'assistant':
            _, text, reasoning, calls = t
            if text or not calls:
                out.append({'from': 'gpt', 'value': text if reasoning is None else f'<think>{reasoning}</think>{text}'})
            if calls:
                out.append(
                    {
                        'from': 'function_call',
                        'value': json.dumps(
                            [{'name': c[1], 'arguments': c[2]} for c in calls]
                            if len(calls) > 1
                            else {'name': calls[0][1], 'arguments': calls[0][2]}
                        ),
                    }
                )
        else:
            out.append({'from': {'system': 'system', 'user': 'human'}.get(t[0], 'observation'), 'value': t[1]})
    return out


def test_dialogues_are_kept():
    "The dialogue generator is right by construction: every format keeps what it builds (checked on a few examples)"

    @settings(max_examples=30, deadline=None, database=None)
    @given(d=dialogues())
    def check(d):
        for fmt, rec in [
            ('openai', {'messages': as_openai(d)}),
            ('llamafactory_v1', {'messages': as_openai(d, v1=True)}),
            ('sharegpt', {'conversations': as_sharegpt(d)}),
        ]:
            assert run(fmt, [rec])[1] == [], (fmt, rec)

    check()


plausible = {
    'sharegpt': st.fixed_dictionaries(
        {'conversations': st.lists(sharegpt_turns, max_size=8) | dialogues().map(as_sharegpt)},
        optional={'system': texts, 'tools': tool_specs, 'id': call_ids},
    ),
    'openai': st.fixed_dictionaries(
        {'messages': st.lists(openai_msgs, max_size=8) | dialogues().map(as_openai)},
        optional={'tools': tool_specs, 'functions': tool_specs, 'system': texts, 'id': call_ids},
    ),
    'llamafactory_v1': st.fixed_dictionaries(
        {'messages': st.lists(openai_msgs, max_size=8) | dialogues().map(lambda d: as_openai(d, v1=True))},
        optional={'tools': tool_specs, 'system': texts},
    ),
    'alpaca': st.fixed_dictionaries(
        {'instruction': texts, 'output': texts},
        optional={
            'input': texts,
            'system': texts,
            'history': st.lists(st.lists(texts, min_size=2, max_size=2), max_size=2),
        },
    ),
    'ultrachat': ultrachat_records(),
    'prompt_only': st.fixed_dictionaries(
        {},
        optional={
            'prompt': texts | st.lists(openai_msgs, max_size=3),
            'messages': st.lists(openai_msgs, max_size=4),
            'question': texts,
            'instruction': texts,
            'input': texts,
            'system': texts,
            'tools': tool_specs,
        },
    ),
    'mixture_of_thoughts': st.fixed_dictionaries(
        {'messages': st.lists(openai_msgs, max_size=4) | dialogues().map(as_openai)},
        optional={'num_tokens': st.integers(), 'source': texts},
    ),
}
anything = (
    st.fixed_dictionaries(
        {},
        optional={
            k: json_values
            for k in (
                'conversations',
                'messages',
                'tools',
                'functions',
                'system',
                'id',
                'instruction',
                'input',
                'output',
                'history',
                'prompt',
                'prompt_id',
                'question',
                'chosen',
                'rejected',
                'images',
                'license',
                'num_tokens',
                'source',
            )
        },
    )
    | json_values
)


def fixture_records():
    return {
        'sharegpt': load('glaive_toolcall_en_demo.sample.json') + load('sharegpt_conversation.axolotl_fixture.json'),
        'openai': [fixed_specforge()] + load('llamafactory_reason_tool_use_demo.sample.jsonl'),
        'llamafactory_v1': load('llamafactory_v1_sft_demo.sample.jsonl')
        + load('llamafactory_reason_tool_use_demo.sample.jsonl'),
        'alpaca': load('alpaca_en_demo.sample.json'),
        'ultrachat': [
            {
                'prompt': 'Hi?',
                'prompt_id': 'p',
                'messages': [{'role': 'user', 'content': 'Hi?'}, {'role': 'assistant', 'content': 'Hello.'}],
            }
        ],
        'prompt_only': load('alpaca_en_demo.sample.json')[:1]
        + [{'prompt': 'Why?'}, {'messages': [{'role': 'user', 'content': 'q'}]}],
        'mixture_of_thoughts': [
            {
                'messages': [
                    {'role': 'user', 'content': 'q'},
                    {'role': 'assistant', 'content': '<think>\nr\n</think>\n\na'},
                ],
                'num_tokens': 9,
                'source': 'math',
            }
        ],
    }


FIXTURES = fixture_records()


def paths(x, path=()):
    "Paths of every value inside `x` (dict keys and list positions), depth first"
    items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else ()
    for k, v in items:
        yield path + (k,)
        yield from paths(v, path + (k,))


@st.composite
def mutated(draw, fmt):
    "A real or plausible record of `fmt` changed in one to three places"
    rec = copy.deepcopy(draw(st.sampled_from(FIXTURES[fmt]) | plausible[fmt]))
    for _ in range(draw(st.integers(1, 3))):
        ps = list(paths(rec))
        if not ps:
            break
        *parent, k = draw(st.sampled_from(ps))
        node = rec
        for p in parent:
            node = node[p]
        action = draw(
            st.sampled_from(['replace', 'retext', 'delete', 'none', 'json_text', 'truncate', 'duplicate', 'swap'])
        )
        if action == 'delete':
            del node[k]
        elif action == 'none':
            node[k] = None
        elif action == 'json_text':
            node[k] = json.dumps(node[k])
        elif action == 'retext':
            node[k] = draw(
                texts
                | st.sampled_from(
                    ['user', 'assistant', 'tool', 'gpt', 'observation', 'function_call', 'reasoning', 'c1']
                )
            )
        elif action == 'truncate' and isinstance(node[k], str):
            node[k] = node[k][: draw(st.integers(0, len(node[k])))]
        elif action in ('duplicate', 'swap') and isinstance(node, list):
            j = draw(st.integers(0, len(node) - 1))
            if action == 'duplicate':
                node.insert(j, copy.deepcopy(node[k]))
            else:
                node[j], node[k] = node[k], node[j]
        else:
            node[k] = draw(json_values)
    return rec


def outcome(fmt, rec, i, kind):
    "What reader `fmt` makes of `rec`: its conversation, or the `Reject` reason as a str"
    try:
        return ADAPTERS[fmt](rec, 'hyp', i, kind)
    except Reject as e:
        return str(e)


@pytest.mark.parametrize('fmt', list(FORMATS))
@settings(max_examples=200, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_malformed_records_are_rejected_with_a_reason(fmt, data):
    "Any record: a valid conversation or a `Reject` with a short one-line reason, the same each time, input untouched"
    batch = data.draw(st.lists(st.one_of(plausible[fmt], anything, mutated(fmt)), min_size=1, max_size=4))
    kind = data.draw(st.sampled_from([None, None, *KINDS, 'bogus']))
    for i, rec in enumerate(batch):
        before = copy.deepcopy(rec)
        c = outcome(fmt, rec, i, kind)  # any exception but Reject fails the test: kept + rejected = read
        if isinstance(c, str):
            assert c.strip() and '\n' not in c and len(c) <= 100, c
        else:
            check_invariants(c, kind or FORMATS[fmt])
        assert repr(rec) == repr(before), 'the reader changed its input'  # repr: NaN equals itself
        assert repr(outcome(fmt, before, i, kind)) == repr(c), 'a second read of the same record differs'


def test_mutation_sources_are_valid():
    "The records the mutations start from are all kept unmutated (so a mutation is what makes a reject)"
    for fmt, recs in FIXTURES.items():
        assert not run(fmt, recs)[1], fmt
