"""Extraction through the engine: vLLM's `extract_hidden_states` + the hidden-states connector, repacked into our store.

Both toys: the engine-path store equals the HF-path store sample by sample (within the tolerance measured below), with
the same metadata and catalog index; and a run killed with SIGKILL mid-way resumes with nothing lost or doubled.
Two engine servers in all, one at a time: qwen3-tiny shared by the module (a recipe's `serving.extract.urls`), kimi-tiny
(MLA) launched by `extract_recipe_engine` itself.
"""

import json, os, random, signal, subprocess, sys, time
from collections import Counter
from pathlib import Path
import pytest, torch
from datasets import Dataset, load_from_disk

from eagle3nb.engine import engine_available, prom_samples, server_root, sglang_available
from eagle3nb.engine_extract import extract_server, extract_recipe_engine, spool_name
from eagle3nb.extract import extract, load_target, target_id
from eagle3nb.recipe import parse_recipe, resolve, save_recipe
from eagle3nb.render import load_tokenizer, template_sha256
from eagle3nb.server import http_client
from eagle3nb.store import (
    HiddenStates,
    NF4_GROUP,
    nf4_bound,
    read_index,
    read_meta,
    shard_files,
    validate,
    dequantize_fp8,
)
from eagle3nb.target import target_summary
from eagle3nb.toy import ensure_toy

pytestmark = pytest.mark.skipif(
    not engine_available() and not os.environ.get('EAGLE3NB_REQUIRE_ENGINE'),
    reason='no vLLM engine: run `make engine` (make test builds it and sets EAGLE3NB_REQUIRE_ENGINE=1)',
)


# vLLM vs HF, both float32, beyond rounding to the stored dtype: the max abs over every stored value, as measured here
# (qwen3-tiny: 4.9e-4 at values ~300-500; kimi-tiny: 0.59 at values ~700, 8e-4 relative: vLLM computes MLA in its
# absorbed form, another order of operations, and the toy's random weights amplify the difference with depth)
QWEN3_TOL, KIMI_TOL = 2e-3, 1.0
PER_SHARD = ('sample_ids', 'prefixes')  # metadata of one shard's samples, not of the store


def corpus(root: Path, vocab: int, n: int, lo: int, hi: int, seed: int = 0):
    """A merged-corpus train split of `n` random-token samples of lengths in [lo, hi], in conversations of three: the
    second and third of each begin with the first one's first p tokens (p >= 33), as answered turns of a trajectory
    do, so the store keeps those states once (`store.shared_prefixes`)"""
    g = random.Random(seed)
    rows = []
    for i in range(n):
        L = g.randint(lo, hi)
        ids = [g.randrange(10, vocab - 10) for _ in range(L)]
        if i % 3 and len(first) > 40:
            p = g.randint(33, len(first) - 1)
            ids = (first[:p] + ids)[: max(L, p + 1)]
        first = ids if i % 3 == 0 else first
        rows.append(
            dict(
                sample_id=f'x{seed}-{i:04d}',
                conversation_id=f'c{seed}-{i // 3:04d}',
                input_ids=ids,
                loss_mask=[int(j >= len(ids) // 3) for j in range(len(ids))],
                spans=[],
                dataset='syn',
            )
        )
    Dataset.from_list(rows).save_to_disk(str(root / 'corpus' / 'train'))
    return root


def recipe_for(tmp: Path, toy: str, extract: list = (), **target):
    "A recipe of the toy; `extract`: the extraction servers the user runs (serving.extract.urls)"
    r = resolve(
        parse_recipe(
            dict(
                name='e',
                target=dict(toy=toy, **target),
                serving=dict(extract=dict(urls=list(extract))),
                data_root=str(tmp / 'data'),
                catalog=str(tmp / 'catalog.duckdb'),
            )
        )
    )
    r.target.model = str(ensure_toy(toy))
    return r


def hf_store(model_dir, ds, out, mode, aux):
    "The HF path's store of `ds` (float32 forward, as the engine's on CPU), each sample whole"
    m = load_target(model_dir, dtype=torch.float32)
    extract(
        m,
        ds,
        out,
        aux_layers=aux,
        mode=mode,
        target=target_id(model_dir),
        template_sha256=template_sha256(load_tokenizer(model_dir)),
        share=False,  # whole: each sample from its own forward, the reference a shared store reads back equal to
    )
    return out


def compare(eng_dir, hf_dir, n_aux: int, tol: float) -> dict:
    """Sample-by-sample differences of two stores. `*_excess`: how far |engine - hf| goes beyond what rounding both to
    the stored dtype can make of equal values (one bf16 step at the larger magnitude; for fp8 aux two e4m3 steps,
    2^-3 |x| + 2^-9 of the row's max): what is left is the engine's own float32 difference. `*_tokens_beyond`: tokens
    with some value more than `tol` beyond that"""
    e, h = HiddenStates(eng_dir), HiddenStates(hf_dir)
    assert sorted(r['sample_id'] for r in e.rows) == sorted(r['sample_id'] for r in h.rows)
    hi = {r['sample_id']: i for i, r in enumerate(h.rows)}
    out = Counter()
    for i, r in enumerate(e.rows):
        a, b = e[i], h[hi[r['sample_id']]]
        assert a['input_ids'].tolist() == b['input_ids'].tolist() and a['loss_mask'].tolist() == b['loss_mask'].tolist()
        for k in ('aux', 'final') if 'final' in a else ('aux',):
            d, ref = (a[k].float() - b[k].float()).abs(), torch.maximum(a[k].float().abs(), b[k].float().abs())
            if 'final' in a:
                room = torch.exp2(torch.floor(torch.log2(ref.clamp(min=1e-30))) - 7)  # one bf16 step at |hf|
            else:
                T = len(ref)
                rmax = (
                    ref.view(T, n_aux, -1)
                    .amax(-1, keepdim=True)
                    .expand(T, n_aux, ref.shape[-1] // n_aux)
                    .reshape(T, -1)
                )
                room = 2**-3 * ref + 2**-9 * rmax
            out[f'{k}_max_abs'] = max(out[f'{k}_max_abs'], d.max().item())
            out[f'{k}_excess'] = max(out[f'{k}_excess'], (d - room).max().item())
            out[f'{k}_tokens_beyond'] += int(((d - room) > tol).any(-1).sum())
        if 'topk_p' in a:
            out['topk_p_max_abs'] = max(
                out['topk_p_max_abs'], (a['topk_p'].float() - b['topk_p'].float()).abs().max().item()
            )
            out['top1_same'] += int((a['topk_idx'][:, 0] == b['topk_idx'][:, 0]).sum())
        out['tokens'] += len(a['input_ids'])
    return dict(out)


@pytest.fixture(scope='module')
def qwen3(tmp_path_factory):
    "One qwen3-tiny extraction server shared by the module, its spool, and a recipe that names it as the endpoint"
    tmp = tmp_path_factory.mktemp('ex-qwen3')
    target = ensure_toy('qwen3-tiny')
    ts = target_summary(target)
    spool = tmp / 'engine' / 'spool'
    spool.mkdir(parents=True)
    with extract_server(target, spool, ts['aux_layers'] + [ts['num_hidden_layers']]) as srv:
        yield dict(srv=srv, spool=spool, target=target, ts=ts, tmp=tmp)
    assert not any(spool.glob('s-*.safetensors'))  # every spool file of ours was repacked and dropped


def test_qwen3_engine_store_equals_hf_store(qwen3):
    """bf16 and compact stores through vLLM match the HF path's sample by sample; same metadata; indexed in the catalog.
    nf4 from the same requests is the engine's bf16 store within the NF4 bound, its top-k compact's.
    All modes come from one request per sample, also when only one store lacks a sample"""
    tmp, ts = qwen3['tmp'] / 'eq', qwen3['ts']
    r = recipe_for(tmp, 'qwen3-tiny', extract=[qwen3['srv'].base_url])
    r.phases = dict(extract=dict(spool=str(qwen3['spool']), concurrency=4))
    corpus(Path(r.data_root), ts['vocab_size'], 24, 5, 120)
    t0 = time.perf_counter()
    rows = extract_recipe_engine(r, modes='bf16,compact,nf4', splits='train', progress=False, log=lambda *a: None)
    print(
        f"qwen3 engine extraction: {[(x['mode'], x['new_samples'], x['tokens'], x['tokens_per_s']) for x in rows]} in {time.perf_counter() - t0:.1f} s"
    )
    assert [(x['mode'], x['new_samples'], x['skipped'], x['requests']) for x in rows] == [
        ('bf16', 24, 0, 24),
        ('compact', 24, 0, 24),
        ('nf4', 24, 0, 24),
    ]
    root = Path(r.data_root)
    assert validate(root / 'hidden' / 'nf4' / 'train')['problems'] == []
    assert sum(x['prefix_len'] > 0 for x in read_index(root / 'hidden' / 'bf16' / 'train')) >= 8  # turns share
    bf, cp = HiddenStates(root / 'hidden' / 'bf16' / 'train'), HiddenStates(root / 'hidden' / 'compact' / 'train')
    raw = HiddenStates(root / 'hidden' / 'nf4' / 'train', raw=True)
    for i, s in enumerate(HiddenStates(root / 'hidden' / 'nf4' / 'train')):
        T = len(s['input_ids'])
        assert bf.rows[i]['sample_id'] == s['sample_id'] == cp.rows[i]['sample_id']
        ref = bf[i]['aux'].float().view(T, -1, NF4_GROUP)
        err = (s['aux'].float().view(T, -1, NF4_GROUP) - ref).abs()
        assert (err <= nf4_bound(raw[i]['aux_scale'])[..., None] + ref.abs() * 2**-7).all()
        assert torch.equal(s['topk_idx'], cp[i]['topk_idx'])
    ds = load_from_disk(str(Path(r.data_root) / 'corpus' / 'train'))
    root = Path(r.data_root)
    for mode in ('bf16', 'compact'):
        hf = hf_store(r.target.model, ds, tmp / 'hf' / mode, mode, ts['aux_layers'])
        me, mh = read_meta(shard_files(root / 'hidden' / mode / 'train')[0]), read_meta(shard_files(hf)[0])
        assert {k: v for k, v in me.items() if k not in PER_SHARD} == {
            k: v for k, v in mh.items() if k not in PER_SHARD
        }
        d = compare(root / 'hidden' / mode / 'train', hf, len(ts['aux_layers']), QWEN3_TOL)
        print(f'qwen3 {mode}: engine vs HF {d}')
        if mode == 'bf16':
            assert d['aux_excess'] <= QWEN3_TOL and d['final_excess'] <= QWEN3_TOL and d['final_tokens_beyond'] == 0
        else:
            assert d['aux_excess'] <= QWEN3_TOL and d['topk_p_max_abs'] <= 2e-3 and d['top1_same'] >= 0.99 * d['tokens']
    import duckdb

    with duckdb.connect(r.catalog, read_only=True) as con:
        n = con.execute(
            "SELECT count(*) FROM hidden_index WHERE store = ?", [str((root / 'hidden' / 'bf16' / 'train').resolve())]
        ).fetchone()[0]
    assert n == 24
    again = extract_recipe_engine(
        r, modes='bf16', splits='train', progress=False, log=lambda *a: None
    )  # a rerun asks for nothing
    assert (again[0]['new_samples'], again[0]['skipped'], again[0]['requests']) == (0, 24, 0)
    import shutil

    compact = root / 'hidden' / 'compact' / 'train'
    shutil.rmtree(
        compact
    )  # the compact store lost, the bf16 one whole: both asked again, only the samples compact lacks
    mixed = extract_recipe_engine(r, modes='bf16,compact', splits='train', progress=False, log=lambda *a: None)
    assert [(x['mode'], x['new_samples'], x['skipped'], x['requests']) for x in mixed] == [
        ('bf16', 0, 24, 24),
        ('compact', 24, 0, 24),
    ]
    d = compare(compact, tmp / 'hf' / 'compact', len(ts['aux_layers']), QWEN3_TOL)
    assert d['aux_excess'] <= QWEN3_TOL and d['topk_p_max_abs'] <= 2e-3 and d['top1_same'] >= 0.99 * d['tokens']
    with duckdb.connect(r.catalog, read_only=True) as con:
        n = con.execute("SELECT count(*) FROM hidden_index WHERE store = ?", [str(compact.resolve())]).fetchone()[0]
    assert n == 24
    assert not any(qwen3['spool'].glob('s-*.safetensors'))  # every spool file dropped once both stores had landed it


def engine_busy(base_url: str) -> float:
    "Requests the vLLM server at `base_url` is running or holds waiting (its own gauges)"
    with http_client(30) as c:
        text = c.get(server_root(base_url) + '/metrics').text
    return sum(v for n, _, v in prom_samples(text) if n in ('vllm:num_requests_running', 'vllm:num_requests_waiting'))


_CHILD = """
import sys
from eagle3nb.engine_extract import extract_recipe_engine
from eagle3nb.recipe import load_recipe
extract_recipe_engine(load_recipe(sys.argv[1]), modes=sys.argv[2], splits='train', shard_mb=0.02, concurrency=2, progress=False)
"""


@pytest.mark.parametrize('modes', ['bf16', 'bf16,compact'])
def test_kill9_mid_run_then_resume_nothing_lost_or_doubled(qwen3, modes):
    """SIGKILL the extraction while shards land; the rerun stores every sample exactly once in every store, and drops or
    uses the spool files left; with two modes, a sample is asked again only where some store lacks it"""
    tmp, ts, ml = qwen3['tmp'] / f"kill-{modes.replace(',', '-')}", qwen3['ts'], modes.split(',')
    r = recipe_for(tmp, 'qwen3-tiny', extract=[qwen3['srv'].base_url])
    r.phases = dict(extract=dict(spool=str(qwen3['spool'])))
    corpus(Path(r.data_root), ts['vocab_size'], 240, 16, 64, seed=1)
    path = save_recipe(r, tmp / 'recipe.yaml')
    stores = {m: Path(r.data_root) / 'hidden' / m / 'train' for m in ml}
    p = subprocess.Popen(
        [sys.executable, '-c', _CHILD, str(path), modes], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    while len(shard_files(stores['bf16'])) < 4 and p.poll() is None:
        time.sleep(0.05)  # ready: shards are landing
    assert p.poll() is None, f'the run ended before the kill: {p.stderr.read().decode()[-2000:]}'
    p.send_signal(signal.SIGKILL)
    p.wait()
    while engine_busy(qwen3['srv'].base_url):
        time.sleep(0.05)  # the requests the client left in flight still finish, each writing its spool file: count them
    before = {m: {x['sample_id'] for x in read_index(d)} for m, d in stores.items()}
    left = list(qwen3['spool'].glob('s-*.safetensors'))
    print(f'killed with {[len(b) for b in before.values()]} of 240 samples stored, {len(left)} spool files left')
    assert all(0 < len(b) < 240 for b in before.values())
    rows = extract_recipe_engine(r, modes=modes, splits='train', progress=False, log=lambda *a: None)
    assert [(x['skipped'], x['new_samples']) for x in rows] == [(len(before[m]), 240 - len(before[m])) for m in ml]
    lack = 240 - len(
        set.intersection(*before.values())
    )  # samples some store lacks: each asked once, or read from the spool
    assert lack - len(left) <= rows[0]['requests'] <= lack
    for m, d in stores.items():
        ids = [x['sample_id'] for x in read_index(d)]
        assert len(ids) == 240 and set(ids) == {f'x1-{i:04d}' for i in range(240)}  # nothing lost, nothing doubled
        rep = validate(d, corpus=load_from_disk(str(Path(r.data_root) / 'corpus' / 'train')))
        assert rep['samples'] == 240 and not rep['problems']
    assert not any(qwen3['spool'].glob('s-*.safetensors'))


def test_final_state_probe_on_the_users_extraction_server(qwen3, monkeypatch):
    """target_check's probe of an extraction server the user runs: its final state through the target's norm and
    lm_head gives the server's own greedy tokens; a file holding another layer there (vLLM #46973) fails, named"""
    import eagle3nb.engine_extract as ee

    r = recipe_for(qwen3['tmp'] / 'probe', 'qwen3-tiny', extract=[qwen3['srv'].base_url])
    r.phases = dict(extract=dict(spool=str(qwen3['spool'])))
    g = random.Random(3)
    probes = [[g.randrange(10, qwen3['ts']['vocab_size'] - 10) for _ in range(n)] for n in (5, 9, 17, 33)]
    rows = ee.extraction_check(r, probes)
    assert [x[1] for x in rows] == ['ok'] and rows[0][2].startswith('4/4 probes'), rows
    real = ee.read_spool

    def dropped(path):  # the bug, played: layer 2's state where the last layer's belongs
        got = real(path)
        got['hidden_states'] = torch.cat([got['hidden_states'][:, :-1], got['hidden_states'][:, :1]], 1)
        return got

    monkeypatch.setattr(ee, 'read_spool', dropped)
    rows = ee.extraction_check(r, probes)
    print(f'final-state probe: the right state 4/4 agree; another layer {rows[0][2][:3]}')
    assert rows[0][1] == 'FAIL' and '#46973' in rows[0][2], rows
    assert not any((qwen3['spool'] / spool_name(f'probe-{i}')).exists() for i in range(4))  # the probes' files dropped


def test_kimi_mla_cli_local_launch_equals_hf(tmp_path, capsys):
    """kimi-tiny (MLA, the CPU MLA backend) through `eagle3nb extract RECIPE` with `phases.extract.engine: vllm`, which
    launches its own server. The recipe is as a run writes it when its runner serves the target: `target.endpoints` is
    that plain server (here a port where nothing listens), marked `served_here`, so extraction must not send it anything"""
    from eagle3nb.cli import main

    r = recipe_for(tmp_path, 'kimi-tiny', endpoints=['http://127.0.0.1:9/v1'], served_here=True)
    r.phases = dict(extract=dict(engine='vllm', concurrency=4))
    ts = target_summary(r.target.model)
    corpus(Path(r.data_root), ts['vocab_size'], 16, 5, 100, seed=2)
    t0 = time.perf_counter()
    main(['extract', str(save_recipe(r, tmp_path / 'recipe.yaml')), '--splits', 'train'])
    print(f'kimi engine extraction (server start included): {time.perf_counter() - t0:.1f} s')
    store = Path(r.data_root) / 'hidden' / 'bf16' / 'train'
    out = capsys.readouterr().out
    assert len(read_index(store)) == 16 and 'vllm: bf16/train: 16 new samples' in out
    assert 'no extraction servers in the recipe (serving.extract.urls): launching one here' in out
    spool = Path(r.data_root) / 'hidden' / '.engine' / 'spool'
    assert not list(spool.iterdir())  # the readiness probe's file too: the spool is ours
    hf = hf_store(
        r.target.model,
        load_from_disk(str(Path(r.data_root) / 'corpus' / 'train')),
        tmp_path / 'hf',
        'bf16',
        ts['aux_layers'],
    )
    d = compare(store, hf, len(ts['aux_layers']), KIMI_TOL)
    print(f'kimi bf16: engine vs HF {d}')
    assert d['aux_excess'] <= KIMI_TOL
    # a random-weight MoE: where two experts' router scores tie within float32 noise (gaps of 2.5e-5 and 3.7e-4 at
    # layer 6, measured), the engine and HF pick different experts, and that token (and later ones attending to it at
    # layer 7) get another `final`: 4 of 923 tokens here; every aux layer is before those ties
    assert d['final_tokens_beyond'] <= 0.01 * d['tokens']


def test_bad_spool_file_asked_again_and_too_long_sample_named(qwen3):
    "A spool file that does not match its sample is dropped and the sample requested again; an engine refusal names the sample"
    from safetensors.torch import save_file
    from eagle3nb.engine_extract import EngineExtractError

    tmp, ts = qwen3['tmp'] / 'bad', qwen3['ts']
    r = recipe_for(tmp, 'qwen3-tiny', extract=[qwen3['srv'].base_url])
    r.phases = dict(extract=dict(spool=str(qwen3['spool'])))
    corpus(Path(r.data_root), ts['vocab_size'], 3, 10, 20, seed=3)
    stale = qwen3['spool'] / spool_name('x3-0001')  # a killed run's file for the wrong tokens (2 instead of 10-20)
    save_file(dict(hidden_states=torch.zeros(2, 4, ts['hidden_size']), token_ids=torch.tensor([1, 2])), str(stale))
    rows = extract_recipe_engine(r, modes='bf16', splits='train', progress=False, log=lambda *a: None)
    assert rows[0]['new_samples'] == 3 and not stale.exists()
    store = Path(r.data_root) / 'hidden' / 'bf16' / 'train'
    assert not validate(store, corpus=load_from_disk(str(Path(r.data_root) / 'corpus' / 'train')))['problems']
    long = recipe_for(tmp / 'long', 'qwen3-tiny', extract=[qwen3['srv'].base_url])
    long.phases = r.phases
    corpus(Path(long.data_root), ts['vocab_size'], 1, 2100, 2100, seed=4)  # the server's --max-model-len is 2048
    with pytest.raises(EngineExtractError, match=r'sample x4-0000: .*HTTP 400'):
        extract_recipe_engine(long, modes='bf16', splits='train', progress=False, log=lambda *a: None)


_LAUNCH = """
import sys
from eagle3nb.engine_extract import extract_recipe_engine
from eagle3nb.recipe import load_recipe
extract_recipe_engine(load_recipe(sys.argv[1]), modes='bf16', splits='train', shard_mb=0.02, concurrency=2, progress=False)
"""


def test_kill9_of_extract_takes_the_engine_it_launched_with_it(tmp_path):
    """`kill -9` of an extraction that launched its own vLLM server (as a node's OOM killer would): the server, its
    engine core and workers go too (the guard's doing), so no orphan holds the GPU, its memory or its port"""
    import psutil

    r = recipe_for(tmp_path, 'qwen3-tiny')
    corpus(Path(r.data_root), target_summary(r.target.model)['vocab_size'], 400, 16, 64, seed=3)
    path = save_recipe(r, tmp_path / 'recipe.yaml')
    store = Path(r.data_root) / 'hidden' / 'bf16' / 'train'
    p = subprocess.Popen([sys.executable, '-c', _LAUNCH, str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    while len(shard_files(store)) < 2 and p.poll() is None:
        time.sleep(0.05)  # ready: the engine answers, shards land
    assert p.poll() is None, f'the extraction ended before the kill: {p.stderr.read().decode()[-2000:]}'
    kids = psutil.Process(p.pid).children(recursive=True)
    assert any('vllm' in ' '.join(k.cmdline()) for k in kids), [k.cmdline()[:4] for k in kids]
    p.send_signal(signal.SIGKILL)
    p.wait()
    t0 = time.monotonic()
    _, alive = psutil.wait_procs(kids, timeout=180)  # a hang guard: the guard SIGKILLs what outlives its grace
    print(f'{len(kids)} processes of the killed extraction gone {time.monotonic() - t0:.1f} s after the kill')
    assert alive == [], [a.cmdline()[:4] for a in alive]


# SGLang: two servers of the target, an aux server and a final server (`engine_extract.sglang_extract_servers`).
# qwen3-tiny's pair is launched once, by an extraction's own session (`sglang_endpoints`), and shared by the module.
# kimi-tiny (MLA) is not served by SGLang on this CPU: its prefill fails in the CPU stand-in of
# `extend_attention_cpu` (eagle3nb.sglang_cpu): "The expanded size of the tensor (576) must match the existing size
# (80)" (MLA's latent KV cache, 512 + 64 wide, vs its 80-wide heads), so it has no SGLang test here.
needs_sglang = pytest.mark.skipif(
    not sglang_available() and not os.environ.get('EAGLE3NB_REQUIRE_ENGINE'),
    reason='no SGLang engine: run `make engine` (make test builds it and sets EAGLE3NB_REQUIRE_ENGINE=1)',
)
SGLANG_TOL = QWEN3_TOL  # SGLang vs HF on qwen3-tiny, both float32: 6.7e-4 beyond bf16 rounding (aux), 1.9e-6 (final)


@pytest.fixture(scope='module')
def sg_qwen3(tmp_path_factory):
    """qwen3-tiny's SGLang aux and final servers, launched as an extraction launches them when the recipe's endpoint is
    the run's plain server (`served_here`; here a port where nothing listens); stopped with the session at the end"""
    from eagle3nb.engine_extract import sglang_endpoints
    from eagle3nb.phase import RunContext
    from eagle3nb.server import leftovers, owned_by

    tmp = tmp_path_factory.mktemp('sg-qwen3')
    r = recipe_for(tmp / 'launch', 'qwen3-tiny', endpoints=['http://127.0.0.1:9/v1'], served_here=True)
    ts, said, t0 = target_summary(r.target.model), [], time.perf_counter()
    with RunContext.open(r, tmp / 'run') as ctx:
        with owned_by(f'test-sglang:{tmp}') as tag:  # the servers' processes carry the tag
            aux, final, key = sglang_endpoints(ctx, ts['aux_layers'], ts['num_hidden_layers'], log=said.append)
        print(f'SGLang aux and final servers of qwen3-tiny ready in {time.perf_counter() - t0:.0f} s')
        engine_dir = Path(r.data_root) / 'hidden' / '.engine'
        yield dict(aux=aux[0], final=final[0], key=key, said=said, engine_dir=engine_dir, ts=ts, tmp=tmp)
    assert leftovers(tag) == []  # both servers and their children stopped with the session


def hf_nf4_check(nf4_dir, hf_bf16_dir, tol: float) -> float:
    "The nf4 store's aux is the HF forward's within the NF4 bound (+ `tol`); the max abs difference"
    hf = {s['sample_id']: s for s in HiddenStates(hf_bf16_dir)}
    raw, worst = HiddenStates(nf4_dir, raw=True), 0.0
    for i, s in enumerate(HiddenStates(nf4_dir)):
        T = len(s['input_ids'])
        ref = hf[s['sample_id']]['aux'].float().view(T, -1, NF4_GROUP)
        err = (s['aux'].float().view(T, -1, NF4_GROUP) - ref).abs()
        assert (err <= nf4_bound(raw[i]['aux_scale'])[..., None] + ref.abs() * 2**-7 + tol).all()
        worst = max(worst, err.max().item())
    return worst


@needs_sglang
def test_sglang_servers_launched_by_the_extraction_session(sg_qwen3):
    "Two servers, started at once, their logs with the data; the run's plain server (target.endpoints) is never asked"
    assert sg_qwen3['said'][0] == (
        "no extraction servers in the recipe (serving.extract.urls): launching two SGLang servers here "
        "(the engine's defaults)"
    )
    assert sg_qwen3['said'][1].startswith('SGLang extraction servers ready in ')
    assert (sg_qwen3['engine_dir'] / 'sglang-aux.log').exists() and (
        sg_qwen3['engine_dir'] / 'sglang-final.log'
    ).exists()
    assert sg_qwen3['key'] is None and sg_qwen3['aux'] != sg_qwen3['final']


@needs_sglang
def test_sglang_qwen3_stores_equal_hf(sg_qwen3):
    """bf16, compact and nf4 stores through SGLang (the recipe's endpoints: a final and an aux server, in that order)
    equal the HF path's, sample by sample, aux and final; one request per sample for all modes; indexed in the catalog;
    a rerun asks for nothing"""
    import duckdb

    tmp, ts = sg_qwen3['tmp'] / 'eq', sg_qwen3['ts']
    r = recipe_for(tmp, 'qwen3-tiny', extract=[sg_qwen3['final'], sg_qwen3['aux']])
    r.phases = dict(extract=dict(concurrency=4))
    corpus(Path(r.data_root), ts['vocab_size'], 24, 5, 120)
    t0 = time.perf_counter()
    rows = extract_recipe_engine(
        r, modes='bf16,compact,nf4', splits='train', progress=False, log=lambda *a: None, engine='sglang'
    )
    print(
        f"qwen3 SGLang extraction: {[(x['mode'], x['tokens_per_s']) for x in rows]} in {time.perf_counter() - t0:.1f} s"
    )
    assert [(x['mode'], x['new_samples'], x['skipped'], x['requests']) for x in rows] == [
        ('bf16', 24, 0, 24),
        ('compact', 24, 0, 24),
        ('nf4', 24, 0, 24),
    ]
    root, n_aux = Path(r.data_root), len(ts['aux_layers'])
    ds = load_from_disk(str(root / 'corpus' / 'train'))
    for mode in ('bf16', 'compact', 'nf4'):
        store = root / 'hidden' / mode / 'train'
        assert validate(store, corpus=ds)['problems'] == []
        assert sum(x['prefix_len'] > 0 for x in read_index(store)) >= 8  # the later turns share the first's states
        hf = hf_store(r.target.model, ds, tmp / 'hf' / mode, mode, ts['aux_layers'])
        me, mh = read_meta(shard_files(store)[0]), read_meta(shard_files(hf)[0])
        assert {k: v for k, v in me.items() if k not in PER_SHARD} == {
            k: v for k, v in mh.items() if k not in PER_SHARD
        }
        d = compare(store, hf, n_aux, SGLANG_TOL)
        print(f'qwen3 {mode}: SGLang vs HF {d}')
        if mode == 'bf16':
            assert d['aux_excess'] <= SGLANG_TOL and d['final_excess'] <= SGLANG_TOL and d['final_tokens_beyond'] == 0
        else:
            assert d['topk_p_max_abs'] <= 2e-3 and d['top1_same'] >= 0.99 * d['tokens']
        if mode == 'compact':
            assert d['aux_excess'] <= SGLANG_TOL
    worst = hf_nf4_check(root / 'hidden' / 'nf4' / 'train', tmp / 'hf' / 'bf16', SGLANG_TOL)
    print(f'qwen3 nf4: SGLang nf4 store vs the HF forward (bf16 store): max abs {worst:.3g}, within the NF4 bound')
    with duckdb.connect(r.catalog, read_only=True) as con:
        n = con.execute(
            "SELECT count(*) FROM hidden_index WHERE store = ?", [str((root / 'hidden' / 'nf4' / 'train').resolve())]
        ).fetchone()[0]
    assert n == 24
    again = extract_recipe_engine(r, modes='bf16', splits='train', progress=False, log=lambda *a: None, engine='sglang')
    assert (again[0]['new_samples'], again[0]['skipped'], again[0]['requests']) == (0, 24, 0)


_SG_CHILD = """
import sys
from eagle3nb.engine_extract import extract_recipe_engine
from eagle3nb.recipe import load_recipe
extract_recipe_engine(load_recipe(sys.argv[1]), modes='bf16,compact', splits='train', shard_mb=0.02, concurrency=2,
                      progress=False, engine='sglang')
"""


@needs_sglang
def test_sglang_kill9_mid_run_then_resume_nothing_lost_or_doubled(sg_qwen3):
    "SIGKILL an SGLang extraction while shards land; the rerun stores every sample exactly once in both stores"
    tmp, ts, n = sg_qwen3['tmp'] / 'kill', sg_qwen3['ts'], 80
    r = recipe_for(tmp, 'qwen3-tiny', extract=[sg_qwen3['aux'], sg_qwen3['final']])
    corpus(Path(r.data_root), ts['vocab_size'], n, 16, 40, seed=1)
    path = save_recipe(r, tmp / 'recipe.yaml')
    stores = {m: Path(r.data_root) / 'hidden' / m / 'train' for m in ('bf16', 'compact')}
    p = subprocess.Popen(
        [sys.executable, '-c', _SG_CHILD, str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    while len(shard_files(stores['bf16'])) < 4 and p.poll() is None:
        time.sleep(0.05)  # ready: shards are landing
    assert p.poll() is None, f'the run ended before the kill: {p.stderr.read().decode()[-2000:]}'
    p.send_signal(signal.SIGKILL)
    p.wait()
    before = {m: {x['sample_id'] for x in read_index(d)} for m, d in stores.items()}
    print(f'killed with {[len(b) for b in before.values()]} of {n} samples stored')
    assert all(0 < len(b) < n for b in before.values())
    rows = extract_recipe_engine(
        r, modes='bf16,compact', splits='train', progress=False, log=lambda *a: None, engine='sglang'
    )
    assert [(x['skipped'], x['new_samples']) for x in rows] == [(len(before[m]), n - len(before[m])) for m in stores]
    assert rows[0]['requests'] == n - len(set.intersection(*before.values()))  # what some store lacks, once each
    ds = load_from_disk(str(Path(r.data_root) / 'corpus' / 'train'))
    for m, d in stores.items():
        ids = [x['sample_id'] for x in read_index(d)]
        assert len(ids) == n and set(ids) == {f'x1-{i:04d}' for i in range(n)}  # nothing lost, nothing doubled
        rep = validate(d, corpus=ds)
        assert rep['samples'] == n and not rep['problems']


@needs_sglang
def test_sglang_endpoints_checked_before_any_request(sg_qwen3):
    "Endpoints without a final server, or with other aux layers, are refused before the first request, named"
    from eagle3nb.engine_extract import EngineExtractError

    tmp, ts = sg_qwen3['tmp'] / 'chk', sg_qwen3['ts']
    r = recipe_for(tmp, 'qwen3-tiny', extract=[sg_qwen3['aux']])
    corpus(Path(r.data_root), ts['vocab_size'], 2, 5, 10, seed=5)
    with pytest.raises(EngineExtractError, match='no SGLang server returning the final states'):
        extract_recipe_engine(r, modes='bf16', splits='train', progress=False, log=lambda *a: None, engine='sglang')
    r.target.aux_layers = [2, 3, 5]
    r.serving.extract.urls = [sg_qwen3['aux'], sg_qwen3['final']]
    with pytest.raises(EngineExtractError, match=r'returns aux layers \[1, 3, 4\].*layer-ids 1 2 4'):
        extract_recipe_engine(r, modes='bf16', splits='train', progress=False, log=lambda *a: None, engine='sglang')
    assert not list((Path(r.data_root) / 'hidden').rglob('*.safetensors'))  # nothing asked, nothing stored


@needs_sglang
def test_sglang_cli_engine_flag_equals_hf(sg_qwen3, capsys):
    "`eagle3nb extract RECIPE --engine sglang` on the recipe's SGLang servers: the store equals the HF forward's"
    from eagle3nb.cli import main

    tmp, ts = sg_qwen3['tmp'] / 'cli', sg_qwen3['ts']
    r = recipe_for(tmp, 'qwen3-tiny', extract=[sg_qwen3['aux'], sg_qwen3['final']])
    corpus(Path(r.data_root), ts['vocab_size'], 12, 5, 100, seed=2)
    main(['extract', str(save_recipe(r, tmp / 'recipe.yaml')), '--splits', 'train', '--engine', 'sglang'])
    assert 'sglang: bf16/train: 12 new samples' in capsys.readouterr().out
    store = Path(r.data_root) / 'hidden' / 'bf16' / 'train'
    ds = load_from_disk(str(Path(r.data_root) / 'corpus' / 'train'))
    d = compare(store, hf_store(r.target.model, ds, tmp / 'hf', 'bf16', ts['aux_layers']), 3, SGLANG_TOL)
    print(f'qwen3 bf16 (CLI): SGLang vs HF {d}')
    assert d['aux_excess'] <= SGLANG_TOL and d['final_excess'] <= SGLANG_TOL and d['final_tokens_beyond'] == 0
