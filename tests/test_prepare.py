"`eagle3nb prepare` end to end: the directory it writes, idempotence, nothing lost, clear errors"

import json, os, subprocess, sys
from pathlib import Path
import pyarrow.parquet as pq
from eagle3nb.prepare import conversations, read_manifest, prepare

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / 'tests' / 'fixtures' / 'datasets'
EAGLE3NB = str(Path(sys.executable).parent / 'eagle3nb')


def cli(*args):
    return subprocess.run([EAGLE3NB, 'prepare', *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_cli_writes_shards_manifest_rejects_and_is_idempotent(tmp_path):
    p = cli(
        '--format',
        'openai',
        '--input',
        FIX / 'llamafactory_reason_tool_use_demo.sample.jsonl',
        '--name',
        'lf',
        '--out',
        tmp_path,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    d = tmp_path / 'lf'
    m = read_manifest(d)
    assert (m['read'], m['kept'], m['rejected']) == (4, 4, 0) and m['params']['format'] == 'openai'
    assert sorted(f.name for f in d.iterdir()) == [
        '.eagle3nb-output.json',
        'data-00000-of-00001.parquet',
        'manifest.json',
        'rejects.jsonl',
    ]
    assert pq.read_table(d / m['shards'][0]).num_rows == 4
    calls = [tc for c in conversations(d) for msg in c['messages'] for tc in (msg['tool_calls'] or [])]
    assert calls and all(
        isinstance(tc['function']['arguments'], dict) and tc['id'].startswith('functions.') for tc in calls
    )
    before = (d / 'manifest.json').stat().st_mtime_ns
    assert (
        cli(
            '--format',
            'openai',
            '--input',
            FIX / 'llamafactory_reason_tool_use_demo.sample.jsonl',
            '--name',
            'lf',
            '--out',
            tmp_path,
        ).returncode
        == 0
    )
    assert (d / 'manifest.json').stat().st_mtime_ns == before  # same input and parameters: nothing rewritten


def test_rejects_are_written_with_reason_and_excerpt(tmp_path):
    m = prepare(
        FIX / 'specforge_tool_use_conversation.jsonl', 'openai', 'sf', tmp_path, progress=False, allow_empty=True
    )
    assert (m['read'], m['kept'], m['rejected']) == (1, 0, 1)
    rej = [json.loads(l) for l in open(tmp_path / 'sf' / 'rejects.jsonl')]
    assert (
        rej[0]['index'] == 0
        and rej[0]['reason'] == 'tool call arguments are not valid JSON'
        and '"id": 9' in rej[0]['excerpt']
    )


def test_every_demo_dataset_accounts_for_every_record(tmp_path):
    "The demo recipe's datasets: kept + rejected = read, per dataset, and ids are unique"
    import yaml

    r = yaml.safe_load((ROOT / 'recipes' / 'demo.yaml').read_text())
    for ds in r['datasets']:
        m = prepare(ROOT / ds['path'], ds['format'], ds['name'], tmp_path, kind=ds.get('kind'), progress=False)
        assert m['kept'] + m['rejected'] == m['read'] > 0, (ds['name'], m)
        ids = [c['sample_id'] for c in conversations(tmp_path / ds['name'])]
        assert len(ids) == len(set(ids)) == m['kept']


def test_count_sampling_is_seeded_and_keeps_source_ids(tmp_path):
    a = prepare(FIX / 'alpaca_en_demo.sample.json', 'alpaca', 'a', tmp_path / '1', count=2, seed=3, progress=False)
    b = prepare(FIX / 'alpaca_en_demo.sample.json', 'alpaca', 'a', tmp_path / '2', count=2, seed=3, progress=False)
    prepare(FIX / 'alpaca_en_demo.sample.json', 'alpaca', 'a', tmp_path / '3', progress=False)
    full = {c['source_index']: c['sample_id'] for c in conversations(tmp_path / '3' / 'a')}
    sa = [(c['source_index'], c['sample_id']) for c in conversations(tmp_path / '1' / 'a')]
    assert a['kept'] == b['kept'] == 2 and sa == [
        (c['source_index'], c['sample_id']) for c in conversations(tmp_path / '2' / 'a')
    ]
    assert all(full[i] == s for i, s in sa)  # a sampled record has the id it has in the full set


def test_clear_errors(tmp_path):
    p = cli('--format', 'sharegtp', '--input', FIX / 'alpaca_en_demo.sample.json', '--name', 'x', '--out', tmp_path)
    assert p.returncode == 1 and "unknown format 'sharegtp'" in p.stderr and 'Traceback' not in p.stderr
    p = cli('--format', 'alpaca', '--input', tmp_path, '--name', 'x', '--out', tmp_path / 'o')
    assert p.returncode == 1 and 'no .json, .jsonl, .parquet or .traj files' in p.stderr


def test_prepared_parquet_reads_back_as_nested_records(tmp_path):
    "datasets, pandas and DuckDB read messages and tools as records; arguments and parameters are JSON text"
    import duckdb, pandas as pd
    from datasets import load_dataset

    m = prepare(FIX / 'glaive_toolcall_en_demo.sample.json', 'sharegpt', 'g', tmp_path, progress=False)
    shards = [str(tmp_path / 'g' / s) for s in m['shards']]
    want = list(conversations(tmp_path / 'g'))
    calls = [
        (i, j, k)
        for i, c in enumerate(want)
        for j, msg in enumerate(c['messages'])
        for k, _ in enumerate(msg['tool_calls'] or [])
    ]
    assert calls and want[0]['tools'] and not all(c['tools'] for c in want)
    ds = load_dataset('parquet', data_files=shards, split='train')
    assert [r['sample_id'] for r in ds] == [c['sample_id'] for c in want]
    for i, j, k in calls:
        tc = ds[i]['messages'][j]['tool_calls'][k]
        assert isinstance(tc['function']['arguments'], str)
        assert (
            json.loads(tc['function']['arguments']) == want[i]['messages'][j]['tool_calls'][k]['function']['arguments']
        )
    assert [[x['role'] for x in r['messages']] for r in ds] == [[x['role'] for x in c['messages']] for c in want]
    t0 = ds[0]['tools'][0]
    assert (
        t0['function']['name'] == want[0]['tools'][0]['function']['name']
        and json.loads(t0['function']['parameters']) == want[0]['tools'][0]['function']['parameters']
    )
    df = pd.read_parquet(shards[0])
    assert [x['content'] for x in df['messages'].iloc[0]] == [x['content'] for x in want[0]['messages']]
    assert df['tools'].iloc[0][0]['function']['name'] == want[0]['tools'][0]['function']['name']
    q = duckdb.sql(
        f"SELECT sample_id, len(messages) AS n, messages[1].role AS first, tools[1].function.name AS tool FROM read_parquet({shards!r}) ORDER BY source_index"
    ).fetchall()
    assert q == [
        (
            c['sample_id'],
            len(c['messages']),
            c['messages'][0]['role'],
            c['tools'][0]['function']['name'] if c['tools'] else None,
        )
        for c in sorted(want, key=lambda c: c['source_index'])
    ]
    n_calls = duckdb.sql(
        f"SELECT count(*) FROM (SELECT unnest(m.tool_calls) FROM (SELECT unnest(messages) AS m FROM read_parquet({shards!r})))"
    ).fetchall()[0][0]
    assert n_calls == len(calls)


def test_old_layout_says_to_rerun_prepare(tmp_path, monkeypatch):
    "A directory written with JSON-text messages (schema version 1) is refused by every reader with what to do; prepare rebuilds it"
    import pyarrow as pa
    from eagle3nb.prepare import PrepareError, load_prepared
    from eagle3nb.render import render_dataset
    from eagle3nb.toy import ensure_toy

    src = FIX / 'llamafactory_reason_tool_use_demo.sample.jsonl'
    m = prepare(src, 'openai', 'lf', tmp_path, progress=False)
    d, shard = tmp_path / 'lf', tmp_path / 'lf' / m['shards'][0]
    t = pq.read_table(shard)
    for col in ('messages', 'tools'):  # what schema version 1 wrote: JSON text
        t = t.set_column(t.schema.get_field_index(col), col, pa.array([json.dumps(x) for x in t[col].to_pylist()]))
    pq.write_table(t, shard)
    (d / 'manifest.json').write_text(
        json.dumps({**m, 'schema_version': 1, 'params': {**m['params'], 'schema_version': 1}})
    )
    for read in (
        lambda: load_prepared(d),
        lambda: list(conversations(d)),
        lambda: render_dataset(d, ensure_toy('kimi-tiny'), tmp_path / 'r', num_proc=1),
    ):
        try:
            read()
            raise AssertionError('old layout was read')
        except PrepareError as e:
            assert 'run `eagle3nb prepare` for this dataset again' in str(e) and 'schema version 1' in str(e)
    m2 = prepare(
        src, 'openai', 'lf', tmp_path, progress=False
    )  # same command: the schema version differs, so it rebuilds
    assert m2['schema_version'] == 2 and len(list(conversations(d))) == m2['kept'] == 4


# Many datasets at once (`prepare.prepare_many`, the prepare phase's `workers`): the same result as one after
# another, a bad dataset costs only itself, and a rerun after a kill redoes only what was not finished.

UNTIMED = lambda m: {k: v for k, v in m.items() if k not in ('seconds', 'records_per_s')}


def phase_ctx(tmp_path, name: str):
    "A prepare phase's context: its own data root and catalog under `tmp_path/name` (no target: none is loaded)"
    from eagle3nb.phase import RunContext
    from eagle3nb.recipe import Recipe

    d = tmp_path / name
    r = Recipe(name=name, target=dict(model=str(d / 'model')), data_root=str(d / 'data'), catalog=str(d / 'c.duckdb'))
    return RunContext(r, d)


def catalog_rows(ctx) -> list:
    "The catalog's `datasets` rows, the manifest without its timings"
    from eagle3nb.catalog import connect

    with connect(ctx.catalog, read_only=True) as con:
        q = 'SELECT name, format, source, read, kept, rejected, kinds, manifest FROM datasets ORDER BY name'
        return [(*r[:7], UNTIMED(json.loads(r[7]))) for r in con.execute(q).fetchall()]


def three_datasets() -> list:
    "Three fixture datasets, one with rejects (glaive's tool calls read as hermes: two of four lack its tags)"
    from eagle3nb.phases.prepare import sample_datasets
    from eagle3nb.recipe import Dataset

    hermes = Dataset(name='glaive_hermes', format='hermes', path=str(FIX / 'glaive_toolcall_en_demo.sample.json'))
    return [*sample_datasets(['alpaca_demo', 'xlam']), hermes]


def test_parallel_prepare_equals_serial(tmp_path):
    "3 worker processes write the same shards, rejects, manifests and catalog rows as one process in turn"
    from eagle3nb.phases.prepare import prepare_datasets

    serial, parallel = phase_ctx(tmp_path, 'serial'), phase_ctx(tmp_path, 'parallel')
    one = prepare_datasets(serial, three_datasets(), progress=False, workers=1)
    three = prepare_datasets(parallel, three_datasets(), progress=False, workers=3)
    names = [d.name for d in three_datasets()]
    assert list(one) == list(three) == names and three['glaive_hermes']['manifest']['rejected'] == 2
    for n in names:
        a, b = serial.data_root / 'prepared' / n, parallel.data_root / 'prepared' / n
        assert UNTIMED(one[n]['manifest']) == UNTIMED(three[n]['manifest'])
        assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
        assert all(pq.read_table(a / s).equals(pq.read_table(b / s)) for s in one[n]['manifest']['shards'])
        assert (a / 'rejects.jsonl').read_bytes() == (b / 'rejects.jsonl').read_bytes()
    assert catalog_rows(serial) == catalog_rows(parallel) and [r[0] for r in catalog_rows(serial)] == sorted(names)


def test_a_bad_dataset_costs_only_itself(tmp_path):
    "A missing file and a wrong format, in worker processes: the others are prepared and recorded, the error names both"
    import pytest
    from eagle3nb.phases.prepare import prepare_datasets
    from eagle3nb.prepare import PrepareError
    from eagle3nb.recipe import Dataset

    ctx = phase_ctx(tmp_path, 'bad')
    good = three_datasets()[:2]
    gone = Dataset(name='gone', format='alpaca', path=str(tmp_path / 'gone.json'))
    wrong = Dataset(name='wrong', format='xlam', path=str(FIX / 'alpaca_en_demo.sample.json'))
    with pytest.raises(PrepareError) as e:
        prepare_datasets(ctx, [gone, good[0], wrong, good[1]], progress=False, workers=2)
    head, *lines = str(e.value).splitlines()
    assert head.startswith('2 of 4 datasets failed to prepare; the other 2 are prepared and in the catalog'), head
    assert lines[0].startswith('  gone: FileNotFoundError: ') and 'gone.json: no such file' in lines[0], lines
    assert lines[1].startswith('  wrong: PrepareError: ') and 'no record kept with --format xlam' in lines[1], lines
    assert [r[0] for r in catalog_rows(ctx)] == ['alpaca_demo', 'xlam']
    assert sorted(p.name for p in (ctx.data_root / 'prepared').iterdir()) == ['alpaca_demo', 'xlam']


def test_a_hub_dataset_not_downloaded_yet(tmp_path):
    "A repo dataset whose raw folder is missing: prepare says to download first, and prepares nothing"
    import pytest
    from eagle3nb.phases.prepare import prepare_datasets
    from eagle3nb.prepare import PrepareError
    from eagle3nb.recipe import Dataset

    ctx = phase_ctx(tmp_path, 'hub')
    hub = Dataset(
        name='uc',
        format='ultrachat',
        repo='HuggingFaceH4/ultrachat_200k',
        revision='main',
        path=str(tmp_path / 'raw' / 'uc'),
    )
    with pytest.raises(PrepareError, match=r'not downloaded yet: uc \(.*raw/uc\); run `eagle3nb download RECIPE`'):
        prepare_datasets(ctx, [hub, *three_datasets()[:1]], progress=False, workers=1)
    assert not (ctx.data_root / 'prepared').exists() or not any((ctx.data_root / 'prepared').iterdir())


KILLED = '''
import os, signal, sys
import eagle3nb.prepare as P
from eagle3nb.phase import RunContext
from eagle3nb.phases.prepare import prepare_datasets
from eagle3nb.recipe import Dataset, Recipe

write = P._write_shards


def dying(rows, d, n):  # kill -9 half-way through publishing xlam: its shards written, no manifest yet
    names = write(rows, d, n)
    if d.name.startswith('.xlam.tmp-'):
        os.kill(os.getpid(), signal.SIGKILL)
    return names


P._write_shards = dying
ctx = RunContext(Recipe.model_validate_json(sys.argv[1]), sys.argv[2])
datasets = [Dataset.model_validate_json(d) for d in sys.argv[3:]]
prepare_datasets(ctx, datasets, progress=False, workers=1)
'''


def test_rerun_after_a_kill_redoes_only_the_unfinished(tmp_path):
    "Killed while publishing the second of three: the first stays as it was, the rerun does the other two and cleans up"
    from eagle3nb.phases.prepare import prepare_datasets

    ctx, datasets = phase_ctx(tmp_path, 'killed'), three_datasets()
    args = [ctx.recipe.model_dump_json(), str(ctx.run_dir), *(d.model_dump_json() for d in datasets)]
    p = subprocess.run([sys.executable, '-c', KILLED, *args], capture_output=True, text=True, timeout=300)
    out = ctx.data_root / 'prepared'
    assert p.returncode == -9, p.stderr[-2000:]
    left = sorted(f.name for f in out.iterdir())
    assert left[1] == 'alpaca_demo' and left[0].startswith('.xlam.tmp-') and len(left) == 2, left
    assert [r[0] for r in catalog_rows(ctx)] == ['alpaca_demo']
    before = (out / 'alpaca_demo' / 'manifest.json').stat().st_mtime_ns
    done = prepare_datasets(ctx, datasets, progress=False, workers=2)
    assert {n: r['reused'] for n, r in done.items()} == dict(alpaca_demo=True, xlam=False, glaive_hermes=False)
    assert (out / 'alpaca_demo' / 'manifest.json').stat().st_mtime_ns == before  # not redone
    assert sorted(f.name for f in out.iterdir()) == ['alpaca_demo', 'glaive_hermes', 'xlam']  # the temp folder gone
    assert [r[0] for r in catalog_rows(ctx)] == ['alpaca_demo', 'glaive_hermes', 'xlam']


ORPHAN = '''
import multiprocessing, os, signal, sys, time
from concurrent.futures import ProcessPoolExecutor
import eagle3nb.prepare as P

if __name__ == '__main__':
    mp = multiprocessing.get_context('spawn')  # as prepare_many starts its workers
    ex = ProcessPoolExecutor(1, mp_context=mp, initializer=P._worker_start, initargs=(os.getpid(),))
    ex.submit(time.sleep, 0).result()  # the worker is up
    ex.submit(time.sleep, 120)
    print(*ex._processes, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # the parent killed: nobody will stop the worker
'''


def test_a_worker_exits_when_its_parent_is_killed(tmp_path):
    "A worker whose parent was killed (kill -9) exits in about a second, not after its job and then never"
    import signal, time

    log = tmp_path / 'parent.log'
    with open(log, 'w') as f:  # a file, not a pipe: a worker left alive would hold a pipe open and hang this test
        p = subprocess.run([sys.executable, '-c', ORPHAN], stdout=f, stderr=subprocess.STDOUT, timeout=120)
    assert p.returncode == -9, log.read_text()[-2000:]
    pid, t0 = int(log.read_text().split()[0]), time.time()
    while time.time() - t0 < 10 and _alive(pid):
        time.sleep(0.2)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)  # this test's own worker
        raise AssertionError(f'worker {pid} still running 10 s after its parent was killed')


def _alive(pid: int) -> bool:
    "Is process `pid` running (not gone, not a zombie waiting to be reaped)?"
    try:
        return open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[0] != 'Z'
    except OSError:
        return False
