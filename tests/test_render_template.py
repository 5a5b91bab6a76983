"Direct chat-template render: the same text (or the same error) as tok.apply_chat_template, every family, on random conversations"

import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from eagle3nb.render import (
    TEMPLATE_RENDERS,
    chat_text,
    direct_template,
    family_tokenizer,
    render_jsonl,
    template_messages,
    template_render,
)
from eagle3nb.schema import Reject
from eagle3nb.toy import SAMPLE_TOOLS
from test_render import FAMILIES, loop_chat, toks, toys  # noqa: F401 (fixtures)
from test_render_linear import build, turn


def outcome(f, *a, **k):
    try:
        return f(*a, **k)
    except Exception as e:
        return type(e).__name__, str(e)


def reference(tok, ms, tools, thinking, gen):
    return outcome(
        tok.apply_chat_template,
        ms,
        tools=tools or None,
        tokenize=False,
        add_generation_prompt=gen,
        thinking=thinking,
        enable_thinking=thinking,
    )


@pytest.mark.parametrize('f', FAMILIES)
def test_every_family_renders_directly(toks, f):
    assert not isinstance(direct_template(toks[f]), str) and template_render(toks[f]) == 'direct'


def test_template_dict_goes_to_apply_chat_template(toks):
    "A tokenizer with a dict of named templates: apply_chat_template picks one and renders, counted with its reason"
    tok = family_tokenizer(toks['qwen3'], 'qwen3', {'default': toks['qwen3'].chat_template})
    why, ms = 'chat template is not one string', [dict(role='user', content='hi')]
    n = TEMPLATE_RENDERS[why]
    assert template_render(tok) == f'apply_chat_template: {why}'
    assert chat_text(tok, ms) == chat_text(toks['qwen3'], ms) and TEMPLATE_RENDERS[why] == n + 1


@pytest.mark.parametrize('f', FAMILIES)
@pytest.mark.parametrize('thinking', [True, False])
def test_tool_loop_prefixes_equal_apply_chat_template(toks, f, thinking):
    "Every prefix of a tool loop with reasoning, with and without tools and the generation prompt"
    ms, n = template_messages(loop_chat(f)['messages'], f, thinking), TEMPLATE_RENDERS['direct']
    for i in range(1, len(ms) + 1):
        for tools in (None, SAMPLE_TOOLS):
            for gen in (True, False):
                assert outcome(chat_text, toks[f], ms[:i], tools, thinking, gen) == reference(
                    toks[f], ms[:i], tools, thinking, gen
                )
    assert TEMPLATE_RENDERS['direct'] - n == 4 * len(ms)


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    turns=st.lists(turn, min_size=1, max_size=3),
    f=st.sampled_from(FAMILIES),
    thinking=st.booleans(),
    tools=st.booleans(),
    gen=st.booleans(),
)
def test_random_conversations_equal_apply_chat_template(toks, turns, f, thinking, tools, gen):
    "Random text, system turns, tool calls and results, reasoning: every prefix renders as apply_chat_template renders it"
    try:
        c = build(turns)
    except Reject:
        assume(
            False
        )  # a conversation the schema rejects is no example: Hypothesis draws another (and fails if most are)
    ms, tl = template_messages(c['messages'], f, thinking), SAMPLE_TOOLS if tools else None
    for i in range(1, len(ms) + 1):
        assert outcome(chat_text, toks[f], ms[:i], tl, thinking, gen) == reference(toks[f], ms[:i], tl, thinking, gen)


def test_not_plain_input_goes_to_apply_chat_template(toks):
    "No messages, a None field, a tool given as a function: apply_chat_template renders (and raises its own errors)"
    tok, n = toks['qwen3'], TEMPLATE_RENDERS['input not plain']

    def get_weather(city: str):
        """Weather of a city.

        Args:
            city: the city
        """

    hi, with_none = [dict(role='user', content='hi')], [dict(role='user', content='hi', name=None)]
    assert outcome(chat_text, tok, []) == reference(tok, [], None, True, True)
    assert chat_text(tok, with_none) == reference(tok, with_none, None, True, True) == chat_text(tok, hi)
    assert chat_text(tok, hi, [get_weather]) == reference(tok, hi, [get_weather], True, True)
    assert TEMPLATE_RENDERS['input not plain'] - n == 3


def test_render_jsonl_says_how_the_template_rendered(toys, tmp_path):
    src = tmp_path / 'c.jsonl'
    src.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n')
    assert render_jsonl(toys['kimi'], src, tmp_path / 'out')['template_render'] == 'direct'
