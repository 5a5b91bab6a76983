"""Benchmark the generate client: throughput against a zero-latency server, CPU cost at 200 req/s, and the makespan of a
long-tailed length mix against a server whose latency is proportional to tokens, with and without partitions.

    python bench/generate.py [--quick]

Servers are `eagle3nb.generate.FakeTarget` in a forked process on 127.0.0.1; the client is the library's `run_jobs`
(same code path as `generate`: probe, semaphores per partition, endpoint pool, retries, shard writes with fsync).
"""
import argparse, asyncio, json, os, random, sys, tempfile, time
from pathlib import Path
from eagle3nb.generate import FakeTarget, Job, ShardWriter, gen_params, run_jobs


def jobs(lengths, part=lambda n: 'main'):
    "One job per wanted length; the prompt ids carry the length the fake server answers with"
    return [Job(f's{i:06d}', f'c{i}', 'bench', part(n), [n, i], max_tokens=100_000) for i, n in enumerate(lengths)]


def run(js, ft, conc, http='httpx'):
    "Run `js` against `ft`; (wall seconds, client CPU seconds)"
    d = tempfile.mkdtemp(prefix='e3nb-bench-gen-')
    w = ShardWriter(d)
    c0, t0 = os.times(), time.perf_counter()
    r = asyncio.run(run_jobs(js, [ft.base_url], ft.model, gen_params(timeout=120, max_retries=2, http=http), w, conc, progress=False))
    t1, c1 = time.perf_counter(), os.times()
    w.close()
    assert r.stats['ok'] == len(js), f"only {r.stats['ok']} of {len(js)} requests succeeded: {dict(r.stats)}"
    return t1 - t0, (c1.user - c0.user) + (c1.system - c0.system)


def throughput(n, c, http):
    "Requests/s against a zero-latency server"
    with FakeTarget(length=lambda k: 16).start(process=True) as ft:
        wall, cpu = run(jobs([16] * n), ft, dict(main=c), http)
    return dict(http=http, requests=n, concurrency=c, wall_s=round(wall, 2), req_per_s=round(n / wall), client_cpu_s=round(cpu, 2),
                client_cpu_per_req_us=round(cpu / n * 1e6))


def cpu_at(rate, seconds, http):
    "Client CPU share at a fixed request rate: the server answers after `C/rate` seconds, so C in flight give `rate` req/s"
    c, lat = 20, 20 / rate
    n = int(rate * seconds)
    with FakeTarget(length=lambda k: 16, latency=lat).start(process=True) as ft:
        wall, cpu = run(jobs([16] * n), ft, dict(main=c), http)
    return dict(http=http, target_req_per_s=rate, achieved_req_per_s=round(n / wall, 1), wall_s=round(wall, 2), client_core_share=f'{cpu / wall:.1%}')


def makespan(n, c, per_token, seed=0):
    "Makespan / ideal (total work / C) of a long-tailed mix, one queue vs main + long partitions"
    rng = random.Random(seed)
    lengths = [rng.randint(4000, 8000) if rng.random() < 0.02 else rng.randint(50, 500) for _ in range(n)]
    work = sum(lengths) * per_token; ideal = work / c
    long_work = sum(x for x in lengths if x > 2000) * per_token
    c_long = max(1, round(c * long_work / work)); c_main = c - c_long
    out = dict(requests=n, concurrency=c, per_token_ms=per_token * 1e3, long_share_of_work=f'{long_work / work:.0%}', ideal_s=round(ideal, 2))
    with FakeTarget(length=lambda k: k[0], per_token=per_token).start(process=True) as ft:
        for name, js, conc in [('one queue, random order', jobs(lengths), dict(main=c)),
                               ('one queue, long ones last', jobs(sorted(lengths, key=lambda x: x > 2000)), dict(main=c)),
                               (f'partitions main C={c_main} + long C={c_long}', jobs(lengths, lambda x: 'long' if x > 2000 else 'main'),
                                dict(main=c_main, long=c_long))]:
            wall, _ = run(js, ft, conc)
            out[name] = f'{wall:.2f} s = {wall / ideal:.2f} x ideal'
    return out


if __name__ == '__main__':
    ap = argparse.ArgumentParser(); ap.add_argument('--quick', action='store_true'); a = ap.parse_args()
    q = a.quick
    res = dict(throughput=[throughput(2000 if q else 20000, 200, h) for h in ('httpx', 'lean')],
               cpu_at_200=[cpu_at(200, 5 if q else 20, h) for h in ('httpx', 'lean')],
               makespan=makespan(500 if q else 2000, 64, 0.0005))
    print(json.dumps(res, indent=1))
