"Linear render: the same rows as rendering every event apart, on random conversations of every family; flat cost in turns"

import random, time

import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from eagle3nb.render import (
    _rows,
    conversation_events,
    plan_groups,
    render_conversations,
    render_stats,
    _stat_table,
    template_sha256,
    tokenize_events,
)
from eagle3nb.target import FAMILY_TOKENS
from eagle3nb.schema import Reject, conversation, message, tool_call
from eagle3nb.toy import SAMPLE_TOOLS
from test_render import FAMILIES, loop_chat, text, toks, toys  # noqa: F401 (fixtures)


def per_event(convs, tok, thinking=True, merge=True):
    "The reference: every event's prompt rendered and tokenized apart (the path before linear rendering)"
    per = [conversation_events(c, tok, thinking) for c in convs]
    tokenize_events(tok, [e for evs in per for e in evs])
    return [r for c, evs in zip(convs, per) for r in _rows(c, evs, template_sha256(tok), merge)]


def drop(rows):
    return [{k: v for k, v in r.items() if k not in ('fallback', 'renders', 'twin_checked')} for r in rows]


turn = st.fixed_dictionaries(
    dict(
        system=st.none() | text.filter(str.strip),
        user=text.filter(str.strip),
        content=text,
        reasoning=st.none() | text,
        loops=st.integers(0, 3),
        calls=st.lists(st.dictionaries(st.sampled_from('kvw'), st.integers(0, 9) | text, max_size=2), max_size=2),
        answer=st.none() | text.filter(str.strip),
        answer_reasoning=st.none() | text,
    )
)


def build(turns):
    "System turns anywhere, user turns, tool-call turns with their results, tool loops of repeated turns, answers"
    ms = []
    for t in turns:
        if t['system']:
            ms.append(message('system', t['system']))
        ms.append(message('user', t['user']))
        calls = [tool_call('fn', a) for a in t['calls']]
        ms.append(message('assistant', t['content'], reasoning_content=t['reasoning'], tool_calls=calls))
        ms += [message('tool', 'ok') for _ in calls]
        for k in range(t['loops'] if calls else 0):  # same text each time: the search must not skip a turn
            ms += [
                message(
                    'assistant', t['content'], reasoning_content=t['reasoning'], tool_calls=[tool_call('fn', {'k': k})]
                ),
                message('tool', t['user']),
            ]
        if calls and t['answer']:
            ms.append(message('assistant', t['answer'], reasoning_content=t['answer_reasoning']))
    return conversation('h', 0, ms, tools=SAMPLE_TOOLS)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    turns=st.lists(turn, min_size=1, max_size=4),
    f=st.sampled_from(FAMILIES),
    thinking=st.booleans(),
    merge=st.booleans(),
)
def test_linear_rows_equal_per_event_rows(toks, turns, f, thinking, merge):
    "Ids, masks, spans, merge rows, rejects and stored counts equal the per-event reference's"
    try:
        c = build(turns)
    except Reject:
        assume(
            False
        )  # a conversation the schema rejects is no example: Hypothesis draws another (and fails if most are)
    assert drop(render_conversations([c], toks[f], thinking, merge)) == per_event([c], toks[f], thinking, merge)


@pytest.mark.parametrize('f', FAMILIES)
def test_quoted_special_token_is_rejected(toks, f):
    "A message that quotes one of the target's special tokens is rejected with its reason before any render (issue 22)"
    tk = FAMILY_TOKENS[f][-1]
    quoted = conversation('t', 1, [message('user', f'what does {tk} mean?'), message('assistant', 'a tag')])
    rows = render_conversations([loop_chat(f), quoted], toks[f])
    st_ = render_stats(_stat_table(rows))
    assert st_['reject_reasons'].get(f'messages[0] (user) content holds the special token {tk!r}') == 1, st_[
        'reject_reasons'
    ]
    assert st_['fallback'] == dict(conversations=0, reasons={})  # a reject, not a per-event render
    assert st_['prompt_renders'] >= 1 and drop(rows) == per_event([loop_chat(f), quoted], toks[f])


def trajectory(n, seed=0):
    "A synthetic agent trajectory: per turn reasoning, one tool call and its result"
    r = random.Random(seed)
    w = lambda k: ' '.join(r.choice('file test error value line patch run'.split()) for _ in range(k))
    ms = [message('system', 'You are a coding agent.'), message('user', 'Fix the test. ' + w(20))]
    for t in range(n):
        ms += [
            message(
                'assistant',
                w(10),
                reasoning_content=w(40),
                tool_calls=[tool_call('bash', {'command': f'grep {w(2)} {t}.py'})],
            ),
            message('tool', w(80)),
        ]
    return conversation('traj', n, ms + [message('assistant', 'Done.', reasoning_content=w(20))], tools=SAMPLE_TOOLS)


def test_trajectory_is_one_sample_in_three_renders_and_linear(toks):
    "A 200-turn Kimi trajectory: one merged sample, one template render, and per-token time flat from 20 to 200 turns"
    tok = toks['kimi']
    small, big = trajectory(20), trajectory(200)
    assert drop(render_conversations([small], tok)) == per_event([small], tok)
    rows = render_conversations([big], tok)
    assert [(r['n_events'], r['renders'], r['fallback']) for r in rows] == [(201, 1, '')]
    pl = plan_groups(big, tok, 'kimi')
    assert len(pl['groups']) == 1 and pl['renders'] == 1

    def rate(c):
        best = float('inf')
        for _ in range(3):
            t0 = time.perf_counter()
            n = len(render_conversations([c], tok)[0]['input_ids'])
            best = min(best, time.perf_counter() - t0)
        return n / best

    assert (
        rate(big) > rate(small) / 3
    )  # linear: tokens/s within 3x (the bench asks 2x from 10 to 400 turns on a quiet machine)


def test_manifest_counts_fallback_and_renders(toys, tmp_path):
    "render_dataset's manifest says how many conversations took the per-event path (and why) and how many prompts were rendered"
    from eagle3nb.prepare import prepare
    from eagle3nb.render import render_dataset
    from test_render import FIXTURES

    prepare(
        FIXTURES / 'llamafactory_reason_tool_use_demo.sample.jsonl',
        'llamafactory_v1',
        'lf',
        tmp_path / 'p',
        progress=False,
    )
    m = render_dataset(tmp_path / 'p' / 'lf', toys['kimi'], tmp_path / 'r', num_proc=1)
    assert m['fallback'] == dict(conversations=0, reasons={}) and 0 < m['prompt_renders'] <= m['events']
    from datasets import load_from_disk

    assert not {'fallback', 'renders', 'twin_checked'} & set(
        load_from_disk(str(tmp_path / 'r')).column_names
    )  # bookkeeping, not saved
