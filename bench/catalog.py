"""Catalog benchmark: build, partition and query a catalog of 1,000,000 synthetic samples, side by side with naive baselines.

    python bench/catalog.py [--n 1000000] [--rows 2000] [--md BENCHMARKS.md]

Side by side, in the same run:
  1. row-by-row `executemany` inserts (what a loop over render's output would do) against our Arrow bulk upsert, on the
     same `--rows` subset; the row-by-row time for all samples is extrapolated linearly (running it would take ~40 min);
  2. partitioning by a pandas round trip (read lengths, compute in numpy, write back with UPDATE ... FROM) against our
     single SQL UPDATE, both on all samples; the two must agree sample by sample.
With --md, the `## catalog` section of that file is replaced (or appended) with the figures and this command.
"""

import argparse, os, platform, re, shutil, sys, tempfile, time
from pathlib import Path
import duckdb, numpy as np, pandas as pd, pyarrow as pa
from eagle3nb.catalog import (
    catalog_path,
    connect,
    length_quantiles,
    partition,
    plot_lengths,
    record_dataset,
    samples_df,
    set_state,
    snapshot,
    state_counts,
    todo,
    upsert_samples,
)

# name: (share, kind, prompt lognormal (mu, sigma), completion lognormal (mu, sigma), events per conversation, think, tools)
DATASETS = dict(
    sharegpt_chat=(0.30, 'full', (6.3, 1.1), (5.9, 0.9), 3, False, False),  # multi-turn chat, prompt median ~550
    ultrachat=(0.20, 'full', (6.0, 0.8), (6.2, 0.6), 3, False, False),
    math_prompts=(0.20, 'prompt_only', (5.0, 0.7), None, 1, False, False),  # prompts the target answers
    reasoning=(0.10, 'native', (5.8, 0.8), (8.2, 0.8), 1, True, False),  # target traces, completion median ~3,600
    agent_traces=(
        0.15,
        'native',
        (8.8, 0.9),
        (5.4, 0.9),
        12,
        True,
        True,
    ),  # long tool-use sessions, prompt median ~6,600
    tool_calls=(0.05, 'full', (6.8, 0.6), (4.5, 0.7), 2, False, True),
)


def synth(n: int, seed: int = 0) -> pa.Table:
    "n synthetic samples with per-dataset lognormal lengths"
    rng = np.random.default_rng(seed)
    names = list(DATASETS)
    share = np.array([DATASETS[k][0] for k in names])
    ds = rng.choice(len(names), n, p=share / share.sum())
    kind, prompt, comp = np.empty(n, object), np.zeros(n, np.int64), np.zeros(n, np.int64)
    n_events, think, tools = np.zeros(n, np.int32), np.zeros(n, bool), np.zeros(n, bool)
    for j, k in enumerate(names):
        _, kd, (pm, ps), c, ev, th, tl = DATASETS[k]
        m = ds == j
        s = int(m.sum())
        kind[m], think[m], tools[m] = kd, th, tl
        prompt[m] = np.maximum(rng.lognormal(pm, ps, s), 8).astype(np.int64)
        comp[m] = rng.lognormal(*c, s).astype(np.int64) + 1 if c else 0
        n_events[m] = rng.integers(1, 2 * ev, s)
    ids = [f'{i:016x}' for i in range(n)]
    return pa.table(
        dict(
            sample_id=ids,
            conversation_id=[f'{i // 4:016x}' for i in range(n)],
            dataset=np.array(names)[ds],
            kind=kind.astype(str),
            n_turns=np.maximum(n_events // 2, 1),
            n_events=n_events,
            prompt_tokens=prompt.astype(np.int32),
            completion_tokens=np.where(kind == 'prompt_only', None, comp),
            has_think=think,
            has_tools=tools,
        )
    )


def timed(f, *a, **kw):
    "(result, seconds)"
    t0 = time.perf_counter()
    r = f(*a, **kw)
    return r, time.perf_counter() - t0


def row_by_row(path, t: pa.Table):
    "The naive path: one INSERT per sample through executemany, in one transaction"
    cols = t.column_names
    total = [p + (c or 0) for p, c in zip(t['prompt_tokens'].to_pylist(), t['completion_tokens'].to_pylist())]
    rows = [tuple(r[c] for c in cols) + (tt,) for r, tt in zip(t.to_pylist(), total)]
    with connect(path) as con:
        con.executemany(
            f"INSERT OR REPLACE INTO samples ({', '.join(cols)}, total_tokens) VALUES ({', '.join('?' * (len(cols) + 1))})",
            rows,
        )


def pandas_partition(path, max_ctx=10_240, max_new_tokens=2_048, long_ctx=32_768):
    "The round-trip path: read lengths into pandas, decide in numpy, write back with UPDATE ... FROM"
    with connect(path, read_only=True) as con:
        df = con.sql('SELECT sample_id, kind, prompt_tokens, total_tokens FROM samples').df()
    gen = (df.kind == 'prompt_only').to_numpy()
    budget = np.where(gen, df.prompt_tokens + max_new_tokens, df.total_tokens)
    part = np.select([budget <= max_ctx, budget <= long_ctx], ['main', 'long'], 'excluded')
    label = np.where(gen, 'prompt_tokens + max_new_tokens', 'total_tokens')
    reason = pd.Series(label).str.cat(pd.Series(budget).astype(str), sep=' = ') + f' > long_ctx = {long_ctx}'
    out = pa.table(dict(sample_id=df.sample_id, p=part, r=reason.where(part == 'excluded', None)))
    with connect(path) as con:
        con.register('_p', out)
        con.execute(
            'UPDATE samples SET partition = _p.p, exclusion_reason = _p.r FROM _p WHERE samples.sample_id = _p.sample_id'
        )


def main(n: int, rows: int, md: str | None):
    tmp = Path(tempfile.mkdtemp(prefix='e3nb-bench-catalog-'))
    try:
        return run(n, rows, md, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(n, rows, md, tmp):
    f = {}
    t, f['synthesise (not counted)'] = timed(synth, n)
    cat = catalog_path(tmp / 'ours')

    def build():
        for k, v in DATASETS.items():
            record_dataset(cat, k, format='synthetic', source=f'bench lognormal {v[2]}')
        upsert_samples(cat, t)

    _, f['build: datasets + bulk upsert (Arrow)'] = timed(build)
    _, f['re-upsert all (idempotent, every row conflicts)'] = timed(upsert_samples, cat, t)
    summary, f['partition (one SQL UPDATE + summary)'] = timed(partition, cat)
    ids = t['sample_id'].slice(0, 100_000).to_pylist()
    _, f['set_state 100K samples'] = timed(set_state, cat, ids, 'generate', 'done')
    _, f['state_counts (by partition)'] = timed(state_counts, cat, 'generate')
    work, f['todo generate (ids not done)'] = timed(todo, cat, 'generate')
    lq, f['length_quantiles (dataset x partition)'] = timed(length_quantiles, cat)
    longs, f["samples_df partition = 'long' + state"] = timed(
        samples_df, cat, "partition = 'long'", phases=['generate']
    )
    snap, f['snapshot (in-memory copy)'] = timed(snapshot, cat)
    snap.close()
    axs, f['plot_lengths'] = timed(plot_lengths, cat)
    axs[0].figure.savefig(tmp / 'lengths.png')
    size_mb = sum(p.stat().st_size for p in cat.parent.glob('catalog.duckdb*')) / 1e6

    # baseline 1: row by row vs bulk, same subset
    sub = t.slice(0, rows)
    _, naive = timed(row_by_row, catalog_path(tmp / 'naive'), sub)
    _, bulk_sub = timed(upsert_samples, catalog_path(tmp / 'bulk'), sub)
    # baseline 2: pandas round trip vs SQL, all samples, same catalog; results must agree
    ours = samples_df(cat, columns=['sample_id', 'partition', 'exclusion_reason'])
    _, pd_part = timed(pandas_partition, cat)
    theirs = samples_df(cat, columns=['sample_id', 'partition', 'exclusion_reason'])
    assert ours.equals(theirs), 'pandas and SQL partitions disagree'
    _, sql_part = timed(partition, cat)

    build_s = f['build: datasets + bulk upsert (Arrow)']
    ratios = [
        (f'row-by-row executemany vs bulk upsert, same {rows:,} samples', naive, bulk_sub),
        (f'row-by-row extrapolated to {n:,} vs measured bulk build', naive * n / rows, build_s),
        (f'pandas round-trip partition vs SQL UPDATE, {n:,} samples', pd_part, sql_part),
    ]
    report(n, rows, f, summary, lq, ratios, size_mb, len(work), len(longs), md)


def report(n, rows, f, summary, lq, ratios, size_mb, n_work, n_long, md):
    cmd = 'python bench/catalog.py' + ''.join(a if a.startswith(' ') else ' ' + a for a in sys.argv[1:])
    head = f"{n:,} samples, {len(DATASETS)} datasets; duckdb {duckdb.__version__}, {os.cpu_count()} CPU cores, {platform.python_version()}"
    lines = [
        f'## catalog',
        '',
        f'`{cmd}` ({time.strftime("%Y-%m-%d")}; {head}; catalog file {size_mb:.0f} MB).',
        'Synthetic samples with per-dataset lognormal prompt and completion lengths (chat, prompt-only prompts, reasoning',
        'traces, long agent traces, tool calls). Each step is one `eagle3nb.catalog` call on the file (open, one',
        'transaction, close). Baselines ran in the same run: row-by-row `executemany` inserts on the same subset (their',
        'time for all samples is extrapolated linearly, not measured), and partitioning through a pandas round trip',
        '(read lengths, numpy, `UPDATE ... FROM`), checked to give the same partition and reason for every sample.',
        '',
        '| step | seconds |',
        '|---|---:|',
    ] + [f'| {k} | {v:.2f} |' for k, v in f.items()]
    lines += [
        '',
        f'Goal: build + partition < 10 s; measured {f["build: datasets + bulk upsert (Arrow)"] + f["partition (one SQL UPDATE + summary)"]:.2f} s.',
        '',
        '| side by side (same run) | baseline s | ours s | ratio |',
        '|---|---:|---:|---:|',
    ]
    lines += [f'| {k} | {a:.2f} | {b:.2f} | {a / b:,.0f}x |' for k, a, b in ratios]
    lines += [
        '',
        'Partition summary (defaults: max_ctx 10,240, max_new_tokens 2,048, long_ctx 32,768, C 192/16):',
        '',
        md_table(summary),
        '',
        f'`todo` listed {n_work:,} ids; the long partition has {n_long:,} samples.',
    ]
    text = '\n'.join(lines) + '\n'
    print(text)
    print(lq.to_string(index=False))
    if md:
        write_section(Path(md), text)


def md_table(df: pd.DataFrame) -> str:
    "A DataFrame as a markdown table (NULL as empty), without needing tabulate"
    cell = lambda v: '' if pd.isna(v) else f'{v:,}' if isinstance(v, (int, np.integer)) else str(v)
    rows = ['| ' + ' | '.join(df.columns) + ' |', '|' + '---|' * len(df.columns)]
    return '\n'.join(rows + ['| ' + ' | '.join(cell(v) for v in r) + ' |' for r in df.itertuples(index=False)])


def write_section(path: Path, text: str):
    "Replace the `## catalog` section of `path` (up to the next `## `), or append it"
    old = path.read_text() if path.exists() else '# Benchmarks\n'
    m = re.search(r'^## catalog\n.*?(?=^## |\Z)', old, flags=re.S | re.M)
    new = (
        old[: m.start()] + text + ('\n' + old[m.end() :] if m and old[m.end() :] else '')
        if m
        else old.rstrip('\n') + '\n\n' + text
    )
    tmp = path.with_name(f'.{path.name}.tmp')
    tmp.write_text(new)
    tmp.replace(path)
    print(f'wrote the catalog section of {path}')


if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--n', type=int, default=1_000_000, help='synthetic samples')
    ap.add_argument('--rows', type=int, default=2_000, help='subset for the row-by-row baseline (about 2.5 ms a row)')
    ap.add_argument(
        '--md', default=None, help='markdown file whose `## catalog` section to replace, e.g. BENCHMARKS.md'
    )
    a = ap.parse_args()
    main(a.n, a.rows, a.md)
