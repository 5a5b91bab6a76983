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
