"Catalog integration tests: DuckDB's lock across real processes (a live Jupyter kernel), partition SQL on hand-made lengths, upserts, phase state"

import subprocess, sys, threading, time
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from eagle3nb.catalog import (
    CatalogLocked,
    catalog_path,
    connect,
    partition,
    record_run,
    samples_df,
    set_state,
    snapshot,
    state_counts,
    todo,
    upsert_samples,
    query,
)


@pytest.fixture
def cat(tmp_path):
    "A fresh catalog path (not created yet)"
    return catalog_path(tmp_path)


def one(path, sql):
    "The single value `sql` returns"
    return query(path, sql).iloc[0, 0]


# --- DuckDB's lock across processes -------------------------------------------------------------------------


@pytest.fixture(scope='module')
def kernel():
    "A live Jupyter kernel (what JupyterLab runs a notebook in): (client, pid)"
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name='python3')
    yield kc, km.provisioner.process.pid
    kc.stop_channels()
    km.shutdown_kernel(now=True)


def run_in(kc, code):
    "Execute `code` in the kernel; fail the test if it raised"
    r = kc.execute_interactive(code, timeout=60, output_hook=lambda msg: None)
    assert r['content']['status'] == 'ok', r['content']


@pytest.fixture
def kernel_holds(kernel, cat):
    "The kernel keeps a read-write connection to `cat` open, as `con = duckdb.connect(...)` in a notebook would"
    kc, pid = kernel
    upsert_samples(cat, [dict(sample_id='a', dataset='d', kind='full', prompt_tokens=10, completion_tokens=5)])
    run_in(kc, f"import duckdb; con = duckdb.connect({str(cat)!r})")
    yield kc, pid
    run_in(kc, "con.close()")


def test_kernel_lock_fails_with_holder_named(kernel_holds, cat):
    "A writer gives up after `timeout` with the kernel's PID, what it is, and what to do"
    _, pid = kernel_holds
    t0 = time.monotonic()
    with pytest.raises(CatalogLocked) as e:
        upsert_samples(cat, [dict(sample_id='b', dataset='d')], timeout=1.0)
    assert 1.0 <= time.monotonic() - t0 < 5
    msg = str(e.value)
    assert e.value.pid == pid and f'PID {pid}' in msg
    assert 'a Jupyter kernel' in msg and 'ipykernel_launcher' in msg  # from /proc/PID/cmdline
    assert 'restart its kernel' in msg and 'snapshot' in msg
    assert 'Could not set lock on file' in str(e.value.__cause__)  # DuckDB's own message stays in the chain


def test_kernel_lock_blocks_readers_too(kernel_holds, cat):
    "DuckDB refuses a read-only open while another process holds read-write; the message says so"
    _, pid = kernel_holds
    for read in (lambda: samples_df(cat, timeout=0.5), lambda: state_counts(cat, 'generate', timeout=0.5)):
        with pytest.raises(CatalogLocked, match='read-only ones included') as e:
            read()
        assert e.value.pid == pid and 'for a read-only connection' in str(e.value)


def test_writer_waits_until_kernel_closes(kernel, cat):
    "A writer that meets the kernel's lock retries, and succeeds as soon as the kernel closes its connection"
    kc, _ = kernel
    upsert_samples(cat, [dict(sample_id='a', dataset='d')])
    run_in(kc, f"import duckdb; con = duckdb.connect({str(cat)!r})")
    closer = threading.Timer(1.5, run_in, (kc, "con.close()"))
    closer.start()
    t0 = time.monotonic()
    try:
        upsert_samples(cat, [dict(sample_id='b', dataset='d')], timeout=30)
    finally:
        closer.join()
    assert 1.4 <= time.monotonic() - t0 < 15
    assert one(cat, 'SELECT count(*) FROM samples') == 2


def test_kernel_snapshot_holds_no_lock(kernel, cat):
    "A notebook that keeps `snapshot(path)` open does not stop a phase from writing"
    kc, _ = kernel
    upsert_samples(cat, [dict(sample_id='a', dataset='d', kind='full', prompt_tokens=10)])
    run_in(
        kc,
        f"from eagle3nb.catalog import snapshot; snap = snapshot({str(cat)!r}); assert snap.execute('SELECT count(*) FROM samples').fetchall() == [(1,)]",
    )
    try:
        partition(cat, timeout=0)  # no waiting at all
        set_state(cat, ['a'], 'generate', 'done', timeout=0)
    finally:
        run_in(kc, "snap.close()")


def hold(path, read_only):
    "A plain subprocess holding a connection until its stdin closes"
    p = subprocess.Popen(
        [
            sys.executable,
            '-c',
            f"import duckdb, sys; c = duckdb.connect({str(path)!r}, read_only={read_only}); "
            "print('held', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout.readline().strip() == 'held'
    return p


def test_read_only_holder_blocks_writers_not_readers(cat):
    "A read-only holder shares with readers; a writer times out with a message that says the holder is read-only"
    upsert_samples(cat, [dict(sample_id='a', dataset='d')])
    p = hold(cat, read_only=True)
    try:
        assert len(samples_df(cat, timeout=0)) == 1
        with pytest.raises(CatalogLocked, match='holds a read-only connection, which blocks writers') as e:
            record_run(cat, 'r', 'x', 'running', timeout=0.3)
        assert e.value.pid == p.pid
    finally:
        p.stdin.close()
        p.wait(10)
    record_run(cat, 'r', 'x', 'running', timeout=0)


def test_calls_leave_the_file_free(cat):
    "After any catalog call returns, another process can open the file read-write at once"
    upsert_samples(cat, [dict(sample_id='a', dataset='d', kind='full', prompt_tokens=10)])
    partition(cat)
    set_state(cat, 'a', 'generate', 'done')
    samples_df(cat)
    snapshot(cat)
    code = f"import duckdb; c = duckdb.connect({str(cat)!r}); print(c.execute('SELECT count(*) FROM samples').fetchall()[0][0])"
    assert (
        subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True).stdout.strip() == '1'
    )


# --- partition SQL on hand-made length distributions ------------------------------------------------------


def sample(i, kind, prompt, completion=None):
    return dict(sample_id=f's{i:03d}', dataset='d', kind=kind, prompt_tokens=prompt, completion_tokens=completion)


def parts(path):
    "{sample_id: (partition, exclusion_reason)}"
    df = samples_df(path, columns=['sample_id', 'partition', 'exclusion_reason'])
    none = lambda v: None if pd.isna(v) else v  # pandas reads SQL NULL in a text column as NaN
    return {r.sample_id: (none(r.partition), none(r.exclusion_reason)) for r in df.itertuples()}


def test_partition_boundaries_with_defaults(cat):
    "Default recipe values: max_ctx 10,240, max_new_tokens 2,048, long_ctx 32,768"
    rows = [
        sample(0, 'prompt_only', 8_192),  # 8,192 + 2,048 = 10,240: exactly max_ctx
        sample(1, 'prompt_only', 8_193),  # 10,241
        sample(2, 'prompt_only', 30_720),  # 32,768: exactly long_ctx
        sample(3, 'prompt_only', 30_721),  # 32,769
        sample(4, 'full', 10_000, 240),  # total 10,240
        sample(5, 'full', 10_000, 241),  # total 10,241
        sample(6, 'native', 30_000, 2_768),  # total 32,768
        sample(7, 'native', 30_000, 2_769),  # total 32,769
        sample(8, 'prompt_only', 500_000),  # far beyond
        sample(9, 'full', 9_000, 0),
    ]  # prompt 9,000: main, since it is not generated again
    upsert_samples(cat, rows)
    s = partition(cat)
    got = parts(cat)
    assert [got[f's{i:03d}'][0] for i in range(10)] == [
        'main',
        'long',
        'long',
        'excluded',
        'main',
        'long',
        'long',
        'excluded',
        'excluded',
        'main',
    ]
    assert got['s003'][1] == 'prompt_tokens + max_new_tokens = 32769 > long_ctx = 32768'
    assert got['s007'][1] == 'total_tokens = 32769 > long_ctx = 32768'
    assert got['s008'][1] == 'prompt_tokens + max_new_tokens = 502048 > long_ctx = 32768'
    assert all(got[f's{i:03d}'][1] is None for i in (0, 1, 2, 4, 5, 6, 9))
    assert s.partition.tolist() == ['main', 'long', 'excluded'] and s.samples.tolist() == [3, 4, 3]
    assert s.concurrency.tolist() == [192, 16, 0] and s.ctx.tolist()[:2] == [10_240, 32_768]
    assert s.tokens.tolist() == [10_240 + 10_240 + 9_000, 10_241 + 32_768 + 10_241 + 32_768, 32_769 + 32_769 + 502_048]


def test_partition_parameters_recorded(cat):
    "The `partitions` table holds what `generate` needs: ctx and concurrency per partition, and the parameters"
    upsert_samples(cat, [sample(0, 'prompt_only', 100)])
    partition(cat, max_ctx=4_096, max_new_tokens=1_000, long_ctx=8_192, c_main=64, c_long=4)
    p = query(cat, 'SELECT partition, ctx, concurrency, samples, params FROM partitions ORDER BY ctx NULLS LAST')
    assert p[['partition', 'ctx', 'concurrency', 'samples']].values.tolist()[:2] == [
        ['main', 4_096, 64, 1],
        ['long', 8_192, 4, 0],
    ]
    assert '"max_new_tokens": 1000' in p.params[0]


def test_partition_matches_numpy_on_lognormal_lengths(cat):
    "On 20,000 hand-made lognormal lengths of mixed kinds, the SQL agrees with a numpy oracle sample by sample"
    rng = np.random.default_rng(0)
    n = 20_000
    kind = rng.choice(['prompt_only', 'full', 'native'], n)
    prompt = rng.lognormal(7.5, 1.2, n).astype(int)
    completion = rng.lognormal(6.5, 1.3, n).astype(int)
    completion[kind == 'prompt_only'] = 0
    t = pa.table(
        dict(
            sample_id=[f'{i:06d}' for i in range(n)],
            dataset=np.where(kind == 'native', 'agent', 'chat'),
            kind=kind,
            prompt_tokens=prompt,
            completion_tokens=completion,
        )
    )
    upsert_samples(cat, t)
    max_ctx, mnt, long_ctx = 6_000, 1_500, 20_000
    partition(cat, max_ctx=max_ctx, max_new_tokens=mnt, long_ctx=long_ctx)
    budget = np.where(kind == 'prompt_only', prompt + mnt, prompt + completion)
    want = np.where(budget <= max_ctx, 'main', np.where(budget <= long_ctx, 'long', 'excluded'))
    got = samples_df(cat, columns=['sample_id', 'partition']).partition.to_numpy()
    assert (got == want).all()
    assert len(set(want)) == 3  # the distribution really exercises all three


def test_partition_long_off_and_regenerated_full(cat):
    "c_long=0 sends long samples to excluded, saying why; generate_kinds gives full samples a generation budget"
    upsert_samples(cat, [sample(0, 'full', 90, 5), sample(1, 'full', 95, 10)])
    partition(cat, max_ctx=100, max_new_tokens=20, long_ctx=200, c_long=0)
    assert parts(cat) == {
        's000': ('main', None),
        's001': ('excluded', 'total_tokens = 105 > max_ctx = 100 and the long partition is off (c_long = 0)'),
    }
    partition(cat, max_ctx=100, max_new_tokens=20, long_ctx=200, generate_kinds=['prompt_only', 'full'])
    assert parts(cat) == {'s000': ('long', None), 's001': ('long', None)}  # 90 + 20 = 110, 95 + 20 = 115


def test_partition_rejects_bad_parameters(cat):
    upsert_samples(cat, [sample(0, 'full', 1, 1)])
    with pytest.raises(ValueError, match='need 0 < max_ctx <= long_ctx'):
        partition(cat, max_ctx=50_000)
    with pytest.raises(ValueError, match='max_new_tokens must be >= 0'):
        partition(cat, max_new_tokens=-1)
    with pytest.raises(ValueError, match='c_main >= 1'):
        partition(cat, c_main=0)


# --- idempotent upserts ---------------------------------------------------------------------------------


def test_upsert_idempotent_across_input_types(cat):
    "The same batch as Arrow, pandas or dicts, once or three times, leaves the same rows"
    rows = [sample(i, 'full', 100 + i, 10 * i) | dict(has_think=i % 2 == 0, n_turns=i) for i in range(50)]
    upsert_samples(cat, rows)
    first = samples_df(cat)
    for batch in (pa.Table.from_pylist(rows), pd.DataFrame(rows), rows):
        upsert_samples(cat, batch)
    pd.testing.assert_frame_equal(samples_df(cat), first)
    assert first.total_tokens.tolist() == [100 + i + 10 * i for i in range(50)]


def test_upsert_replaces_lengths_resets_partition_keeps_state(cat):
    "New lengths replace old ones and clear the partition; other phases' progress survives a re-render"
    upsert_samples(cat, [sample(0, 'prompt_only', 100)])
    partition(cat)
    set_state(cat, 's000', 'generate', 'done')
    upsert_samples(cat, [sample(0, 'prompt_only', 40_000)])
    assert parts(cat) == {'s000': (None, None)}
    assert samples_df(cat, phases=['generate']).state_generate.tolist() == ['done']
    partition(cat)
    assert parts(cat)['s000'][0] == 'excluded'


def test_upsert_partial_columns(cat):
    "Re-upserting the same lengths keeps the partition; a partial update keeps other columns and re-derives the total"
    upsert_samples(cat, [sample(0, 'full', 100, 10)])
    partition(cat)
    upsert_samples(cat, [sample(0, 'full', 100, 10)])
    upsert_samples(cat, [dict(sample_id='s000', dataset='d', has_think=True)])
    r = samples_df(cat).iloc[0]
    assert (r.partition, r.total_tokens, r.has_think, r.kind) == ('main', 110, True, 'full')
    upsert_samples(cat, [dict(sample_id='s000', dataset='d', completion_tokens=20)])
    r = samples_df(cat).iloc[0]
    assert (r.prompt_tokens, r.total_tokens) == (100, 120) and pd.isna(r.partition)


def test_upsert_errors_name_the_problem(cat):
    with pytest.raises(ValueError, match=r"unknown sample columns \['promt_tokens'\]"):
        upsert_samples(cat, [dict(sample_id='a', dataset='d', promt_tokens=1)])
    with pytest.raises(ValueError, match=r"\[\('a', 2\)\]"):
        upsert_samples(cat, [dict(sample_id='a', dataset='d'), dict(sample_id='a', dataset='d')])
    assert not cat.exists() or one(cat, 'SELECT count(*) FROM samples') == 0  # nothing half-written


# --- state per phase ------------------------------------------------------------------------------------


def test_state_per_phase(cat):
    "Phases keep independent states; pending is implicit; failures keep their detail; resume lists what is not done"
    upsert_samples(cat, [sample(i, 'prompt_only', 100) for i in range(5)] + [sample(9, 'prompt_only', 99_999)])
    partition(cat)
    set_state(cat, ['s000', 's001'], 'generate', 'done')
    set_state(cat, ['s002', 's003'], 'generate', 'failed', detail=['HTTP 500', 'timeout'])
    set_state(cat, ['s004'], 'generate', 'running')  # killed mid-flight
    set_state(cat, ['s000'], 'extract', 'done')
    c = state_counts(cat, 'generate', by=None)
    assert dict(zip(c.state, c.samples)) == {'done': 2, 'failed': 2, 'running': 1, 'pending': 1}
    assert todo(cat, 'generate') == ['s002', 's003', 's004']  # s009 is excluded, never work
    assert todo(cat, 'extract') == ['s001', 's002', 's003', 's004']
    f = query(cat, "SELECT sample_id, detail FROM sample_state WHERE state = 'failed' ORDER BY 1")
    assert f.values.tolist() == [['s002', 'HTTP 500'], ['s003', 'timeout']]
    set_state(cat, ['s002', 's003', 's004'], 'generate', 'done')
    set_state(cat, ['s002'], 'generate', 'done')
    assert todo(cat, 'generate') == []
    wide = samples_df(cat, "partition = 'main'", phases=['generate', 'extract'])
    assert wide[['state_generate', 'state_extract']].values.tolist()[:2] == [['done', 'done'], ['done', 'pending']]
    with pytest.raises(KeyError, match="1 sample ids are not in"):
        set_state(cat, ['s000', 'zzz'], 'generate', 'done')


def test_record_run(cat):
    record_run(cat, 'r1', 'generate', 'running', recipe='demo', params=dict(c_main=192))
    record_run(cat, 'r1', 'generate', 'failed')
    record_run(cat, 'r1', 'generate', 'running')
    r = query(cat, 'SELECT status, recipe, params, finished FROM runs')
    assert r.status.tolist() == ['running'] and r.recipe.tolist() == ['demo'] and r.finished.isna().all()
    assert r.params[0] == '{"c_main": 192}'
