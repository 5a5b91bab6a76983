"""Prepare throughput per adapter: records/s end to end and for the adapter alone, side by side with json parsing.

    python bench/prepare.py [--n 3000]

For every registered format, N synthetic records are made from that format's real records (the fixtures in
tests/fixtures/datasets plus the real records embedded in the adapter tests), each copy given a unique text so no two
are equal, and written as JSON Lines (one .traj file per record for sweagent_traj). Three timings per format, in one
run on the same records:
  json       json.loads of every line: the floor any reader pays
  adapter    the adapter alone on the parsed records (no I/O)
  prepare    eagle3nb.prepare.prepare end to end: datasets load_dataset, adapter, parquet shards, manifest, rejects
and the ratio prepare / json (how many times the floor the whole phase costs).
"""

import argparse, copy, json, os, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / 'tests'))
os.environ.setdefault('OMP_NUM_THREADS', '1')
from eagle3nb.schema import ADAPTERS
from eagle3nb.prepare import prepare
import test_adapters_chat as chat, test_adapters_agent as agent  # their real seed records


def seeds():
    "format -> real records that the format's adapter keeps"
    s = {**chat.fixture_records(), **{k: v for k, v in agent.SOURCES.items()}}
    return {f: [r for r in recs if _kept(f, r)] for f, recs in s.items() if f in ADAPTERS}


def _kept(fmt, r):
    try:
        ADAPTERS[fmt](copy.deepcopy(r), 'bench', 0, ADAPTERS[fmt].default_kind)
        return True
    except Exception:
        return False


def _vary(o, tag):
    "A copy of `o` with `tag` appended to every user/assistant text value that is plain prose (keeps formats intact)"
    if isinstance(o, list):
        return [_vary(v, tag) for v in o]
    if isinstance(o, dict):
        return {
            k: (
                v + tag
                if k in ('value', 'content', 'output', 'prompt', 'instruction', 'query')
                and isinstance(v, str)
                and not any(t in v for t in ('<think>', '<tool_call>', '<functioncall>', '{'))
                else _vary(v, tag)
            )
            for k, v in o.items()
        }
    return o


def bench(fmt, recs, n, tmp):
    "json, adapter and prepare timings for `n` records of `fmt`"
    rows = [_vary(recs[i % len(recs)], f' #{i}') for i in range(n)]
    d = tmp / fmt
    d.mkdir()
    if fmt == 'sweagent_traj':
        for i, r in enumerate(rows):
            (d / f'{i:06d}.traj').write_text(json.dumps(r))
        lines = [(d / f'{i:06d}.traj').read_text() for i in range(n)]
        src = d
    else:
        src = d / 'data.jsonl'
        src.write_text('\n'.join(json.dumps(r) for r in rows))
        lines = src.read_text().splitlines()
    t = time.perf_counter()
    parsed = [json.loads(l) for l in lines]
    t_json = time.perf_counter() - t
    f, kind = ADAPTERS[fmt], ADAPTERS[fmt].default_kind
    t = time.perf_counter()
    for i, r in enumerate(parsed):
        f(r, fmt, i, kind)
    t_ad = time.perf_counter() - t
    t = time.perf_counter()
    m = prepare(src, fmt, fmt, tmp / 'out', progress=False)
    t_prep = time.perf_counter() - t
    assert m['read'] == n and m['kept'] + m['rejected'] == n, m
    return dict(
        format=fmt,
        records=n,
        kept=m['kept'],
        json_rps=n / t_json,
        adapter_rps=n / t_ad,
        prepare_rps=n / t_prep,
        ratio=t_prep / t_json,
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--n', type=int, default=3000)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix='e3nb-bench-prepare-'))
    bench(
        'ultrachat', seeds()['ultrachat'], 50, tmp / 'warmup' if (tmp / 'warmup').mkdir() is None else tmp
    )  # imports, datasets cache
    res = [bench(f, recs, a.n, tmp) for f, recs in sorted(seeds().items()) if recs]
    print(
        f"{'format':22s} {'records':>7s} {'kept':>6s} {'json rec/s':>11s} {'adapter rec/s':>14s} {'prepare rec/s':>14s} {'prepare/json':>13s}"
    )
    for r in res:
        print(
            f"{r['format']:22s} {r['records']:7d} {r['kept']:6d} {r['json_rps']:11,.0f} {r['adapter_rps']:14,.0f} {r['prepare_rps']:14,.0f} {r['ratio']:12.1f}x"
        )


if __name__ == '__main__':
    main()
