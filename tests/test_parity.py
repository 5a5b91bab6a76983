"""Render parity with the serving engine: vLLM (the CPU build) serves the Kimi-K2.5-packaged toy, remote-code tokenizer
and all, and renders our conversations itself (`POST /tokenize`); our rows must be its tokens, and rows made wrong on
purpose (JSON tools where the tokenizer declares TypeScript, thinking off, another template, a BOS added) must fail.

One vLLM server for the module (`--trust-remote-code --language-model-only`, as Kimi-K2.5 is served); the target
check, the generate phase's gate and the doctor row are each run against it.
"""

import copy, os
from pathlib import Path
import pytest

from eagle3nb.engine import VllmServer, engine_available
from eagle3nb.parity import (
    NotChecked,
    ParityMismatch,
    check_parity,
    check_run,
    engine_ask,
    parity_line,
    probe_conversations,
    tokenizer_ask,
)
from eagle3nb.render import load_tokenizer, render_conversations

pytestmark = pytest.mark.skipif(
    not engine_available() and not os.environ.get('EAGLE3NB_REQUIRE_ENGINE'),
    reason='no vLLM engine: run `make engine` (make test builds it and sets EAGLE3NB_REQUIRE_ENGINE=1)',
)
TOY = 'kimi-k25-tiny'


@pytest.fixture(scope='module')
def k25():
    "The kimi-k25-tiny toy: Kimi-K2.5's packaging, its remote-code tiktoken tokenizer and K2.5-style template"
    from eagle3nb.toy import ensure_toy

    d = ensure_toy(TOY)
    return d, load_tokenizer(d, trust_remote_code=True)


@pytest.fixture(scope='module')
def engine(k25, tmp_path_factory):
    "vLLM serving the toy as Kimi-K2.5 is served (its own tokenizer code), for the whole module"
    srv = VllmServer(
        k25[0],
        log_path=tmp_path_factory.mktemp('vllm') / 'server.log',
        extra=['--trust-remote-code', '--language-model-only'],
    )
    with srv:  # started and ready (a real completion) on entering, stopped on leaving
        print(f'vLLM serving {TOY}: ready in {srv.ready_s:.1f} s')
        yield srv


@pytest.fixture(scope='module')
def probes(k25):
    "The built-in probe conversations and our rows of them"
    convs = probe_conversations()
    return convs, render_conversations(convs, k25[1])


def test_our_rows_are_the_engines_tokens(k25, engine, probes):
    "Every prompt of our rows is, token for token, the tokenizer's own render and the engine's, tool-bearing ones too"
    d, tok = k25
    convs, rows = probes
    by_tok = check_parity(tokenizer_ask(tok), convs, rows, tok)
    by_engine = check_parity(engine_ask(engine.base_url), convs, rows, tok, model=engine.model)
    for res in (by_tok, by_engine):
        assert (res['status'], res['checked'], res['equal'], res['tools_checked'], res['tools_equal']) == (
            'equal',
            6,
            6,
            4,
            4,
        ), res
    print(f'ours vs the tokenizer: {parity_line(by_tok)}\nours vs the engine: {parity_line(by_engine)}')


def without_override(tok):
    "A copy of `tok` whose class lacks the tokenizer's `apply_chat_template` override: the template alone renders"
    from transformers import PreTrainedTokenizer

    plain = copy.deepcopy(tok)
    plain.__class__ = type(
        'NoOverride', (type(tok),), dict(apply_chat_template=PreTrainedTokenizer.apply_chat_template)
    )
    return plain


def other_template(tok):
    "A copy of `tok` with the template we shipped before K2.5 (Kimi-K2-Thinking's), as another template file would be"
    from eagle3nb.toy import template

    other = copy.deepcopy(tok)
    other.chat_template = template('kimi-k2-thinking.jinja')
    return other


def with_bos(rows, bos: int):
    "Our rows as a tokenizer that puts its BOS before every text leaves them: one token in front, spans shifted"
    return [dict(r, input_ids=[bos, *r['input_ids']], spans=[[s + 1, t + 1] for s, t in r['spans']]) for r in rows]


WRONG = dict(
    json_tools=(
        lambda c, tok, rows: render_conversations(c, without_override(tok)),
        '[{"type": "function"',
        '# Tools\n\n## functions',
    ),
    thinking_off=(lambda c, tok, rows: render_conversations(c, tok, thinking=False), '</think>', ''),
    other_template=(lambda c, tok, rows: render_conversations(c, other_template(tok)), '', '<think>'),
    bos_twice=(lambda c, tok, rows: with_bos(rows, tok.bos_token_id), '[BOS]<|im_system|>', '<|im_system|>'),
)


@pytest.mark.parametrize('case', list(WRONG))
def test_wrong_rows_are_caught(case, k25, engine, probes):
    "Rows made wrong on purpose differ from the engine's render, and the first difference shows what went wrong"
    _, tok = k25
    convs, rows = probes
    make, ours, theirs = WRONG[case]
    res = check_parity(engine_ask(engine.base_url), convs, make(convs, tok, rows), tok, model=engine.model)
    assert res['status'] == 'mismatch' and res['equal'] < res['checked'], res
    m = res['mismatches'][0]
    assert m['ours'].startswith(ours) and m['engine'].startswith(theirs), m
    if case == 'json_tools':  # the tool-bearing prompts, and only those, go wrong
        assert (res['equal'], res['tools_equal'], res['tools_checked']) == (2, 0, 4), res
        assert m['context'].endswith('<|im_system|>tool_declare<|im_middle|>'), m
    if case == 'bos_twice':
        assert (m['position'], m['ours_tokens'][0], m['ours_len'] - m['engine_len']) == (0, '[BOS]', 1), m
    with pytest.raises(ParityMismatch, match='render parity FAILED'):
        from eagle3nb.parity import require_parity

        require_parity(res)


def recipe(k25, engine, root: Path):
    "A recipe on the toy served by the module's engine, data under `root`"
    from eagle3nb.recipe import parse_recipe, resolve

    t = dict(model=str(k25[0]), endpoints=[engine.base_url], served_name=engine.model, trust_remote_code=True)
    return resolve(
        parse_recipe(
            dict(
                name='parity',
                target=t,
                data_root=str(root / 'data'),
                catalog=str(root / 'catalog.duckdb'),
                datasets=[dict(name='syn', format='openai', path=str(root / 'prompts.jsonl'), kind='prompt_only')],
                phases=dict(generate=dict(max_new_tokens=4)),
            )
        )
    )


def test_target_check_phase_on_vllm(k25, engine, tmp_path):
    "The target check asks the engine to render the probes (nothing prepared yet): its record counts them, all equal"
    from eagle3nb.phase import RunContext
    from eagle3nb.phases import target_check

    with RunContext.open(recipe(k25, engine, tmp_path), tmp_path / 'run') as ctx:
        rec = target_check.run(ctx, max_tokens=4)
    p = rec.parity
    assert (p['status'], p['source'], p['conversations'], p['checked'], p['tools_checked']) == (
        'equal',
        'probe',
        3,
        6,
        4,
    )
    row = [c for c in rec.checks if c['check'] == 'render parity with the engine']
    assert row and row[0]['ok'] and row[0]['observed'] == '6/6 equal (4/4 with tools)', rec.checks
    assert rec.headline().endswith('render parity: 6/6 prompts token-equal with the engine (4/4 with tools)'), (
        rec.headline()
    )


def rendered(r, thinking: bool):
    "Prepare, render (with `thinking`) and catalog the recipe's prompts, as the phases before generate leave them"
    from eagle3nb.catalog import partition, upsert_samples
    from eagle3nb.generate import write_prompts
    from eagle3nb.prepare import prepare
    from eagle3nb.render import catalog_rows, render_dataset

    root, ds = Path(r.data_root), r.datasets[0]
    if not Path(ds.path).exists():
        write_prompts(ds.path, 3)
        prepare(ds.path, ds.format, ds.name, root / 'prepared', kind=ds.kind, progress=False)
    kw = dict(thinking=thinking, num_proc=1, force=True, trust_remote_code=True)
    render_dataset(root / 'prepared' / ds.name, r.target.model, root / 'rendered' / ds.name, **kw)
    upsert_samples(r.catalog, catalog_rows(root / 'rendered' / ds.name))
    partition(r.catalog, max_ctx=256, max_new_tokens=4, long_ctx=1024, c_main=2, c_long=1)


def test_rendered_rows_gate_the_run(k25, engine, tmp_path):
    "Rows rendered with thinking off, served with it on: target check fails, generate refuses; re-rendered, both pass"
    from eagle3nb.phase import RunContext
    from eagle3nb.phases import generate, target_check
    from eagle3nb.target import TargetCheckFailed

    r = recipe(k25, engine, tmp_path)
    rendered(r, thinking=False)
    with RunContext.open(r, tmp_path / 'run') as ctx:
        with pytest.raises(
            TargetCheckFailed, match='render parity with the engine: expected every prompt token-equal, saw 0/3'
        ):
            target_check.run(ctx, max_tokens=4)
        kept = target_check.run.read(ctx.run_dir)  # the record of the failed check is kept
        assert (kept.parity['status'], kept.parity['source']) == ('mismatch', 'rendered'), kept.parity
        with pytest.raises(ParityMismatch) as e:
            generate.run(ctx, generate.Params())
        msg = str(e.value)
        assert msg.startswith(
            'render parity FAILED: 0/3 prompts token-equal with the engine (0/0 with tools); first:'
        ), msg
        assert "<think>' ours '</think>', the engine ''" in msg and 'To fix: render the data with' in msg, msg
        assert '\n' not in msg and not (Path(r.data_root) / 'generated').exists()  # one line; nothing was generated
    rendered(r, thinking=True)
    with RunContext.open(r, tmp_path / 'run2') as ctx:
        rec = generate.run(ctx, generate.Params(max_new_tokens=4))
    assert (rec.parity['status'], rec.parity['checked'], rec.summary['ok']) == ('equal', 3, 3), (
        rec.parity,
        rec.summary,
    )


def test_doctor_row_on_vllm(k25, engine, tmp_path):
    "The doctor's render_parity row asks the engine it is given; without a record of the training data, the probes"
    from eagle3nb.doctor import DraftExport, check_render_parity

    x = DraftExport(tmp_path, k25[0], trust_remote_code=True)  # the row reads only the target and the record
    (row,) = check_render_parity(x, engine.base_url)
    assert row['status'] == 'ok' and row['detail'].startswith('render parity: 6/6 prompts token-equal'), row
    x.tokenizer = without_override(k25[1])  # as if the doctor had loaded the tokenizer without its code
    (row,) = check_render_parity(x, engine.base_url)
    assert row['status'] == 'FAIL' and "the engine '# Tools" in row['detail'], row


def test_not_checked_on_transformers_serve(toy_server, kimi_tiny):
    "`transformers serve` has no /tokenize: the result says not checked, and why, and counts nothing as equal"
    from eagle3nb.phase import smoke_recipe

    tok = load_tokenizer(kimi_tiny)
    with pytest.raises(NotChecked, match='transformers serve has none'):
        engine_ask(toy_server.base_url)(dict(messages=[dict(role='user', content='hi')]))
    res = check_run(smoke_recipe(kimi_tiny.parent), toy_server.base_url, toy_server.model, tok)
    assert (res['status'], res['checked'], res['equal'], res['source']) == ('not checked', 0, 0, 'probe'), res
    assert parity_line(res).startswith('render parity not checked: ') and 'HTTP 404' in res['reason'], res
