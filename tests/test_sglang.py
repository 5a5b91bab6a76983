"""SGLang in the loop: the engine our user serves Kimi-K2.5 with serves the toy target and our exported drafts.

SGLang runs as a process from `.venv-sglang` (`make engine`); on this CPU its kernels are plain-torch stand-ins
(`eagle3nb.sglang_cpu`), so these tests check SGLang's loader, scheduler, EAGLE bookkeeping, counters and HTTP
surface, not its CPU kernels. The module's `EngineSession` starts one baseline server of the target, which every
test here shares; each verify adds one speculative server.
"""

import os
import pytest
import torch

from eagle3nb.engine import SglangServer, generate_ids, sglang_available
from eagle3nb.phase import EngineSession
from eagle3nb.verify import verify, toy_export as toy_export_

pytestmark = pytest.mark.skipif(
    not sglang_available() and not os.environ.get('EAGLE3NB_REQUIRE_ENGINE'),
    reason='no SGLang engine: run `make engine` (make test builds it and sets EAGLE3NB_REQUIRE_ENGINE=1)',
)
N_PROMPTS, MAX_TOKENS = 6, 24


@pytest.fixture(scope='module')
def qwen3(tmp_path_factory):
    "qwen3-tiny, a trained export of it, its prompts, and the module's SGLang session with its running baseline"
    from eagle3nb.toy import ensure_toy

    out = tmp_path_factory.mktemp('qwen3')
    d, prompts = toy_export_('qwen3-tiny', out, N_PROMPTS, MAX_TOKENS + 8, 150, ttt_steps=5)
    target = ensure_toy('qwen3-tiny')
    with EngineSession.of(target, log_dir=out / 'logs', engine='sglang') as es:
        base = es.baseline()  # started here, ready (a real /generate), stopped when the module ends
        yield dict(export=d, prompts=prompts, target=target, engines=es, base=base)


def test_sglang_greedy_equals_hf(qwen3):
    "SGLang's greedy ids on our token-id prompts are the HF model's own"
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(qwen3['target'], dtype=torch.float32)
    got = generate_ids(qwen3['base'].base_url, qwen3['prompts'][:3], 12)
    for p, (ids, meta) in zip(qwen3['prompts'][:3], got):
        want = m.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p) :].tolist()
        assert ids == want, (ids, want)
        assert meta['prompt_tokens'] == len(p) and meta['completion_tokens'] == 12


def test_render_parity_through_sglang_tokenize(qwen3):
    "SGLang's /tokenize renders our tool-free prompts as we do; prompts with tools are not checked, never equal"
    from eagle3nb.parity import check_parity, engine_ask, probe_conversations, tokenize_body
    from eagle3nb.render import load_tokenizer, render_conversations

    tok = load_tokenizer(qwen3['target'])
    convs = probe_conversations()
    rows = render_conversations(convs, tok, True)
    ask = engine_ask(qwen3['base'].base_url)
    res = check_parity(ask, convs, rows, tok, True)
    assert res['status'] == 'equal' and res['checked'] == res['equal'] >= 2, res
    assert res['tools_checked'] == 0 and res['not_checked'] >= 3 and 'defer_loading' in res['not_checked_reason']
    # why: SGLang hands the template each tool with a field the client never sent
    c = next(c for c in convs if c.get('tools'))
    got = ask(tokenize_body(c['messages'][:2], c['tools'], True))
    assert '"defer_loading": null' in tok.decode(got['tokens'])


def _engines_started_during(fn):  # (fn's result, command lines of engine processes that appeared meanwhile)
    "Run `fn`, watching this process's children: an engine started meanwhile shows up, whoever started it"
    import threading, time, psutil

    me, seen, done = psutil.Process(), {}, threading.Event()
    before = {c.pid for c in me.children(recursive=True)}

    def watch():
        while not done.is_set():
            for c in me.children(recursive=True):
                try:
                    cmd = ' '.join(c.cmdline())
                except psutil.Error:
                    continue
                if c.pid not in before and ('launch_server' in cmd or 'api_server' in cmd):
                    seen[c.pid] = cmd
            time.sleep(0.2)

    t = threading.Thread(target=watch)
    t.start()
    try:
        return fn(), list(seen.values())
    finally:
        done.set()
        t.join()


def test_verify_on_servers_the_user_runs(qwen3, tmp_path):
    "SGLang serves our export as EAGLE3 with launch_sglang.sh's words; verify points at it: nothing started"
    base, export = qwen3['base'], qwen3['export']
    with SglangServer(qwen3['target'], draft=export, k=3, log_path=tmp_path / 'spec.log') as spec:  # the user's
        urls = dict(baseline_url=base.base_url, speculative_url=spec.base_url)
        go = lambda: verify(export, qwen3['target'], qwen3['prompts'], MAX_TOKENS, 3, **urls)
        r, started = _engines_started_during(go)
    assert started == [], started
    assert r['loaded'] and r['started'] is False and r['engine'] == 'sglang', r.get('error')
    assert r['draft_check']['ok'] is True and 'EAGLE3' in r['draft_check']['detail'], r['draft_check']
    assert r['greedy_identical'] == N_PROMPTS and r['other_requests'] == 0, (r['identical'], r['other_requests'])
    # SGLang's own counts (response meta_info) and its /metrics over the same requests say the same
    m = r['metrics']
    assert r['drafts'] == m['rounds'] > 0 and m['requests'] == N_PROMPTS
    assert r['accept_length'] > 1.5, r['accept_length']
    assert abs(r['accept_length'] - m['accept_length']) < 0.05, (r['accept_length'], m)
    assert sum(r['accepted_per_position']) == r['accepted'] and len(r['accepted_per_position']) == 3
    assert r['offline_accept_length'] and abs(r['offline_accept_length'] - r['accept_length']) < 0.6, r
    print(f"SGLang verify: accept {r['accept_length']:.3f} (metrics {m['accept_length']:.3f}), ", end='')
    print(f"offline {r['offline_accept_length']:.3f}, SGLang's own {r['engine_accept_length']:.3f}")
    # a speculative server of another draft (here: none) is refused before anything is measured
    bad = verify(
        export, qwen3['target'], qwen3['prompts'][:1], 8, 3, baseline_url=base.base_url, speculative_url=base.base_url
    )
    assert not bad['loaded'] and 'not EAGLE3' in bad['error'], bad


def test_eagle_flag_on_sglang_serves_our_export_blind(qwen3, tmp_path):
    "The seeds' bug, shown by SGLang: `--speculative-algorithm EAGLE` serves an EAGLE-3 export with no error, no warning"
    from eagle3nb.doctor import doctor
    from eagle3nb.engine import meta_counters
    from eagle3nb.export import launch_commands

    base, export, prompts = qwen3['base'], qwen3['export'], qwen3['prompts']
    with SglangServer(qwen3['target'], draft=export, k=3, algorithm='EAGLE', log_path=tmp_path / 'eagle.log') as bad:
        got = generate_ids(bad.base_url, prompts, MAX_TOKENS)  # it started and answers: no error at all
    want = generate_ids(base.base_url, prompts, MAX_TOKENS)
    # the target still verifies every token: the output is the target's own
    assert [g[0] for g in got] == [w[0] for w in want]
    # but EAGLE feeds the draft the last hidden state (H), not the three aux states (3H): SGLang's llama_eagle3.py
    # then skips its fc, and almost nothing is accepted (EAGLE3 on the same export: test_verify_on_servers_...)
    c = meta_counters([g[1] for g in got])
    print(f"EAGLE flag on an EAGLE-3 export: accept length {c['accept_length']:.3f} in {c['drafts']} rounds")
    assert c['drafts'] > 0 and c['accept_length'] < 1.3, c
    # doctor refuses that launch line before any engine starts
    sh = tmp_path / 'launch_sglang.sh'
    sh.write_text(launch_commands(export, qwen3['target'])['sglang'].replace(' EAGLE3 ', ' EAGLE '))
    df = doctor(export, qwen3['target'], server_args=sh).set_index('check')
    assert df.status['speculative_algorithm'] == 'FAIL' and 'EAGLE3' in df.detail['speculative_algorithm']
