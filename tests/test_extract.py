"Extract + store: equal to a direct forward on both toys, kill -9 resume, disk (preflight, filling), catalog, torchrun"

import json, os, shutil, signal, subprocess, sys, textwrap, time
from pathlib import Path

import pytest
import torch

from eagle3nb.catalog import query
from eagle3nb.extract import NotEnoughDisk, extract, load_target
from eagle3nb.store import HiddenStates, bytes_per_token, done_ids, read_index, shard_files, validate
from eagle3nb.toy import ensure_toy

AUX = [2, 4, 6]


def samples(n, seed=0):
    "n toy samples with a few distinct lengths (equal lengths share a batch)"
    g = torch.Generator().manual_seed(seed)
    lens = [4 + (i * 7) % 11 for i in range(n)]
    return [
        dict(
            sample_id=f's{i:03d}',
            input_ids=torch.randint(0, 3000, (L,), generator=g).tolist(),
            loss_mask=[int(j > L // 2) for j in range(L)],
        )
        for i, L in enumerate(lens)
    ]


def by_id(d):
    hs = HiddenStates(d)
    return {s['sample_id']: s for s in hs}


@pytest.fixture(scope='module')
def kimi():
    return ensure_toy('kimi-tiny')


@pytest.mark.parametrize('toy', ['kimi-tiny', 'qwen3-tiny'])
def test_bf16_equals_direct_forward(toy, tmp_path):
    "Stored aux/final states are bit-identical to an unbatched HF forward with output_hidden_states (ids = HF indices)"
    from datasets import Dataset

    m, rows = load_target(ensure_toy(toy)), samples(12)
    st = extract(
        m, Dataset.from_list(rows), tmp_path / 'h', aux_layers=AUX, shard_bytes=5000, catalog=tmp_path / 'c.duckdb'
    )
    assert st['samples'] == 12 and len(st['shards']) > 1
    got = by_id(tmp_path / 'h')
    for r in rows:
        with torch.no_grad():
            hs = m(torch.tensor([r['input_ids']]), output_hidden_states=True).hidden_states
        assert torch.equal(got[r['sample_id']]['aux'], torch.cat([hs[k][0] for k in AUX], -1))
        assert torch.equal(got[r['sample_id']]['final'], hs[-1][0])
        assert got[r['sample_id']]['loss_mask'].tolist() == [bool(x) for x in r['loss_mask']]
    rep = validate(
        tmp_path / 'h', corpus=rows, expect=dict(layer_ids=AUX, sglang_layer_ids=[1, 3, 5], hidden_size=64, mode='bf16')
    )
    assert rep['samples'] == 12 and rep['tokens'] == sum(len(r['input_ids']) for r in rows)
    idx = query(tmp_path / 'c.duckdb', 'SELECT count(*) AS n, sum(length) AS t FROM hidden_index')
    assert idx.n[0] == 12 and idx.t[0] == rep['tokens']
    assert st['bytes_per_token'] == bytes_per_token('bf16', 64) == 8 * 64 + 5


KILL_SCRIPT = textwrap.dedent('''
    import sys, time, json
    from eagle3nb.extract import extract, load_target
    rows = json.load(open(sys.argv[2]))
    extract(load_target(sys.argv[1]), rows, sys.argv[3], aux_layers=[2, 4, 6], shard_bytes=3000, catalog=sys.argv[4],
            token_budget=64, on_batch=lambda st: time.sleep(0.15))
''')


def test_kill9_resume_loses_and_duplicates_nothing(kimi, tmp_path):
    "SIGKILL mid-run, rerun: every sample stored exactly once, identical to an uninterrupted run, index complete"
    import json

    rows = samples(40, seed=1)
    (tmp_path / 'rows.json').write_text(json.dumps(rows))
    (tmp_path / 'kill.py').write_text(KILL_SCRIPT)
    out, cat = tmp_path / 'h', tmp_path / 'c.duckdb'
    env = {**os.environ, 'OMP_NUM_THREADS': '1'}
    p = subprocess.Popen(
        [sys.executable, str(tmp_path / 'kill.py'), str(kimi), str(tmp_path / 'rows.json'), str(out), str(cat)], env=env
    )
    t0 = time.time()
    while len(shard_files(out)) < 2 and p.poll() is None and time.time() - t0 < 120:
        time.sleep(0.05)
    assert p.poll() is None, 'extraction finished before it could be killed; slow it down'
    p.send_signal(signal.SIGKILL)
    p.wait()
    partial = done_ids(out)
    assert 0 < len(partial) < 40
    m = load_target(kimi)
    st = extract(m, rows, out, aux_layers=AUX, shard_bytes=3000, catalog=cat)
    assert st['skipped'] == len(partial) and st['samples'] == 40 - len(partial)
    ids = [r['sample_id'] for r in read_index(out)]
    assert sorted(ids) == sorted(r['sample_id'] for r in rows)  # nothing lost, nothing twice
    validate(out, corpus=rows)
    extract(m, rows, tmp_path / 'ref', aux_layers=AUX, shard_bytes=3000)  # uninterrupted
    a, b = by_id(out), by_id(tmp_path / 'ref')
    for s in a:
        assert torch.equal(a[s]['aux'], b[s]['aux']) and torch.equal(a[s]['final'], b[s]['final'])
    assert query(cat, 'SELECT count(DISTINCT sample_id) AS n FROM hidden_index').n[0] == 40
    assert [f.name for f in out.iterdir() if f.name.startswith('.')] == []  # a killed write's temp file is gone


def test_preflight_refuses_without_space(kimi, tmp_path, monkeypatch):
    "Free space < estimate x 1.1: no forward, no shard, a message with the amount needed; exactly 1.1x passes"
    m, rows = load_target(kimi), samples(6)
    need = bytes_per_token('bf16', 64) * sum(len(r['input_ids']) for r in rows)
    real = shutil.disk_usage
    fake = lambda free: lambda p: real(p)._replace(free=free)
    monkeypatch.setattr(shutil, 'disk_usage', fake(int(need * 1.1) - 1))
    with pytest.raises(NotEnoughDisk, match=r'needs .* GB free .*estimate .* x 1.1'):
        extract(
            m, rows, tmp_path / 'h', aux_layers=AUX, on_batch=lambda st: pytest.fail('a forward ran'), min_free_gb=0
        )
    assert shard_files(tmp_path / 'h') == []
    monkeypatch.setattr(shutil, 'disk_usage', fake(int(need * 1.1)))
    st = extract(m, rows, tmp_path / 'h', aux_layers=AUX, min_free_gb=0)
    assert st['planned_bytes'] == need and st['samples'] == 6
    assert (
        sum(f.stat().st_size for f in shard_files(tmp_path / 'h')) < need * 1.1
    )  # the estimate covers the headers too


def test_disk_fills_mid_run_phase_stops_then_resumes(tmp_path, monkeypatch):
    "Disk fills mid-phase: stop before the crossing shard, record + error say so, rate kept; rerun = uninterrupted run"
    from datasets import load_from_disk
    import eagle3nb.store as store
    from eagle3nb.extract import ExtractionStopped
    from eagle3nb.phase import RunContext
    from eagle3nb.phases import extract as phase

    ctx = RunContext.open('', tmp_path / 'run')  # the smoke run: kimi-tiny, 8 samples in pairs of equal length
    p = phase.Params(modes='bf16,compact', shard_mb=0, min_free_gb=2)  # two of the smoke run's modes, a shard a sample
    hidden = ctx.data_root / 'hidden'
    landed = lambda: sum(len(shard_files(d)) for d in hidden.glob('*/*'))
    monkeypatch.setattr(store, 'free_bytes', lambda d: 10**12 if landed() < 5 else 10**9)  # 1 GB left after 5 shards
    with pytest.raises(ExtractionStopped, match=r'5/16 samples stored.*rerun the same command'):
        phase.run(ctx, p)
    rec = phase.run.read(ctx.run_dir)  # written before the phase failed
    assert {k: rec.stopped[k] for k in ('samples_done', 'samples_total', 'free_bytes', 'reserve_bytes')} == dict(
        samples_done=5, samples_total=16, free_bytes=10**9, reserve_bytes=2 * 10**9
    )
    assert rec.headline().startswith('stopped for disk: 5/16 samples stored')
    assert [(x['mode'], x['samples']) for x in rec.rows] == [('bf16', 3), ('compact', 2)]  # the 6th shard: not written
    lens = [len(x) for x in load_from_disk(str(ctx.data_root / 'corpus' / 'train'))['input_ids']]
    rate = query(ctx.catalog, "SELECT * FROM rates WHERE phase = 'extract'")
    assert (len(rate), rate.run_id[0], rate.samples[0], rate.tokens[0]) == (1, 'run', 4, sum(lens[:4]))  # 2 batches
    assert json.loads(rate.detail[0])['stopped'] is True and rate.seconds[0] > 0
    monkeypatch.setattr(store, 'free_bytes', lambda d: 10**12)  # room again
    rec = phase.run(ctx, p)
    assert [(x['mode'], x['new_samples'], x['samples'], x['stopped']) for x in rec.rows] == [
        ('bf16', 5, 8, None),
        ('compact', 6, 8, None),
    ]
    rate = query(ctx.catalog, "SELECT * FROM rates WHERE phase = 'extract'")
    assert (len(rate), rate.samples[0], json.loads(rate.detail[0])['stopped']) == (1, 6, False)  # the rerun's
    ref = RunContext.open('', tmp_path / 'ref')
    phase.run(ref, p)  # uninterrupted
    for mode, names in (('bf16', ('aux', 'final')), ('compact', ('aux', 'topk_p', 'topk_idx'))):
        d, r = hidden / mode / 'train', ref.data_root / 'hidden' / mode / 'train'
        ids = [x['sample_id'] for x in read_index(d)]
        assert len(ids) == len(set(ids)) == 8 and set(ids) == {x['sample_id'] for x in read_index(r)}
        a, b = (
            {s['sample_id']: s for s in HiddenStates(d, raw=True)},
            {s['sample_id']: s for s in HiddenStates(r, raw=True)},
        )
        assert all(torch.equal(a[s][k], b[s][k]) for s in ids for k in names), mode
        n = query(ctx.catalog, 'SELECT count(*) AS n FROM hidden_index WHERE store = ?', [str(d.resolve())]).n[0]
        assert n == 8


def test_compact_mode_bound(kimi, tmp_path):
    "compact: aux within 2^-4|x| + 2^-10 s (+ bf16 output rounding), top-k = direct forward's over the draft vocab"
    m, rows = load_target(kimi), samples(5, seed=2)
    tids = torch.arange(7, 4096, 5)
    extract(m, rows, tmp_path / 'h', aux_layers=AUX, mode='compact', d2t=tids - torch.arange(len(tids)), topk=16)
    got, raw = by_id(tmp_path / 'h'), {s['sample_id']: s for s in HiddenStates(tmp_path / 'h', raw=True)}
    for r in rows:
        with torch.no_grad():
            hs = m(torch.tensor([r['input_ids']]), output_hidden_states=True).hidden_states
        x = torch.cat([hs[k][0] for k in AUX], -1).float()
        s = raw[r['sample_id']]['aux_scale'].repeat_interleave(64, -1)
        assert ((got[r['sample_id']]['aux'].float() - x).abs() <= (2**-4 + 2**-8) * x.abs() + 2**-10 * s).all()
        p = torch.softmax(hs[-1][0].float() @ m.lm_head.weight[tids].float().T, -1).topk(16)
        assert torch.equal(got[r['sample_id']]['topk_idx'].long(), p.indices)
        assert ((got[r['sample_id']]['topk_p'].float() - p.values).abs() <= 2**-11 * p.values + 1e-7).all()
    validate(tmp_path / 'h', corpus=rows, expect=dict(mode='compact', topk=16, draft_vocab_size=len(tids)))


RANK_SCRIPT = textwrap.dedent('''
    import sys, json
    from eagle3nb.extract import extract, load_target
    extract(load_target(sys.argv[1]), json.load(open(sys.argv[2])), sys.argv[3], aux_layers=[2, 4, 6], shard_bytes=4000)
''')


@pytest.mark.skipif(
    shutil.which('torchrun') is None and not Path(sys.executable).with_name('torchrun').exists(), reason='no torchrun'
)
def test_torchrun_splits_ranks(kimi, tmp_path):
    "torchrun --nproc_per_node 2: each rank writes its own shards; together they hold every sample once"
    import json

    rows = samples(20, seed=3)
    (tmp_path / 'rows.json').write_text(json.dumps(rows))
    (tmp_path / 'rank.py').write_text(RANK_SCRIPT)
    torchrun = shutil.which('torchrun') or str(Path(sys.executable).with_name('torchrun'))
    r = subprocess.run(
        [
            torchrun,
            '--nproc_per_node',
            '2',
            '--master_port',
            '0',
            str(tmp_path / 'rank.py'),
            str(kimi),
            str(tmp_path / 'rows.json'),
            str(tmp_path / 'h'),
        ],
        env={**os.environ, 'OMP_NUM_THREADS': '1'},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    prefixes = {f.name.split('-')[0] for f in shard_files(tmp_path / 'h')}
    assert prefixes == {'r000', 'r001'}
    assert sorted(x['sample_id'] for x in read_index(tmp_path / 'h')) == [x['sample_id'] for x in rows]
    validate(tmp_path / 'h', corpus=rows)


def test_torchrun_extract_recipe(kimi, tmp_path):
    "The documented command: torchrun --no-python python -c 'extract_recipe(recipe)' on 2 CPU ranks, both modes, catalog index"
    import json
    from datasets import Dataset

    rows = samples(16, seed=4)
    Dataset.from_list(rows).save_to_disk(str(tmp_path / 'data' / 'corpus' / 'train'))
    (tmp_path / 'r.yaml').write_text(
        json.dumps(
            dict(
                name='t',
                target=dict(toy='kimi-tiny', model=str(kimi)),
                data_root=str(tmp_path / 'data'),
                catalog=str(tmp_path / 'c.duckdb'),
            )
        )
    )
    torchrun = shutil.which('torchrun') or str(Path(sys.executable).with_name('torchrun'))
    code = f"from eagle3nb.extract import extract_recipe; extract_recipe({str(tmp_path / 'r.yaml')!r}, modes='bf16,compact', shard_mb=0)"
    r = subprocess.run(
        [torchrun, '--nproc_per_node', '2', '--master_port', '0', '--no-python', sys.executable, '-c', code],
        env={**os.environ, 'OMP_NUM_THREADS': '1'},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    for mode in ('bf16', 'compact'):
        d = tmp_path / 'data' / 'hidden' / mode / 'train'
        assert {f.name.split('-')[0] for f in shard_files(d)} == {'r000', 'r001'}
        validate(d, corpus=rows, expect=dict(mode=mode, layer_ids=[2, 4, 5]))
    n = query(tmp_path / 'c.duckdb', 'SELECT mode, count(*) AS n FROM hidden_index GROUP BY 1 ORDER BY 1')
    assert n.values.tolist() == [['bf16', 16], ['compact', 16]]
