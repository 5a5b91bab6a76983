"""Benchmark the generate client (httpx): against vLLM, or against a fake server.

    python bench/generate.py --engine vllm [--n 96] [--c 8] [--toy qwen3-tiny]
    python bench/generate.py [--quick]          # the fake server only

--engine vllm: a long-tailed mix (95% of requests ask for 4-16 tokens, 5% for 96-128) against a local vLLM server on a
toy target, through `run_jobs` (the code path of `generate`: probe, semaphores per partition, retries, fsynced
shards), once as one queue at concurrency C and once as the two partitions (main + long, C split by expected work).
Makespan is set against the ideal: the engine's own per-request times (the delta of `vllm:e2e_request_latency_seconds_sum`
in its /metrics) / C, which no schedule with at most C requests in flight can beat. Client CPU per request: this
process's CPU time (user + system) / requests, the server being other processes.
Without --engine: the tests' `FakeTarget` (tests/fakes.py) in a forked process, throughput against a zero-latency server, CPU at
200 req/s, and the makespan of a mix whose latency is proportional to tokens.
"""

import argparse, asyncio, json, os, random, sys, tempfile, time
from pathlib import Path
from eagle3nb.generate import Job, ShardWriter, gen_params, run_jobs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / 'tests'))
from fakes import FakeTarget  # the fake OpenAI server lives with the tests


def jobs(lengths, part=lambda n: 'main'):
    "One job per wanted length; the prompt ids carry the length the fake server answers with"
    return [Job(f's{i:06d}', f'c{i}', 'bench', part(n), [n, i], max_tokens=100_000) for i, n in enumerate(lengths)]


def run(js, ft, conc):
    "Run `js` against `ft`; (wall seconds, client CPU seconds)"
    d = tempfile.mkdtemp(prefix='e3nb-bench-gen-')
    w = ShardWriter(d)
    c0, t0 = os.times(), time.perf_counter()
    r = asyncio.run(
        run_jobs(js, [ft.base_url], ft.model, gen_params(timeout=120, max_retries=2), w, conc, progress=False)
    )
    t1, c1 = time.perf_counter(), os.times()
    w.close()
    assert r.stats['ok'] == len(js), f"only {r.stats['ok']} of {len(js)} requests succeeded: {dict(r.stats)}"
    return t1 - t0, (c1.user - c0.user) + (c1.system - c0.system)


def throughput(n, c, http='httpx'):
    "Requests/s against a zero-latency server"
    with FakeTarget(length=lambda k: 16).start(process=True) as ft:
        wall, cpu = run(jobs([16] * n), ft, dict(main=c))
    return dict(
        http=http,
        requests=n,
        concurrency=c,
        wall_s=round(wall, 2),
        req_per_s=round(n / wall),
        client_cpu_s=round(cpu, 2),
        client_cpu_per_req_us=round(cpu / n * 1e6),
    )


def cpu_at(rate, seconds, http='httpx'):
    "Client CPU share at a fixed request rate: the server answers after `C/rate` seconds, so C in flight give `rate` req/s"
    c, lat = 20, 20 / rate
    n = int(rate * seconds)
    with FakeTarget(length=lambda k: 16, latency=lat).start(process=True) as ft:
        wall, cpu = run(jobs([16] * n), ft, dict(main=c))
    return dict(
        http=http,
        target_req_per_s=rate,
        achieved_req_per_s=round(n / wall, 1),
        wall_s=round(wall, 2),
        client_core_share=f'{cpu / wall:.1%}',
    )


def makespan(n, c, per_token, seed=0):
    "Makespan / ideal (total work / C) of a long-tailed mix, one queue vs main + long partitions"
    rng = random.Random(seed)
    lengths = [rng.randint(4000, 8000) if rng.random() < 0.02 else rng.randint(50, 500) for _ in range(n)]
    work = sum(lengths) * per_token
    ideal = work / c
    long_work = sum(x for x in lengths if x > 2000) * per_token
    c_long = max(1, round(c * long_work / work))
    c_main = c - c_long
    out = dict(
        requests=n,
        concurrency=c,
        per_token_ms=per_token * 1e3,
        long_share_of_work=f'{long_work / work:.0%}',
        ideal_s=round(ideal, 2),
    )
    with FakeTarget(length=lambda k: k[0], per_token=per_token).start(process=True) as ft:
        for name, js, conc in [
            ('one queue, random order', jobs(lengths), dict(main=c)),
            ('one queue, long ones last', jobs(sorted(lengths, key=lambda x: x > 2000)), dict(main=c)),
            (
                f'partitions main C={c_main} + long C={c_long}',
                jobs(lengths, lambda x: 'long' if x > 2000 else 'main'),
                dict(main=c_main, long=c_long),
            ),
        ]:
            wall, _ = run(js, ft, conc)
            out[name] = f'{wall:.2f} s = {wall / ideal:.2f} x ideal'
    return out


def _e2e_sum(base_url) -> float:
    "The engine's summed per-request end-to-end seconds (its /metrics histogram)"
    from eagle3nb.engine import prom_samples
    from eagle3nb.server import http_client, raise_for_status

    with http_client(30) as c:
        txt = raise_for_status(c.get(base_url.removesuffix('/v1') + '/metrics')).text
    return sum(v for name, _, v in prom_samples(txt) if name == 'vllm:e2e_request_latency_seconds_sum')


def engine_makespan(toy='qwen3-tiny', n=96, c=8, seed=0):
    "One queue vs the two partitions against vLLM: makespan / ideal, client CPU per request"
    from eagle3nb.engine import engine_info
    from eagle3nb.phase import EngineSession
    from eagle3nb.toy import ensure_toy

    rng = random.Random(seed)
    lengths = [rng.randint(96, 128) if rng.random() < 0.05 else rng.randint(4, 16) for _ in range(n)]
    long_work = sum(x for x in lengths if x > 64)
    c_long = max(1, round(c * long_work / sum(lengths)))
    c_main = c - c_long
    mk = lambda part: [
        Job(f's{i:06d}', f'c{i}', 'bench', part(L), [100 + rng.randrange(3000) for _ in range(16)], max_tokens=L)
        for i, L in enumerate(lengths)
    ]
    out = dict(
        target=toy,
        requests=n,
        concurrency=c,
        long_requests=sum(x > 64 for x in lengths),
        long_share_of_tokens=f'{long_work / sum(lengths):.0%}',
    )
    with EngineSession.of(ensure_toy(toy)) as es:
        srv = es.target('vllm')  # the toy alone in vLLM, started here and stopped on exit
        info = engine_info(srv.server.python)
        out['engine'] = f"{info['dist']} {info['version']}"
        for name, js, conc in [
            (f'one queue C={c}', mk(lambda L: 'main'), dict(main=c)),
            (
                f'partitions main C={c_main} + long C={c_long}',
                mk(lambda L: 'long' if L > 64 else 'main'),
                dict(main=c_main, long=c_long),
            ),
        ]:
            e0 = _e2e_sum(srv.base_url)
            wall, cpu = run(js, srv, conc)
            work = _e2e_sum(srv.base_url) - e0  # includes the one-token probe request
            out[name] = dict(
                makespan_s=round(wall, 2),
                ideal_s=round(work / c, 2),
                makespan_vs_ideal=round(wall / (work / c), 2),
                client_cpu_per_req_ms=round(cpu / n * 1e3, 2),
                req_per_s=round(n / wall, 1),
            )
    return out


if __name__ == '__main__':
    ap = argparse.ArgumentParser()
    ap.add_argument('--quick', action='store_true')
    ap.add_argument('--engine', choices=['vllm'])
    ap.add_argument('--n', type=int, default=96)
    ap.add_argument('--c', type=int, default=8)
    ap.add_argument('--toy', default='qwen3-tiny')
    a = ap.parse_args()
    q = a.quick
    if a.engine:
        res = engine_makespan(a.toy, a.n, a.c)
    else:
        res = dict(
            throughput=[throughput(2000 if q else 20000, 200)],
            cpu_at_200=[cpu_at(200, 5 if q else 20)],
            makespan=makespan(500 if q else 2000, 64, 0.0005),
        )
    print(json.dumps(res, indent=1))
