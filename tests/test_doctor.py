"doctor: one good toy export passes; each known silent-failure class, planted in a copy, is caught by exactly its check"

import http.server, json, shutil, shlex, threading
import pytest, torch
from safetensors.torch import load_file, save_file
from eagle3nb.export import launch_commands
from eagle3nb.engine_args import launch_of, parse_launches, parse_wanted
from eagle3nb.doctor import (
    CHECKS,
    RECORD,
    DoctorError,
    doctor,
    doctor_cli,
    read_server_args,
    server_args_from_url,
    toy_export,
)


@pytest.fixture(scope='module')
def good(kimi_tiny, tmp_path_factory):
    "One good export of a perturbed ('trained') draft for kimi-tiny, with its training record"
    return toy_export(kimi_tiny, tmp_path_factory.mktemp('doctor') / 'good')


def sglang_cmd(target, draft, alg='EAGLE3'):
    return (
        f'python -m sglang.launch_server --model-path {shlex.quote(str(target))} --speculative-algorithm {alg} '
        f'--speculative-draft-model-path {shlex.quote(str(draft))} --speculative-num-steps 3 --speculative-eagle-topk 1 '
        f'--speculative-num-draft-tokens 4 --tp 1 --trust-remote-code'
    )


def vllm_cmd(target, draft, method='eagle3'):
    sc = json.dumps(dict(method=method, model=str(draft), num_speculative_tokens=3))
    return f'vllm serve {shlex.quote(str(target))} --tensor-parallel-size 1 --trust-remote-code --speculative-config {shlex.quote(sc)}'


class FakeServer:
    "Loopback HTTP server: GET /get_server_info answers `info` (None: 404 everywhere, like vLLM)"

    def __init__(self, info):
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                ok = info is not None and self.path == '/get_server_info'
                body = json.dumps(info).encode() if ok else b'{"detail":"Not Found"}'
                self.send_response(200 if ok else 404)
                self.send_header('Content-Length', str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.srv = http.server.ThreadingHTTPServer(('127.0.0.1', 0), H)
        self.url = f'http://127.0.0.1:{self.srv.server_address[1]}'

    def __enter__(self):
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *a):
        self.srv.shutdown()
        self.srv.server_close()


def sglang_info(target, draft, alg='EAGLE3'):
    return dict(
        model_path=str(target),
        speculative_algorithm=alg,
        speculative_draft_model_path=str(draft),
        tp_size=1,
        internal_states=[{}],
        version='0.5.0',
    )


def copy_of(good, tmp_path, config=None, tensors=None, record=None):
    "A copy of the good export with config.json / the tensors / the record edited by the given functions"
    d = tmp_path / 'export'
    shutil.copytree(good, d)
    for fn, f in ((config, 'config.json'), (record, RECORD)):
        if fn:
            c = json.loads((d / f).read_text())
            fn(c)
            (d / f).write_text(json.dumps(c))
    if tensors:
        w = load_file(str(d / 'model.safetensors'))
        tensors(w)
        save_file(w, str(d / 'model.safetensors'))
    return d


def test_good_export_passes(good, kimi_tiny, tmp_path, capsys):
    cmds = [sglang_cmd(kimi_tiny, good), vllm_cmd(kimi_tiny, good), *launch_commands(good, kimi_tiny, tp=8).values()]
    parse_launches(cmds)  # each engine's parser once for the four lines, side by side; the rows below reuse it
    for cmd in cmds:
        f = tmp_path / 'launch.sh'
        f.write_text(f'#!/bin/bash\nset -e\n{cmd}\n')
        df = doctor(good, kimi_tiny, server_args=f)
        args = 'ok' if parse_wanted(launch_of(cmd)['engine']) else 'n/a'  # the engine's parser, where it is here
        want = ['ok', args] + ['ok'] * (len(CHECKS) - 4) + ['n/a'] * 2  # engine, render parity: not asked
        assert list(df.check) == list(CHECKS) and list(df.status) == want, df.to_dict('records')
        assert doctor_cli(good, kimi_tiny, server_args=str(f), engine=False) == 0
    assert capsys.readouterr().out.strip().endswith(f"doctor: all checks passed ({2 + (args == 'n/a')} n/a)")
    assert doctor_cli(good, kimi_tiny, engine=False) == 0
    out = capsys.readouterr().out
    assert (
        out.strip().endswith('doctor: all checks passed (4 n/a)') and 'give --server-args FILE or --server URL' in out
    )
    with FakeServer(sglang_info(kimi_tiny, good)) as s:
        assert doctor_cli(good, kimi_tiny, server=s.url + "/v1", engine=False) == 0
        row = doctor(good, kimi_tiny, server=s.url + '/v1').set_index('check').loc['render_parity']
    assert row.status == 'n/a' and row.detail.startswith('render parity not checked:'), row  # no POST /tokenize there


def test_server_args_forms(good, kimi_tiny):
    multi = sglang_cmd(kimi_tiny, good).replace(' --speculative', ' \\\n    --speculative').replace('--tp 1', '--tp=1')
    a = read_server_args(multi)
    assert (a['engine'], a['algorithm'], a['draft_path'], a['target_path']) == (
        'sglang',
        'EAGLE3',
        str(good),
        str(kimi_tiny),
    )
    assert a['raw']['tp'] == '1' and a['raw']['trust_remote_code'] is True
    a = read_server_args(vllm_cmd(kimi_tiny, good).replace('--speculative-config', '--speculative_config'))
    assert (a['engine'], a['algorithm'], a['draft_path'], a['target_path']) == (
        'vllm',
        'eagle3',
        str(good),
        str(kimi_tiny),
    )
    a = read_server_args(json.dumps(sglang_info(kimi_tiny, good, 'EAGLE')))
    assert (a['engine'], a['algorithm']) == ('sglang', 'EAGLE')
    with pytest.raises(DoctorError, match='no `python -m sglang.launch_server'):
        read_server_args('#!/bin/sh\necho hi\n')
    with FakeServer(None) as s:
        with pytest.raises(DoctorError, match='vLLM has no such endpoint'):
            server_args_from_url(s.url)


def _shift(key):
    def f(c):
        d = c if key == 'vllm' else c['eagle_config']
        d['eagle_aux_hidden_state_layer_ids'] = [k + 1 for k in d['eagle_aux_hidden_state_layer_ids']]

    return f


def _lm_default_init(w):
    w['lm_head.weight'] = (
        torch.nn.Linear(w['lm_head.weight'].shape[1], w['lm_head.weight'].shape[0], bias=False)
        .weight.detach()
        .bfloat16()
    )


def _t2d_extra(w):
    w['t2d'][(~w['t2d']).nonzero()[0]] = True


def _d2t_out_of_range(w):
    w['d2t'][-1] += 100_000


def _d2t_swap(w):
    d = w['d2t'].clone()
    w['d2t'][3], w['d2t'][4] = d[4] + 1, d[3] - 1  # target ids of draft 3 and 4 swap places


def _drop_think(w, tid=3862, spare=3861):  # <think> out of the draft vocab, an unused id in; maps stay consistent
    t = torch.arange(len(w['d2t'])) + w['d2t']
    assert tid in t and spare not in t
    t[t == tid] = spare
    t = t.sort().values
    w['d2t'] = t - torch.arange(len(t))
    w['t2d'] = torch.zeros_like(w['t2d'])
    w['t2d'][t] = True


def _full_with_maps(w):  # a full-vocabulary draft that still carries (identity) maps, as exports did before
    w.update(
        {
            'lm_head.weight': torch.randn(4096, 64).bfloat16(),
            'd2t': torch.zeros(4096, dtype=torch.long),
            't2d': torch.ones(4096, dtype=torch.bool),
        }
    )


# name: (how to plant it: kwargs of copy_of, plus server args), the check that must fail, words its FAIL row must hold,
# and the other checks that fail too as a consequence
PLANTS = {
    'eagle_sglang_cmd': (
        dict(cmd=lambda t, d: sglang_cmd(t, d, 'EAGLE')),
        'speculative_algorithm',
        "not EAGLE3: the draft gets the 64-dim final state instead of the 192-dim concat of 3 aux layers: zero acceptance",
        set(),
    ),
    'eagle_server_info': (
        dict(info=lambda t, d: sglang_info(t, d, 'EAGLE')),
        'speculative_algorithm',
        "64-dim final state instead of the 192-dim concat",
        set(),
    ),
    'eagle_vllm_method': (
        dict(cmd=lambda t, d: vllm_cmd(t, d, 'eagle')),
        'speculative_algorithm',
        "'eagle', not EAGLE3",
        set(),
    ),
    'vllm_server_url': (
        dict(info=None),
        'speculative_algorithm',
        'vLLM has no such endpoint, so pass --server-args FILE',
        set(),
    ),
    'other_draft_served': (
        dict(cmd=lambda t, d: sglang_cmd(t, '/srv/other-draft')),
        'speculative_algorithm',
        'not this export',
        set(),
    ),
    'fc_width_2x': (
        dict(tensors=lambda w: w.update({'fc.weight': w['fc.weight'][:, :128].contiguous()})),
        'fc_width',
        'reads 2 x the target hidden size 64',
        set(),
    ),
    'draft_narrower': (
        dict(
            config=lambda c: c.update(hidden_size=32),
            tensors=lambda w: w.update({'fc.weight': w['fc.weight'][:32].contiguous()}),
        ),
        'fc_width',
        "the draft is 32 wide but the target is 64",
        {'lm_head', 'vocab_size'},
    ),
    'head_dim_16': (
        dict(config=lambda c: c.update(head_dim=16)),
        'head_dim',
        "head size is 16, which vLLM's CPU attention does not run",
        set(),
    ),
    'full_vocab_maps': (
        dict(
            config=lambda c: c.update(draft_vocab_size=4096),
            record=lambda r: r.update(draft_vocab_size=4096),
            tensors=_full_with_maps,
        ),
        'vocab_maps',
        "covers the whole vocabulary (draft_vocab_size = vocab_size = 4096) but model.safetensors has d2t and t2d",
        set(),
    ),
    'aux_vllm_shifted': (dict(config=_shift('vllm')), 'aux_layer_ids', 'off by one', set()),
    'aux_sglang_shifted': (
        dict(config=_shift('sglang')),
        'aux_layer_ids',
        'off by one: SGLang adds 1 to its ids',
        set(),
    ),
    'lm_head_removed': (dict(tensors=lambda w: w.pop('lm_head.weight')), 'lm_head', 'no lm_head.weight', set()),
    'lm_head_init': (dict(tensors=_lm_default_init), 'lm_head', 'fresh nn.Linear init', set()),
    't2d_sum': (dict(tensors=_t2d_extra), 'vocab_maps', 't2d.sum() is 257', set()),
    'd2t_out_of_range': (
        dict(tensors=_d2t_out_of_range),
        'vocab_maps',
        'map outside the target vocabulary [0, 4096)',
        {'special_tokens'},
    ),
    'd2t_not_increasing': (dict(tensors=_d2t_swap), 'vocab_maps', 'not strictly increasing', {'special_tokens'}),
    'special_dropped': (dict(tensors=_drop_think), 'special_tokens', '<think> (3862)', set()),
    'vocab_size': (
        dict(config=lambda c: c.update(vocab_size=4224)),
        'vocab_size',
        "config vocab_size is 4224, the target's vocab_size is 4096",
        {'vocab_maps'},
    ),
    'template_hash': (
        dict(record=lambda r: r.update(template_sha256=r['template_sha256'] + ['ab' * 32])),
        'chat_template',
        "rendered with chat template sha256 abababababab, but the target's template is",
        set(),
    ),
}


def _accepted(line, python=None):
    "parse_launch's answer for a line its engine accepts"
    return dict(launch_of(line), ok=True, error=None, python=python, version='any', seconds=0.0)


@pytest.mark.parametrize('name', PLANTS)
def test_plant_is_caught(name, good, kimi_tiny, tmp_path, capsys, monkeypatch):
    import eagle3nb.engine_args

    # each plant's launch line names its own copy: parsing each would cost seconds; test_engine_args parses them
    monkeypatch.setattr(eagle3nb.engine_args, 'parse_launch', _accepted)
    how, check, words, also = PLANTS[name]
    how = dict(how)
    cmd, info = how.pop('cmd', None), how.pop('info', 'none')
    d = copy_of(good, tmp_path, **how)
    kw = dict(server_args=cmd(kimi_tiny, d) if cmd else sglang_cmd(kimi_tiny, d))
    if info != 'none':
        srv = FakeServer(info(kimi_tiny, d) if info else None)
        srv.__enter__()
        kw = dict(server=srv.url)
    try:
        df = doctor(d, kimi_tiny, **kw).set_index('check')
        assert doctor_cli(d, kimi_tiny, engine=False, **kw) == 1
    finally:
        if info != 'none':
            srv.__exit__()
    assert set(df.index[df.status == 'FAIL']) == {check} | also, df.to_dict('index')
    assert words in df.detail[check], df.detail[check]
    assert f"doctor: {1 + len(also)} problem(s)" in capsys.readouterr().out


def test_lm_head_copy_of_target_rows(good, kimi_tiny, tmp_path):
    lm = load_file(str(kimi_tiny / 'model.safetensors'))['lm_head.weight']
    d = copy_of(
        good,
        tmp_path,
        tensors=lambda w: w.update({'lm_head.weight': lm[torch.arange(len(w['d2t'])) + w['d2t']].bfloat16()}),
    )
    df = doctor(d, kimi_tiny).set_index('check')
    assert (
        list(df.index[df.status == 'FAIL']) == ['lm_head']
        and "equals the target's own lm_head rows" in df.detail['lm_head']
    )


def test_broken_export_never_raises(good, kimi_tiny, tmp_path):
    d = copy_of(good, tmp_path)
    (d / 'config.json').write_text('{not json')
    (d / 'model.safetensors').unlink()
    df = doctor(d, kimi_tiny, server_args='no such file').set_index('check')
    assert (
        (df.status == 'FAIL').sum() == 11
        and 'neither a file' in df.detail['engine_args']
        and 'cannot read' in df.detail['fc_width']
        and 'cannot read' in df.detail['draft_variant']
        and 'neither a file' in df.detail['speculative_algorithm']
    )
    assert doctor_cli(d, kimi_tiny, engine=False) == 1


def test_no_training_record(good, kimi_tiny, tmp_path):
    d = copy_of(good, tmp_path)
    (d / RECORD).unlink()
    df = doctor(d, kimi_tiny).set_index('check')
    assert df.status['chat_template'] == 'n/a' and not (df.status == 'FAIL').any()
    assert (
        f"no eagle3nb.json training record in {d}: export with --data DATA_ROOT to check this"
        in df.detail['chat_template']
    )
    assert 'export with --data DATA_ROOT' in df.detail['aux_layer_ids']


def test_full_vocab_export_passes(kimi_tiny, tmp_path):
    "A draft over the whole vocabulary (4096 of 4096) exports without d2t/t2d, and doctor passes it"
    d = toy_export(kimi_tiny, tmp_path / 'full', draft_vocab=4096)
    w = load_file(str(d / 'model.safetensors'))
    assert 'd2t' not in w and 't2d' not in w and w['lm_head.weight'].shape == (4096, 64)
    df = doctor(d, kimi_tiny).set_index('check')
    assert (df.status != 'FAIL').all(), df.to_dict('index')
    assert 'carries no d2t/t2d' in df.detail['vocab_maps']


def _no_engine(*a, **k):
    return False


def test_engine_row_fails_when_an_engine_is_required_but_missing(good, kimi_tiny, monkeypatch, capsys):
    "EAGLE3NB_REQUIRE_ENGINE=1 (make test) with no vLLM: the engine row is a FAIL and the verb exits 1, never a skip"
    import eagle3nb.engine

    monkeypatch.setattr(eagle3nb.engine, 'engine_available', _no_engine)
    monkeypatch.delenv('EAGLE3NB_REQUIRE_ENGINE', raising=False)
    row = doctor(good, kimi_tiny, engine=True).set_index('check').loc['engine']
    assert row.status == 'n/a' and 'no vLLM engine here' in row.detail  # not required: nothing to say
    assert doctor_cli(good, kimi_tiny) == 0  # the CLI's default asks the row only where it can run
    monkeypatch.setenv('EAGLE3NB_REQUIRE_ENGINE', '1')
    row = doctor(good, kimi_tiny, engine=True).set_index('check').loc['engine']
    assert row.status == 'FAIL' and 'EAGLE3NB_REQUIRE_ENGINE is set' in row.detail
    capsys.readouterr()
    assert doctor_cli(good, kimi_tiny) == 1  # required: the CLI's default runs the row, and it fails
    err = capsys.readouterr().err
    assert 'eagle3nb doctor: error: engine: no vLLM engine here' in err


def test_engine_row_fails_when_vllm_refuses_the_draft(good, kimi_tiny, monkeypatch):
    "An engine that does not load the draft, or changes greedy output, is a FAIL with the reason"
    import eagle3nb.engine

    monkeypatch.setattr(eagle3nb.engine, 'engine_available', lambda *a, **k: True)
    served = dict(loaded=False, error='KeyError: midlayer.fc.weight', warnings=[])
    monkeypatch.setattr(eagle3nb.engine, 'verify_served', lambda *a, **k: served)
    row = doctor(good, kimi_tiny, engine=True).set_index('check').loc['engine']
    assert row.status == 'FAIL' and 'vLLM did not serve the draft: KeyError: midlayer.fc.weight' in row.detail
    served = dict(loaded=True, warnings=[], greedy_identical=3, accepted=5, draft_tokens=9, accept_length=1.5)
    row = doctor(good, kimi_tiny, engine=True).set_index('check').loc['engine']
    assert row.status == 'FAIL' and 'greedy output changed with the draft on 1 of 4 prompts' in row.detail


class TokenizeServer(FakeServer):
    "Loopback HTTP server whose POST /tokenize answers `fn(body)`: an engine's render, as a test decides it"

    def __init__(self, fn):
        class H(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers['Content-Length'])))
                out = json.dumps(fn(body)).encode() if self.path == '/tokenize' else b'{"detail":"Not Found"}'
                self.send_response(200 if self.path == '/tokenize' else 404)
                self.send_header('Content-Length', str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *a):
                pass

        self.srv = http.server.ThreadingHTTPServer(('127.0.0.1', 0), H)
        self.url = f'http://127.0.0.1:{self.srv.server_address[1]}'


def test_render_parity_row(good, kimi_tiny, capsys):
    "An engine that renders as the target's tokenizer does passes the row; one that adds a BOS fails it, at token 0"
    from eagle3nb.parity import tokenizer_ask
    from eagle3nb.render import load_tokenizer

    tok = load_tokenizer(kimi_tiny)
    same = tokenizer_ask(tok)
    with TokenizeServer(same) as s:
        row = doctor(good, kimi_tiny, engine_url=s.url + '/v1').set_index('check').loc['render_parity']
    assert row.status == 'ok' and row.detail.startswith('render parity: 6/6 prompts token-equal'), row.detail
    assert '(built-in probes, thinking True)' in row.detail  # the toy export's record names no rendered data
    bos = lambda body: dict(tokens=[tok.bos_token_id] + same(body)['tokens'])
    with TokenizeServer(bos) as s:
        assert doctor_cli(good, kimi_tiny, engine=False, engine_url=s.url) == 1
    err = capsys.readouterr().err
    assert 'eagle3nb doctor: error: render_parity: render parity FAILED: 0/6 prompts token-equal' in err, err
    assert "token 0 (ours" in err and "the engine '[BOS]" in err and 'To fix: render the data with' in err, err
