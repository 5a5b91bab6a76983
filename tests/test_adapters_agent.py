"Agent adapters on every real fixture record (field by field), and hypothesis throwing malformed records at each one."

import copy, json, re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from eagle3nb.schema import ADAPTERS, KINDS, ROLES, Reject, to_record, from_record
import eagle3nb.agent_adapters  # noqa: F401  (registers the adapters)

FIX = Path(__file__).parent / 'fixtures' / 'datasets'
NAMES = ('nebius_swe_agent', 'openhands', 'sweagent_traj', 'xlam', 'glaive', 'hermes', 'hermes_kimi_traces')


def load(name):
    return json.loads((FIX / name).read_text())


# ---------------------------------------------------------------- records not in tests/fixtures
# Real records whose fixture files are absent, embedded here (cut short where marked), with their sources.

# glaiveai/glaive-function-calling-v2 raw row, verbatim: quoted in a public GitHub file (code index id 1167731663).
GLAIVE_RAW = {
    'system': 'SYSTEM: You are a helpful assistant with access to the following functions. Use them if required -\n'
    '{\n    "name": "search_books",\n    "description": "Search for books based on title or author",\n'
    '    "parameters": {\n        "type": "object",\n        "properties": {\n            "query": {\n'
    '                "type": "string",\n                "description": "The search query"\n            },\n'
    '            "author": {\n                "type": "string",\n                "description": "The author of the book"\n'
    '            }\n        }\n    }\n}\n\n{\n    "name": "calculate_tip",\n    "description": "Calculate the tip amount for a bill",\n'
    '    "parameters": {\n        "type": "object",\n        "properties": {\n            "bill_amount": {\n'
    '                "type": "number",\n                "description": "The total bill amount"\n            },\n'
    '            "tip_percentage": {\n                "type": "number",\n                "description": "The percentage of tip to be added"\n'
    '            }\n        },\n        "required": [\n            "bill_amount",\n            "tip_percentage"\n        ]\n    }\n}\n\n',
    'chat': "USER: I am looking for a book but I can't remember the title. The author's name is George Orwell.\n\n\n"
    'ASSISTANT: <functioncall> {"name": "search_books", "arguments": \'{"query": "", "author": "George Orwell"}\'} <|endoftext|>\n\n\n'
    'FUNCTION RESPONSE: {"results": [{"title": "1984", "author": "George Orwell"}, {"title": "Animal Farm", "author": "George Orwell"}, '
    '{"title": "Down and Out in Paris and London", "author": "George Orwell"}]}\n\n\n'
    'ASSISTANT: I found several books by George Orwell. Here are a few: "1984", "Animal Farm", and "Down and Out in Paris and London". <|endoftext|>\n\n\n'
    'USER: Oh yes, I was looking for Animal Farm. Thank you!\n\n\n'
    "ASSISTANT: You're welcome! If you need help with anything else, feel free to ask. <|endoftext|>\n\n\n",
}

# SWE-Gym/OpenHands-Sampled-Trajectories: first 6 messages of neulab/agent-data-protocol
# datasets/swe-gym_openhands_sampled_trajectories/sample_raw.json @d325aac; the user text and one tool output are cut short ('...').
_NULLS = dict(function_call=None, name=None, tool_call_id=None, tool_calls=None)


def _oh_call(i, args):
    return [{'function': {'arguments': args, 'name': 'str_replace_editor'}, 'id': i, 'index': None, 'type': 'function'}]


SWEGYM = {
    'instance_id': 'python__mypy-15976_0',
    'run_id': 'gpt-4o-2024-08-06_maxiter_50_N_v2.1-no-hint-train-t0-run_1',
    'resolved': True,
    'messages': [
        {
            **_NULLS,
            'role': 'system',
            'content': "You are a helpful assistant that can interact with a computer to solve tasks.\n<IMPORTANT>\n* If user provides a path, you should NOT assume it's relative to the current working directory. Instead, you should explore the file system to find the file before working on it.\n</IMPORTANT>\n",
        },
        {
            **_NULLS,
            'role': 'user',
            'content': "<uploaded_files>\n/workspace/python__mypy__1.6\n</uploaded_files>\nI've uploaded a python code repository in the directory python__mypy__1.6. ...",
        },
        {
            **_NULLS,
            'role': 'assistant',
            'content': '',
            'tool_calls': _oh_call(
                'call_wmUMCvkWsBrXZdFlTSwE3sy6',
                '{"command":"view","path":"/workspace/python__mypy__1.6","view_range":[0,-1]}',
            ),
        },
        {
            **_NULLS,
            'role': 'tool',
            'content': 'OBSERVATION:\nERROR:\nThe `view_range` parameter is not allowed when `path` points to a directory.',
            'name': 'str_replace_editor',
            'tool_call_id': 'call_wmUMCvkWsBrXZdFlTSwE3sy6',
        },
        {
            **_NULLS,
            'role': 'assistant',
            'content': '',
            'tool_calls': _oh_call(
                'call_RyjOIhypBU1dTaTR17FNe4qQ', '{"command":"view","path":"/workspace/python__mypy__1.6"}'
            ),
        },
        {
            **_NULLS,
            'role': 'tool',
            'content': "OBSERVATION:\nHere's the files and directories up to 2 levels deep in /workspace/python__mypy__1.6, excluding hidden items:\n/workspace/python__mypy__1.6",
            'name': 'str_replace_editor',
            'tool_call_id': 'call_RyjOIhypBU1dTaTR17FNe4qQ',
        },
    ],
}

# nebius/SWE-agent-trajectories: first 5 turns of neulab/agent-data-protocol datasets/nebius_SWE-agent-trajectories/sample_raw.json
# (commit 0025c7d); the system prompt and the issue text are cut short ('...').
NEBIUS = {
    'instance_id': 'marshmallow-code__apispec-382',
    'model_name': 'swe-agent-llama-70b',
    'target': False,
    'trajectory': [
        {
            'cutoff_date': '01.01.2023',
            'mask': False,
            'role': 'system',
            'system_prompt': "SETTING: You are an autonomous programmer, and you're working directly in the command line with a special interface. ...",
            'text': None,
        },
        {
            'cutoff_date': None,
            'mask': False,
            'role': 'user',
            'system_prompt': None,
            'text': "We're currently solving the following issue within our repository. Here's the issue text:\nISSUE:\nAdd support for `summary` and `description` fields for paths ...",
        },
        {
            'cutoff_date': None,
            'mask': True,
            'role': 'ai',
            'system_prompt': None,
            'text': 'First, let\'s locate the file where paths are defined. It is likely to be in a file related to OpenAPI or Swagger specifications. We can start by searching for the term "paths" in the `src` directory to find the relevant file.\n```\nsearch_dir "paths" src\n```',
        },
        {
            'cutoff_date': None,
            'mask': False,
            'role': 'user',
            'system_prompt': None,
            'text': 'Directory src not found\n\n(Open file: n/a)\n(Current directory: /apispec)\nbash-$',
        },
        {
            'cutoff_date': None,
            'mask': True,
            'role': 'ai',
            'system_prompt': None,
            'text': "It seems the `src` directory does not exist. Let's list the contents of the current directory to identify where the paths might be defined.\n```\nls -F\n```",
        },
    ],
}


def run(name, rec, kind=None):
    "Apply adapter `name`; the conversation, or the Reject reason as a str"
    f = ADAPTERS[name]
    try:
        return f(rec, 'ds', 0, kind or f.default_kind)
    except Reject as e:
        return str(e)


def calls_of(c):
    return [tc for m in c['messages'] for tc in (m['tool_calls'] or [])]


def check_links(c):
    "Every call id is `functions.NAME:IDX` with a conversation-wide counter; every tool message answers an earlier call by id and name"
    seen = {}
    for m in c['messages']:
        for tc in m['tool_calls'] or []:
            assert tc['id'] == f"functions.{tc['function']['name']}:{len(seen)}" and isinstance(
                tc['function']['arguments'], dict
            )
            seen[tc['id']] = tc['function']['name']
        if m['role'] == 'tool':
            assert seen.get(m['tool_call_id']) == m['name'], m


# ---------------------------------------------------------------- fixtures, field by field
# Counts per source (read / kept / rejected): every record below is kept.
COUNTS = {}


def test_sweagent_function_calling_simple():
    raw = load('sweagent_function_calling_simple.traj')
    c = run('sweagent_traj', raw)
    assert isinstance(c, dict), c
    ms, hist = c['messages'], raw['history']
    assert [m['role'] for m in ms] == ['system', 'user'] + ['assistant', 'tool'] * 5
    assert [m['content'] for m in ms] == [h['content'] for h in hist]  # content verbatim, \r\n included
    assert all(m['reasoning_content'] is None for m in ms)
    assert [(t['id'], t['function']['arguments']) for t in calls_of(c)] == [
        ('functions.find_file:0', {'file_name': 'missing_colon.py'}),
        ('functions.open:1', {'path': 'tests/missing_colon.py'}),
        (
            'functions.edit:2',
            {
                'search': 'def division(a: float, b: float) -> float',
                'replace': 'def division(a: float, b: float) -> float:',
            },
        ),
        ('functions.bash:3', {'command': 'python tests/missing_colon.py'}),
        ('functions.submit:4', {}),
    ]
    assert [(m['tool_call_id'], m['name']) for m in ms if m['role'] == 'tool'] == [
        ('functions.find_file:0', 'find_file'),
        ('functions.open:1', 'open'),
        ('functions.edit:2', 'edit'),
        ('functions.bash:3', 'bash'),
        ('functions.submit:4', 'submit'),
    ]
    assert (c['kind'], c['tools'], c['meta']) == ('full', [], {})
    check_links(c)


def test_sweagent_test_repo_default():
    raw = load('sweagent_test_repo_default.traj')
    c = run('sweagent_traj', raw)
    assert isinstance(c, dict), c
    ms = c['messages']
    assert [m['role'] for m in ms] == ['system', 'user'] + ['assistant', 'tool'] * 4
    assert [m['content'] for m in ms] == [h['content'] for h in raw['history']]
    assert [t['id'] for t in calls_of(c)] == [
        'functions.find_file:0',
        'functions.open:1',
        'functions.edit:2',
        'functions.bash:3',
    ]
    assert calls_of(c)[2]['function']['arguments']['replace-all'] is False
    assert c['meta'] == {'exit_status': 'submitted'}
    check_links(c)


def test_sweagent_docs_step_format():
    "The step format documented in sweagent_docs_trajectories.md (no `history`): read from the last step's `query` + `response`"
    doc = (FIX / 'sweagent_docs_trajectories.md').read_text()
    assert all(k in doc for k in ('"response"', '"thought"', '"action"', '"observation"', '"query"'))
    step = {
        'response': 'We are indeed seeing the same output as the issue.',
        'thought': 'We are indeed seeing the same output as the issue.',
        'action': 'ls -F\n',
        'observation': 'AUTHORS.rst\nCHANGELOG.rst',
        'state': '{"open_file": "n/a"}',
        'query': [
            {'role': 'system', 'content': 'You are a helpful assistant ...'},
            {'role': 'user', 'content': 'ISSUE ...'},
        ],
    }
    c = run('sweagent_traj', {'trajectory': [step]})
    assert [(m['role'], m['content']) for m in c['messages']] == [
        ('system', 'You are a helpful assistant ...'),
        ('user', 'ISSUE ...'),
        ('assistant', 'We are indeed seeing the same output as the issue.'),
    ]


def test_xlam_card_example():
    rows = load('xlam_function_calling_60k.card_example.json')
    out = [run('xlam', r) for r in rows]
    assert len(rows) == 1 and all(isinstance(c, dict) for c in out), out
    c = out[0]
    assert [(m['role'], m['content']) for m in c['messages']] == [
        ('user', 'Where can I find live giveaways for beta access and games?'),
        ('assistant', ''),
    ]
    assert [(t['id'], t['function']['name'], t['function']['arguments']) for t in calls_of(c)] == [
        ('functions.live_giveaways_by_type:0', 'live_giveaways_by_type', {'type': 'beta'}),
        ('functions.live_giveaways_by_type:1', 'live_giveaways_by_type', {'type': 'game'}),
    ]
    assert c['tools'] == [
        {
            'type': 'function',
            'function': {
                'name': 'live_giveaways_by_type',
                'description': 'Retrieve live giveaways from the GamerPower API based on the specified type.',
                'parameters': {
                    'type': 'object',
                    'required': ['type'],
                    'properties': {
                        'type': {
                            'type': 'string',
                            'description': 'The type of giveaways to retrieve (e.g., game, loot, beta).',
                            'default': 'game',
                        }
                    },
                },
            },
        }
    ]
    assert c['kind'] == 'full'
    check_links(c)


@pytest.mark.parametrize('name,kind', [('hermes', 'full'), ('hermes_kimi_traces', 'native')])
def test_hermes_agent_doc_example(name, kind):
    rows = load('hermes_agent_trajectory.doc_example.json')
    out = [run(name, r) for r in rows]
    assert len(rows) == 1 and all(isinstance(c, dict) for c in out), out
    c = out[0]
    assert c['kind'] == kind
    assert [(m['role'], m['reasoning_content'], m['content']) for m in c['messages']] == [
        ('user', None, 'What Python version is installed?'),
        ('assistant', 'The user wants to know the Python version. I should run python3 --version.', ''),
        ('tool', None, 'Python 3.11.6'),
        ('assistant', 'Got the version. I can now answer the user.', 'Python 3.11.6 is installed on this system.'),
    ]
    assert [(t['id'], t['function']['arguments']) for t in calls_of(c)] == [
        ('functions.terminal:0', {'command': 'python3 --version'})
    ]
    assert (c['messages'][2]['tool_call_id'], c['messages'][2]['name']) == ('functions.terminal:0', 'terminal')
    assert c['tools'] == [
        {
            'type': 'function',
            'function': {
                'name': 'terminal',
                'description': 'Execute shell commands',
                'parameters': {'type': 'object', 'properties': {'command': {'type': 'string'}}},
                'required': None,
            },
        }
    ]
    assert c['meta'] == {'model': 'anthropic/claude-sonnet-4.6', 'completed': True, 'system_prompt_dropped': True}
    check_links(c)


def test_glaive_raw_record():
    c = run('glaive', GLAIVE_RAW)
    assert isinstance(c, dict), c
    ms = c['messages']
    assert [m['role'] for m in ms] == ['system', 'user', 'assistant', 'tool', 'assistant', 'user', 'assistant']
    assert (
        ms[0]['content'] == 'You are a helpful assistant with access to the following functions. Use them if required -'
    )
    assert (
        ms[1]['content']
        == "I am looking for a book but I can't remember the title. The author's name is George Orwell."
    )
    assert (ms[2]['content'], calls_of(c)) == (
        '',
        [
            {
                'id': 'functions.search_books:0',
                'type': 'function',
                'function': {'name': 'search_books', 'arguments': {'query': '', 'author': 'George Orwell'}},
            }
        ],
    )
    assert (ms[3]['tool_call_id'], ms[3]['name']) == ('functions.search_books:0', 'search_books')
    assert json.loads(ms[3]['content'])['results'][1]['title'] == 'Animal Farm'
    assert ms[4]['content'].endswith('"Down and Out in Paris and London".') and '<|endoftext|>' not in ms[6]['content']
    assert ms[6]['content'] == "You're welcome! If you need help with anything else, feel free to ask."
    assert [t['function']['name'] for t in c['tools']] == ['search_books', 'calculate_tip']
    assert c['tools'][1]['function']['parameters']['required'] == ['bill_amount', 'tip_percentage']
    check_links(c)


def test_glaive_documented_pitfalls():
    "Shapes named in dataset_schemas.json (no fixture): no functions at all; a call with no FUNCTION RESPONSE after it"
    c = run(
        'glaive',
        {
            'system': 'SYSTEM: You are a helpful assistant, with no access to external functions.',
            'chat': 'USER: Hi\n\n\nASSISTANT: Hello! <|endoftext|>\n\n\n',
        },
    )
    assert ([(m['role'], m['content']) for m in c['messages']], c['tools']) == (
        [
            ('system', 'You are a helpful assistant, with no access to external functions.'),
            ('user', 'Hi'),
            ('assistant', 'Hello!'),
        ],
        [],
    )
    c = run('glaive', {**GLAIVE_RAW, 'chat': GLAIVE_RAW['chat'].split('\n\n\nFUNCTION RESPONSE')[0]})
    assert [m['role'] for m in c['messages']] == ['system', 'user', 'assistant'] and len(calls_of(c)) == 1
    bad = GLAIVE_RAW['chat'].replace(
        '\'{"query": "", "author": "George Orwell"}\'', '\'{"query": "", author: "George Orwell"}\''
    )
    assert run('glaive', {**GLAIVE_RAW, 'chat': bad}) == 'tool call arguments are not valid JSON'  # never guessed


def test_hermes_function_calling_v1_shape():
    "hermes-function-calling-v1 as documented in dataset_schemas.json (no fixture): Python-repr tools and calls, named responses"
    rec = {
        'id': 'x1',
        'category': 'Finance',
        'subcategory': 'Stocks',
        'task': 'quote',
        'conversations': [
            {
                'from': 'system',
                'value': "You are a function calling AI model. You are provided with function signatures within <tools></tools> XML tags. "
                "Here are the available tools: <tools> [{'type': 'function', 'function': {'name': 'get_stock_price', 'description': 'Price', "
                "'parameters': {'type': 'object', 'properties': {'symbol': {'type': 'string'}}, 'required': ['symbol']}}}] </tools> "
                "For each function call return a json object within <tool_call></tool_call> XML tags:\n<tool_call>\n{'arguments': <args-dict>, 'name': <function-name>}\n</tool_call>",
            },
            {'from': 'human', 'value': 'Price of AAPL and MSFT?'},
            {
                'from': 'gpt',
                'value': "<tool_call>\n{'arguments': {'symbol': 'AAPL'}, 'name': 'get_stock_price'}\n</tool_call>\n<tool_call>\n{'arguments': {'symbol': 'MSFT'}, 'name': 'get_stock_price'}\n</tool_call>",
            },
            {
                'from': 'tool',
                'value': '<tool_response>\n{"name": "get_stock_price", "content": {"symbol": "AAPL", "price": 150.0}}\n</tool_response>\n'
                '<tool_response>\n{"name": "get_stock_price", "content": {"symbol": "MSFT", "price": 300.0}}\n</tool_response>',
            },
            {'from': 'gpt', 'value': 'AAPL is $150, MSFT is $300.'},
        ],
    }
    c = run('hermes', rec)
    assert [m['role'] for m in c['messages']] == ['user', 'assistant', 'tool', 'tool', 'assistant']
    assert [(t['id'], t['function']['arguments']) for t in calls_of(c)] == [
        ('functions.get_stock_price:0', {'symbol': 'AAPL'}),
        ('functions.get_stock_price:1', {'symbol': 'MSFT'}),
    ]
    assert [(m['tool_call_id'], json.loads(m['content'])['symbol']) for m in c['messages'][2:4]] == [
        ('functions.get_stock_price:0', 'AAPL'),
        ('functions.get_stock_price:1', 'MSFT'),
    ]
    assert c['tools'][0]['function']['parameters']['required'] == ['symbol'] and c['meta']['system_prompt_dropped']
    assert run('hermes_kimi_traces', rec) == 'native trace turn without a <think> block'
    check_links(c)


def test_openhands_swegym_record():
    c = run('openhands', SWEGYM)
    assert isinstance(c, dict), c
    ms = c['messages']
    assert [m['role'] for m in ms] == ['system', 'user', 'assistant', 'tool', 'assistant', 'tool']
    assert [t['function']['arguments'] for t in calls_of(c)] == [
        {'command': 'view', 'path': '/workspace/python__mypy__1.6', 'view_range': [0, -1]},
        {'command': 'view', 'path': '/workspace/python__mypy__1.6'},
    ]
    assert [(m['tool_call_id'], m['name']) for m in ms if m['role'] == 'tool'] == [
        ('functions.str_replace_editor:0', 'str_replace_editor'),
        ('functions.str_replace_editor:1', 'str_replace_editor'),
    ]
    assert ms[3]['content'].startswith('OBSERVATION:\nERROR:')  # kept as the agent showed it
    assert c['meta'] == {'instance_id': 'python__mypy-15976_0', 'run_id': SWEGYM['run_id'], 'resolved': True}
    check_links(c)


def test_openhands_swe_rebench_shape():
    "SWE-rebench / SWE-Zero shape (per dataset_schemas.json): `trajectory`, arguments as an object, a `tools` column"
    tools = [
        {
            'type': 'function',
            'function': {
                'name': 'execute_bash',
                'parameters': {'type': 'object', 'properties': {'command': {'type': 'string'}}},
            },
        }
    ]
    rec = {
        'trajectory_id': 't-1',
        'instance_id': 'a__b-1',
        'repo': 'a/b',
        'tools': tools,
        'resolved': 1,
        'trajectory': [
            {'role': 'system', 'content': 'S', 'name': None, 'tool_call_id': None, 'tool_calls': None},
            {'role': 'user', 'content': 'Fix it', 'name': None, 'tool_call_id': None, 'tool_calls': None},
            {
                'role': 'assistant',
                'content': 'Looking.',
                'name': None,
                'tool_call_id': None,
                'tool_calls': [
                    {
                        'function': {'name': 'execute_bash', 'arguments': {'command': 'ls'}},
                        'type': 'function',
                        'id': 'toolu_1',
                        'index': 0,
                    }
                ],
            },
            {
                'role': 'tool',
                'content': 'OBSERVATION:\na.py',
                'name': 'execute_bash',
                'tool_call_id': 'toolu_1',
                'tool_calls': None,
            },
        ],
    }
    c = run('openhands', rec)
    assert (c['tools'], c['sample_id'] == run('openhands', rec)['sample_id']) == (tools, True)
    assert (
        calls_of(c)[0]['function']['arguments'] == {'command': 'ls'}
        and c['messages'][3]['tool_call_id'] == 'functions.execute_bash:0'
    )
    check_links(c)


def test_nebius_record():
    c = run('nebius_swe_agent', NEBIUS)
    assert isinstance(c, dict), c
    ms = c['messages']
    assert [m['role'] for m in ms] == ['system', 'user', 'assistant', 'user', 'assistant']
    assert ms[0]['content'] == NEBIUS['trajectory'][0]['system_prompt']
    assert [m['content'] for m in ms[1:]] == [t['text'] for t in NEBIUS['trajectory'][1:]]
    assert all(m['tool_calls'] is None and m['reasoning_content'] is None for m in ms)
    assert c['meta'] == {
        'instance_id': 'marshmallow-code__apispec-382',
        'model_name': 'swe-agent-llama-70b',
        'target': False,
    }


SOURCES = {  # adapter -> real records (read from tests/fixtures, or embedded above)
    'sweagent_traj': [load('sweagent_function_calling_simple.traj'), load('sweagent_test_repo_default.traj')],
    'xlam': load('xlam_function_calling_60k.card_example.json'),
    'hermes': load('hermes_agent_trajectory.doc_example.json'),
    'hermes_kimi_traces': load('hermes_agent_trajectory.doc_example.json'),
    'glaive': [GLAIVE_RAW],
    'openhands': [SWEGYM],
    'nebius_swe_agent': [NEBIUS],
}


@pytest.mark.parametrize('name', NAMES)
def test_counts(name):
    "read / kept / rejected over every real record of each format: all kept"
    out = [run(name, r) for r in SOURCES[name]]
    kept = sum(isinstance(c, dict) for c in out)
    assert (len(out), kept, len(out) - kept) == (len(SOURCES[name]), len(SOURCES[name]), 0), out


def test_wrong_format_rejects_cleanly():
    "Every real record through every other adapter: a Reject with a reason, never a crash"
    for name in NAMES:
        for other, recs in SOURCES.items():
            if ADAPTERS[other] is ADAPTERS[name] or {name, other} == {'hermes', 'hermes_kimi_traces'}:
                continue
            for r in recs:
                out = run(name, r)
                assert isinstance(out, str) and out.strip(), (name, other, out)


# ---------------------------------------------------------------- malformed records (hypothesis)
TOKENS = [
    '<think>',
    '</think>',
    '<tool_call>',
    '</tool_call>',
    '<tool_response>',
    '</tool_response>',
    '<tools>',
    '</tools>',
    '<functioncall>',
    '<|endoftext|>',
    '\n\n\nUSER:',
    '\n\n\nASSISTANT:',
    '\n\n\nFUNCTION RESPONSE:',
    'OBSERVATION:\n',
    "'",
    '"',
    '{',
    '}',
    '[',
    ']',
    '\\',
    'List[',
    'str, optional',
    'Optional[',
    'null',
    '1' * 5000,
    'SYSTEM:',
    '{"name": "f", "arguments": {}}',
    "{'name': 'f', 'arguments': {}}",
    '{"name": "f", "arguments": \'{"a": 1}\'}',
]
KEYS = [
    'role',
    'content',
    'from',
    'value',
    'text',
    'system_prompt',
    'tool_calls',
    'tool_call_id',
    'tool_call_ids',
    'function',
    'name',
    'arguments',
    'type',
    'id',
    'history',
    'trajectory',
    'messages',
    'conversations',
    'tools',
    'query',
    'answers',
    'system',
    'chat',
    'parameters',
    'description',
    'thinking_blocks',
    'reasoning_content',
    'function_call',
    'response',
    'info',
]
leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    st.sampled_from(TOKENS),
    st.sampled_from(['system', 'user', 'assistant', 'tool', 'ai', 'gpt', 'human', 'function']),
)
json_val = st.recursive(
    leaf,
    lambda ch: st.one_of(
        st.lists(ch, max_size=4), st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=6)), ch, max_size=5)
    ),
    max_leaves=16,
)


def _slots(o, out):
    "Every (container, key) inside `o`"
    items = o.items() if isinstance(o, dict) else enumerate(o) if isinstance(o, list) else ()
    for k, v in items:
        out.append((o, k))
        _slots(v, out)
    return out


@st.composite
def mutated(draw, seeds):
    "A seed record with 1-4 random edits: replace a value, delete a key, splice a format token into a string, truncate a string"
    rec = copy.deepcopy(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(1, 4))):
        slots = _slots(rec, [])
        if not slots:
            break
        parent, k = draw(st.sampled_from(slots))
        v, op = parent[k], draw(st.sampled_from(['replace', 'delete', 'splice', 'truncate']))
        if op == 'replace':
            parent[k] = draw(json_val)
        elif op == 'delete':
            del parent[k]
        elif isinstance(v, str):
            i = draw(st.integers(0, len(v)))
            parent[k] = v[:i] + draw(st.sampled_from(TOKENS)) + v[i:] if op == 'splice' else v[:i]
    return rec


def _small(o, n=300):
    "A copy of `o` with long strings cut (keeps mutation fast on big .traj files)"
    if isinstance(o, str):
        return o[:n]
    if isinstance(o, list):
        return [_small(v, n) for v in o]
    return {k: _small(v, n) for k, v in o.items()} if isinstance(o, dict) else o


XLAM_PARSED = [{**r, 'tools': json.loads(r['tools']), 'answers': json.loads(r['answers'])} for r in SOURCES['xlam']]
SEEDS = {n: [_small(r) for r in recs] for n, recs in SOURCES.items()}
SEEDS['xlam'] += XLAM_PARSED  # parsed lists too, so mutations reach inside tools and answers
SEEDS['openhands'] += [SWEGYM | {'messages': None, 'trajectory': SWEGYM['messages']}]
SEEDS['sweagent_traj'] += [{'trajectory': [{'response': 'r', 'query': [{'role': 'user', 'content': 'q'}]}]}]


def check_valid(c, kind):
    "Invariants of a kept conversation"
    assert set(c) == {'sample_id', 'dataset', 'source_index', 'kind', 'tools', 'messages', 'license', 'meta'}
    assert c['kind'] == kind in KINDS and isinstance(c['tools'], list) and isinstance(c['meta'], dict)
    roles = [m['role'] for m in c['messages']]
    assert set(roles) <= set(ROLES) and 'user' in roles and (kind == 'prompt_only' or 'assistant' in roles)
    seen = {}
    for m in c['messages']:
        assert isinstance(m['content'], str) and (
            m['reasoning_content'] is None or isinstance(m['reasoning_content'], str)
        )
        for tc in m['tool_calls'] or []:
            assert m['role'] == 'assistant' and isinstance(tc['function']['arguments'], dict)
            assert tc['id'] == f"functions.{tc['function']['name']}:{len(seen)}"
            seen[tc['id']] = tc['function']['name']
        if m['role'] == 'tool':
            assert m['tool_call_id'] in seen and isinstance(m['name'], str)
    assert from_record(json.loads(json.dumps(to_record(c)))) == c  # serialises losslessly


@pytest.mark.parametrize('name', NAMES)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_malformed_records(name, data):
    "Random JSON, mutated real records: each kept as a valid conversation or rejected with a reason, the same each time"
    recs = data.draw(st.lists(st.one_of(json_val, mutated(SEEDS[name])), min_size=1, max_size=3))
    kind = ADAPTERS[name].default_kind
    for r in recs:
        before = copy.deepcopy(r)
        c = run(name, r, kind)  # any exception but Reject fails the test: kept + rejected = read
        if isinstance(c, str):
            assert c.strip() and '\n' not in c, c
        else:
            check_valid(c, kind)
        assert repr(r) == repr(before), 'the adapter changed its input'  # repr: NaN equals itself
        assert repr(run(name, before, kind)) == repr(c), 'a second read of the same record differs'
