"""Extraction throughput: eagle3nb.extract vs the bare forward pass it wraps, and bytes/token per storage mode vs 8H.

    python bench/extract.py [--n 48] [--repeat 2] [--targets kimi-tiny qwen3-tiny qwen3-h512] [--max-pad 0]
    python bench/extract.py --engine vllm [--n 48] [--targets qwen3-tiny] [--concurrency 8]

--engine vllm: on each toy target, the same samples three ways, in one run: the engine's plain prefill (a vLLM server
without extraction, one `max_tokens: 1` request per sample at --concurrency, nothing kept), the engine path
(`engine_extract.extract_engine` against a vLLM server with `extract_hidden_states` and the hidden-states connector:
requests, spool files, repack, shards), both modes of it from one pass (`extract_engine_modes`: one request per sample
for the two stores, against the two passes above) and our HF path (`extract.extract`, float32 like the engine's CPU server).
tok/s by wall clock; `vs prefill` = plain prefill time / that path's time; B/tok = shard bytes / tokens.

Same samples, same length-bucketed batches (`extract.length_batches`, same token budget and max_pad), one process:
  bare      the target's decoder over each batch (`model.get_decoder()(input_ids, attention_mask)`), no hooks, nothing
            kept: the floor extraction cannot beat
  bf16      `extract(..., mode='bf16')`: hooks on the aux layers, cut padding, aux (T, 3H) + final (T, H) in bf16,
            safetensors shards written atomically (temp file + rename), index rows
  compact   `extract(..., mode='compact')`: the same plus fp8 e4m3 aux with per-token scales and the top-k (64) softmax
            probabilities over a draft vocab of a quarter of the target vocab
  bf16+compact  `extract_modes(...)`: both stores from one forward per batch (`vs bare` < 0.5 would mean no gain over
            two passes; the line after each target gives one pass vs the two passes above)
Each round runs the three in turn into fresh folders; the table shows the best of --repeat rounds, by wall clock and by
process CPU time (one thread: on a shared machine CPU time is what other tenants cannot inflate). tok/s counts stored
tokens (no padding), by wall clock. `vs bare` = bare time / extraction time (goal >= 0.9), wall and CPU. B/tok = shard bytes on disk / tokens, with
the plan (`store.bytes_per_token`) and 8H (bf16 aux + final) beside it.
Targets: the two toys (hidden 64, 8 layers: the forward is so cheap that per-sample Python and I/O dominate) and
`qwen3-h512`, a random Qwen3 (hidden 512, 8 layers, vocab 32000) built in memory, closer to where the forward dominates.
Sample lengths: lognormal, median 160 tokens, 16..1024, seeded.
Last, bytes/token measured on disk at Kimi-K2.5's width (H=7168) with a random 3-layer Qwen3 (aux ids 0, 1, 2; vocab
32000 = the draft vocab), against the plan.
"""

import argparse, os, shutil, tempfile, time
from pathlib import Path

os.environ.setdefault('OMP_NUM_THREADS', '1')
os.environ.setdefault('HF_HUB_OFFLINE', '1')
import torch
from eagle3nb.extract import extract, extract_modes, length_batches, load_target
from eagle3nb.store import bytes_per_token, shard_files
from eagle3nb.toy import ensure_toy


def synthetic(hidden=512, layers=8, vocab=32000, intermediate=None):
    "A random bf16 Qwen3 of the given width, built in memory"
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(
        hidden_size=hidden,
        intermediate_size=intermediate or 3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        head_dim=64,
        vocab_size=vocab,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval().requires_grad_(False)


def get_target(name):
    if name.startswith('qwen3-h'):
        return synthetic(int(name.removeprefix('qwen3-h')))
    return load_target(ensure_toy(name))


def samples(n, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = (torch.randn(n, generator=g) * 0.8 + torch.log(torch.tensor(160.0))).exp().clamp(16, 1024).long().tolist()
    return [
        dict(sample_id=f'b{i:05d}', input_ids=torch.randint(0, vocab, (L,), generator=g).tolist(), loss_mask=[1] * L)
        for i, L in enumerate(lens)
    ]


def timed(f, *a, **kw):
    "(wall s, process CPU s) of f(*a, **kw)"
    w, c = time.perf_counter(), time.process_time()
    f(*a, **kw)
    return time.perf_counter() - w, time.process_time() - c


@torch.no_grad()
def bare(model, rows, token_budget, max_pad):
    "The decoder over the same batches extract forms, nothing kept"
    dec = model.get_decoder()
    for b in length_batches([len(r['input_ids']) for r in rows], token_budget, max_pad):
        lens = [len(rows[i]['input_ids']) for i in b]
        L = max(lens)
        ids = torch.zeros(len(b), L, dtype=torch.long)
        for j, i in enumerate(b):
            ids[j, : lens[j]] = torch.tensor(rows[i]['input_ids'])
        mask = None if min(lens) == L else (torch.arange(L) < torch.tensor(lens)[:, None]).long()
        dec(input_ids=ids, attention_mask=mask, use_cache=False)


def run(name, n, repeat, token_budget, max_pad, topk):
    m = get_target(name)
    cfg = m.config.get_text_config()
    H, V = cfg.hidden_size, cfg.vocab_size
    rows = samples(n, min(V, 3000))
    tokens = sum(len(r['input_ids']) for r in rows)
    tids = torch.arange(0, V, 4)
    d2t = tids - torch.arange(len(tids))
    wall, cpu, disk = {}, {}, {}
    keep = lambda k, t: (
        wall.__setitem__(k, min(wall.get(k, 1e9), t[0])),
        cpu.__setitem__(k, min(cpu.get(k, 1e9), t[1])),
    )
    bare(m, rows[:2], token_budget, max_pad)  # warm up
    for _ in range(repeat):
        keep('bare', timed(bare, m, rows, token_budget, max_pad))
        for mode in ('bf16', 'compact'):
            d = Path(tempfile.mkdtemp(prefix='e3nb-bench-'))
            keep(
                mode,
                timed(
                    extract,
                    m,
                    rows,
                    d,
                    mode=mode,
                    d2t=d2t,
                    topk=topk,
                    token_budget=token_budget,
                    max_pad=max_pad,
                    target=name,
                ),
            )
            disk[mode] = sum(f.stat().st_size for f in shard_files(d))
            shutil.rmtree(d)
        d = Path(tempfile.mkdtemp(prefix='e3nb-bench-'))  # both stores from one forward per batch
        keep(
            'bf16+compact',
            timed(
                extract_modes,
                m,
                rows,
                {'bf16': d / 'b', 'compact': d / 'c'},
                d2t=d2t,
                topk=topk,
                token_budget=token_budget,
                max_pad=max_pad,
                target=name,
            ),
        )
        disk['bf16+compact'] = sum(f.stat().st_size for o in ('b', 'c') for f in shard_files(d / o))
        shutil.rmtree(d)
    out = []
    for mode in ('bare', 'bf16', 'compact', 'bf16+compact'):
        bpt = disk[mode] / tokens if mode in disk else None
        out.append(
            dict(
                target=name,
                H=H,
                mode=mode,
                tokens=tokens,
                tok_s=tokens / wall[mode],
                vs_bare=wall['bare'] / wall[mode],
                vs_bare_cpu=cpu['bare'] / cpu[mode],
                bpt=bpt,
                plan=sum(bytes_per_token(x, H, 3, topk, len(tids)) for x in mode.split('+')) if mode in disk else None,
                eightH=8 * H,
            )
        )
    return out


def width_check(H=7168, n=6, topk=64):
    "Bytes/token on disk at Kimi-K2.5's width: a random 3-layer Qwen3 with hidden H and a 32000-token vocab (= draft vocab)"
    m = synthetic(H, layers=3, vocab=32000, intermediate=512)
    rows = samples(n, 3000, seed=1)
    tokens = sum(len(r['input_ids']) for r in rows)
    out = {}
    for mode in ('bf16', 'compact'):
        d = Path(tempfile.mkdtemp(prefix='e3nb-bench-'))
        extract(m, rows, d, aux_layers=[0, 1, 2], mode=mode, topk=topk, target=f'qwen3-h{H}-l3')
        out[mode] = sum(f.stat().st_size for f in shard_files(d)) / tokens
        shutil.rmtree(d)
    return tokens, out


def prefill(srv, rows, concurrency):
    "One `max_tokens: 1` request per sample, token ids in, nothing kept: the engine's own floor"
    from concurrent.futures import ThreadPoolExecutor
    from eagle3nb.server import http_client

    with http_client(600) as c, ThreadPoolExecutor(concurrency) as ex:
        body = lambda r: dict(model=srv.model, prompt=r['input_ids'], max_tokens=1, temperature=0)
        for resp in ex.map(lambda r: c.post(srv.base_url + '/completions', json=body(r)), rows):
            resp.raise_for_status()


def engine_run(name, n, concurrency, topk):
    "Plain vLLM prefill vs extraction through vLLM vs the HF path, same samples, one run"
    from transformers import AutoConfig
    from eagle3nb.phase import EngineSession
    from eagle3nb.engine_extract import EngineClient, extract_engine, extract_engine_modes, extract_server
    from eagle3nb.recipe import default_aux_layers

    target = ensure_toy(name)
    cfg = AutoConfig.from_pretrained(target).get_text_config()
    H, V, N = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    rows, aux = samples(n, min(V, 3000)), default_aux_layers(N)
    tokens = sum(len(r['input_ids']) for r in rows)
    tids = torch.arange(0, V, 4)
    d2t = tids - torch.arange(len(tids))
    tmp, res = Path(tempfile.mkdtemp(prefix='e3nb-bench-eng-')), {}
    with EngineSession.of(target) as es:  # one server at a time: the plain one, then the extraction one
        srv = es.baseline()
        prefill(srv, rows[:4], concurrency)  # warm up
        res['vllm prefill'] = (timed(prefill, srv, rows, concurrency)[0], None)
        es.stop(srv)
        srv = es.extraction(lambda: extract_server(target, tmp / 'spool', aux + [N]))
        client = EngineClient([srv.base_url], srv.model, tmp / 'spool', concurrency=concurrency)
        extract_engine(
            client, rows[:4], tmp / 'warm', target, aux, 'bf16', concurrency=concurrency, own_spool=True, progress=False
        )
        for mode in ('bf16', 'compact'):
            t = timed(
                extract_engine,
                client,
                rows,
                tmp / f'vllm-{mode}',
                target,
                aux,
                mode,
                d2t if mode == 'compact' else None,
                topk,
                concurrency,
                own_spool=True,
                progress=False,
            )[0]
            res[f'vllm extract {mode}'] = (t, sum(f.stat().st_size for f in shard_files(tmp / f'vllm-{mode}')))
        outs = {
            mode: tmp / f'vllm-both-{mode}' for mode in ('bf16', 'compact')
        }  # both stores from one pass: one request per sample
        t = timed(
            extract_engine_modes,
            client,
            rows,
            outs,
            target,
            aux,
            d2t,
            topk,
            concurrency,
            own_spool=True,
            progress=False,
        )[0]
        res['vllm bf16+compact 1 pass'] = (t, sum(f.stat().st_size for o in outs.values() for f in shard_files(o)))
    m = load_target(target, dtype=torch.float32)
    extract(m, rows[:4], tmp / 'warm-hf', aux_layers=aux)
    for mode in ('bf16', 'compact'):
        t = timed(
            extract,
            m,
            rows,
            tmp / f'hf-{mode}',
            aux_layers=aux,
            mode=mode,
            d2t=d2t if mode == 'compact' else None,
            topk=topk,
        )[0]
        res[f'hf extract {mode}'] = (t, sum(f.stat().st_size for f in shard_files(tmp / f'hf-{mode}')))
    shutil.rmtree(tmp, ignore_errors=True)
    base = res['vllm prefill'][0]
    return [
        dict(
            target=name,
            H=H,
            path=k,
            tokens=tokens,
            seconds=t,
            tok_s=tokens / t,
            vs_prefill=base / t,
            bpt=b / tokens if b else None,
        )
        for k, (t, b) in res.items()
    ]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--n', type=int, default=48)
    ap.add_argument('--repeat', type=int, default=5)
    ap.add_argument('--targets', nargs='*', default=['kimi-tiny', 'qwen3-tiny', 'qwen3-h512'])
    ap.add_argument('--token-budget', type=int, default=16384)
    ap.add_argument('--max-pad', type=float, default=0.0)
    ap.add_argument('--topk', type=int, default=64)
    ap.add_argument('--no-width-check', action='store_true', help='skip the bytes/token measurement at H=7168')
    ap.add_argument('--engine', choices=['vllm'])
    ap.add_argument('--concurrency', type=int, default=8)
    a = ap.parse_args()
    if a.engine:
        print(f"{'target':11} {'path':25} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'vs prefill':>10} {'B/tok':>8}")
        for t in a.targets if a.targets != ap.get_default('targets') else ['qwen3-tiny']:
            rs = engine_run(t, a.n, a.concurrency, a.topk)
            by = {r['path']: r['seconds'] for r in rs}
            for r in rs:
                print(
                    f"{r['target']:11} {r['path']:25} {r['tokens']:7d} {r['seconds']:8.2f} {r['tok_s']:8,.0f} {r['vs_prefill']:9.2f}x "
                    + (f"{r['bpt']:8.1f}" if r['bpt'] else ''),
                    flush=True,
                )
            two = by['vllm extract bf16'] + by['vllm extract compact']
            print(
                f"{t}: bf16 and compact through vLLM, one pass {by['vllm bf16+compact 1 pass']:.2f} s vs two passes {two:.2f} s "
                f"({two / by['vllm bf16+compact 1 pass']:.2f}x)",
                flush=True,
            )
        return
    wall = {}
    print(
        f"{'target':12} {'H':>5} {'mode':12} {'tokens':>7} {'tok/s':>9} {'vs bare':>8} {'(CPU)':>7} {'B/tok':>8} {'plan':>7} {'8H':>6} {'B/tok / 8H':>10}"
    )
    for t in a.targets:
        for r in run(t, a.n, a.repeat, a.token_budget, a.max_pad, a.topk):
            b = (
                f"{r['bpt']:8.1f} {r['plan']:7d} {r['eightH']:6d} {r['bpt'] / r['eightH']:9.3f}x"
                if r['bpt']
                else f"{'':8} {'':7} {r['eightH']:6d}"
            )
            print(
                f"{r['target']:12} {r['H']:5d} {r['mode']:12} {r['tokens']:7d} {r['tok_s']:9,.0f} {r['vs_bare']:7.2f}x {r['vs_bare_cpu']:6.2f}x {b}",
                flush=True,
            )
            wall[r['mode']] = r['tokens'] / r['tok_s']
        print(
            f"{t}: bf16 and compact, one pass {wall['bf16+compact']:.2f} s vs two passes {wall['bf16'] + wall['compact']:.2f} s "
            f"({(wall['bf16'] + wall['compact']) / wall['bf16+compact']:.2f}x)",
            flush=True,
        )
    H = 7168
    print(
        f"\nplanned at Kimi-K2.5 width (H={H}, 3 aux layers, top-{a.topk} over a 32000-token draft vocab): bf16 "
        f"{bytes_per_token('bf16', H, topk=a.topk):,} B/token ({bytes_per_token('bf16', H, topk=a.topk) / (8 * H):.3f}x 8H), compact "
        f"{bytes_per_token('compact', H, topk=a.topk):,} B/token ({bytes_per_token('compact', H, topk=a.topk) / (8 * H):.3f}x 8H)"
    )
    if not a.no_width_check:
        tokens, got = width_check(H, topk=a.topk)
        print(
            f"measured at H={H} (random 3-layer Qwen3, vocab 32000, {tokens} tokens): "
            + ', '.join(f"{m} {b:,.1f} B/token ({b / (8 * H):.3f}x 8H)" for m, b in got.items())
            + f"; compact/bf16 = {got['compact'] / got['bf16']:.3f}x"
        )


if __name__ == '__main__':
    main()
