"""Storage modes side by side: bytes per token at Kimi-K2.5's width, and the accept length vLLM serves for drafts
trained on each mode.

    OMP_NUM_THREADS=1 EAGLE3NB_VLLM=/work/main/.venv-vllm .venv/bin/python bench/storage_modes.py \
        [--recipes demo,kimi-k25-demo --modes bf16,compact,nf4 --seeds 0,1,2 --n 16 --max-tokens 48 --k 3]
        [--max-steps kimi-k25-demo=400]
        [--work DIR] [--json out.json] [--read-only]

Per recipe (recipes/<name>.yaml, its data moved under --work, its trained toy target from the toy cache):
1. the runner prepares, renders, answers (the target through vLLM), merges, builds the vocab and extracts the hidden
   states once in every mode (`phases.extract.modes` = all of --modes: one pass over the target);
2. per mode and seed, the train phase trains the recipe's draft (its `phases.train`: same steps, lr, batch) with
   `seed` setting the draft's initial weights and the sample order; the export phase writes it;
3. `eagle3nb.verify.verify` serves each export in vLLM beside the target alone on the same held-out prompts (one
   baseline server for the recipe): greedy identity, served accept length = 1 + accepted / drafts at k.
Then, at H = 7168: the training's read path (`HiddenStates(raw=True)[i]` then `train.aux_states`: slice the mapped
shard, aux states to float32, dequantized where the draft trains: here the CPU) over a synthetic store of each mode, tokens/s and the growth of the process's RSS side by side. Results are kept in --work/<recipe>/results.jsonl: a rerun skips
the pairs it has (kill it at any point and rerun).
"""

import argparse, dataclasses, json, os, shutil, subprocess, sys, tempfile, time
from pathlib import Path
import torch, yaml

ROOT = Path(__file__).resolve().parent.parent
PREP = 'target_check,prepare,render,catalog,generate,merge,vocab,extract'


def args():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    a = p.add_argument
    a('--recipes', default='demo,kimi-k25-demo')
    a('--modes', default='bf16,compact,nf4')
    a('--seeds', default='0,1,2')
    a('--n', type=int, default=16, help='held-out prompts served')
    a('--max-tokens', type=int, default=48)
    a('--k', type=int, default=3)
    a('--max-steps', default='', help='override phases.train.max_steps, per recipe: name=steps,...')
    a('--work', default=str(ROOT / 'data' / 'bench-storage'))
    a('--json', default=None)
    a('--plot', default=None, help='write the curve (bytes/token at H=7168 against served accept) to this PNG')
    a('--read-only', action='store_true', help='only the H=7168 read-path comparison')
    a('--throughput-steps', type=int, default=60, help='train steps per mode, twice, interleaved, for train tokens/s')
    a('--read-samples', type=int, default=24)
    a('--read-tokens', type=int, default=512)
    return p.parse_args()


def recipe_copy(name: str, work: Path, modes: str) -> Path:
    "recipes/<name>.yaml with its data and catalog under `work`, its toy from the cache, every mode extracted"
    from eagle3nb.toy import toy_dir

    r = yaml.safe_load((ROOT / 'recipes' / f'{name}.yaml').read_text())
    r.update(data_root=str(work / 'data'), catalog=str(work / 'catalog.duckdb'))
    r['target']['model'] = str(toy_dir(r['target']['toy']))
    r['phases'].setdefault('extract', {})['modes'] = modes
    p = work / 'recipe.yaml'
    p.write_text(yaml.safe_dump(r))
    return p


def prepare(recipe: Path, run_id: str):
    "The runner's phases up to the hidden states (resumable under the same run id)"
    eagle3nb = str(Path(sys.executable).parent / 'eagle3nb')
    cmd = [eagle3nb, 'run', str(recipe), '--run-id', run_id, '--phases', PREP]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")


def disk_per_token(store: Path) -> float:
    "Bytes on disk a token, over the train split's shards"
    from eagle3nb.store import validate

    rep = validate(store, values=False)
    return rep['bytes'] / rep['tokens']


def one(ctx0, tp: dict, mode: str, seed: int, a, work: Path) -> dict:
    "Train, export and serve one (mode, seed): the row of the table"
    from eagle3nb.phases import export as E, train as T, verify as V
    from eagle3nb.verify import recipe_prompts, verify

    ctx = dataclasses.replace(ctx0, run_dir=work / 'runs' / f'{mode}-s{seed}')
    ctx.run_dir.mkdir(parents=True, exist_ok=True)
    rec = T.run(ctx, T.Params(**{**tp, 'mode': mode, 'seed': seed}))
    out = work / 'exports' / f'{mode}-s{seed}'
    E.run(ctx, E.Params(out=str(out)))
    prompts = recipe_prompts(ctx.recipe, a.n)
    res = verify(out, ctx.target, prompts, a.max_tokens, a.k, engines=ctx0.engines, log_dir=ctx.run_dir / 'logs')
    return dict(
        mode=mode,
        seed=seed,
        steps=rec.steps,
        train_s=rec.seconds,
        tokens_per_s=rec.tokens_per_s,
        offline_eval=rec.accept.get('eval', {}).get('accept_sim') if isinstance(rec.accept, dict) else None,
        loaded=res['loaded'],
        served=res.get('accept_length'),
        offline_served=res.get('offline_accept_length'),
        greedy=f"{res.get('greedy_identical')}/{res['n_prompts']}",
        error=res.get('error'),
    )


def bench_recipe(name: str, a) -> dict:
    from eagle3nb.phase import RunContext
    from eagle3nb.store import bytes_per_token

    work = Path(a.work) / name
    work.mkdir(parents=True, exist_ok=True)
    recipe = recipe_copy(name, work, a.modes)
    t0 = time.time()
    prepare(recipe, f'bench-storage-{name}')
    print(f'{name}: data and hidden states ready ({time.time() - t0:.0f} s)', flush=True)
    modes, seeds = a.modes.split(','), [int(s) for s in a.seeds.split(',')]
    res_path, rows = work / 'results.jsonl', []
    if res_path.exists():
        rows = [json.loads(l) for l in res_path.read_text().splitlines() if l]
    ctx0 = RunContext.open(str(recipe), work / 'runs' / 'session')
    tp = ctx0.phase_params('train')
    steps = dict(kv.split('=') for kv in a.max_steps.split(',') if kv)
    if name in steps:
        tp['max_steps'] = int(steps[name])  # every mode and seed the same
    try:
        for seed in seeds:
            for mode in modes:
                if any(r['mode'] == mode and r['seed'] == seed for r in rows):
                    continue
                t1 = time.time()
                row = one(ctx0, tp, mode, seed, a, work)
                rows.append(row)
                with res_path.open('a') as f:
                    f.write(json.dumps(row) + '\n')
                print(
                    f"  {mode:8s} seed {seed}: served {row['served']}, offline {row['offline_served']}, "
                    f"greedy {row['greedy']}, {row['tokens_per_s']} tok/s ({time.time() - t1:.0f} s)",
                    flush=True,
                )
    finally:
        ctx0.engines.close()
    disk = {m: disk_per_token(Path(ctx0.data_root) / 'hidden' / m / 'train') for m in modes}
    H = 7168
    return dict(
        recipe=name,
        draft=tp.get('draft', {}),
        steps=tp.get('max_steps'),
        rows=[r for r in rows if r['mode'] in modes and r['seed'] in seeds],
        disk_per_token=disk,
        kimi_per_token={m: bytes_per_token(m, H) for m in modes},
    )


def throughput(name: str, a) -> list:
    "Train tokens/s of each mode on the recipe's stores, side by side: each mode twice, interleaved, fresh runs"
    import statistics as st
    from eagle3nb.phase import RunContext
    from eagle3nb.phases import train as T

    work = Path(a.work) / name
    ctx0 = RunContext.open(str(work / 'recipe.yaml'), work / 'runs' / 'session')
    tp = {**ctx0.phase_params('train'), 'max_steps': a.throughput_steps, 'ckpt_every': a.throughput_steps}
    tp['eval_every'] = a.throughput_steps
    got = {m: [] for m in a.modes.split(',')}
    for i in range(2):
        for m in got:
            d = work / 'runs' / f'tput-{m}-{i}'
            shutil.rmtree(d, ignore_errors=True)  # the bench's own scratch runs
            got[m].append(T.run(dataclasses.replace(ctx0, run_dir=d), T.Params(**{**tp, 'mode': m})).tokens_per_s)
    ctx0.engines.close()
    return [dict(mode=m, tokens_per_s=st.median(v), runs=v) for m, v in got.items()]


def summary(b: dict) -> list:
    "mode, bytes/token at H=7168 and its ratio, on disk, served mean and spread, within 2% of bf16, tok/s"
    import statistics as st

    out = []
    by = {m: [r for r in b['rows'] if r['mode'] == m] for m in b['disk_per_token']}
    base = st.mean(r['served'] for r in by['bf16']) if by.get('bf16') else None
    for m, rs in by.items():
        sv = [r['served'] for r in rs if r['served']]
        mean = st.mean(sv) if sv else None
        out.append(
            dict(
                mode=m,
                kimi=b['kimi_per_token'][m],
                kimi_x=b['kimi_per_token'][m] / b['kimi_per_token'].get('bf16', b['kimi_per_token'][m]),
                disk=b['disk_per_token'][m],
                served=sv,
                mean=mean,
                spread=(max(sv) - min(sv)) if sv else None,
                vs_bf16=(mean / base - 1) if mean and base else None,
                offline=st.mean(r['offline_served'] for r in rs if r['offline_served']) if rs else None,
                tok_s=st.mean(r['tokens_per_s'] for r in rs if r['tokens_per_s']) if rs else None,
                greedy=', '.join(r['greedy'] for r in rs),
            )
        )
    return out


def print_summary(b: dict):
    print(f"\n{b['recipe']}: draft {b['draft']}, {b['steps']} steps, seeds {sorted({r['seed'] for r in b['rows']})}")
    print(
        f"{'mode':8s} {'B/tok H=7168':>12s} {'x bf16':>7s} {'B/tok demo':>10s} {'served per seed':>22s} "
        f"{'mean':>6s} {'spread':>6s} {'vs bf16':>8s} {'offline':>7s} {'train tok/s':>11s}  greedy"
    )
    for s in summary(b):
        seeds = ' '.join(f'{v:.3f}' for v in s['served'])
        vs = f"{s['vs_bf16'] * 100:+.1f}%" if s['vs_bf16'] is not None else 'n/a'
        print(
            f"{s['mode']:8s} {s['kimi']:12,d} {s['kimi_x']:7.3f} {s['disk']:10.1f} {seeds:>22s} "
            f"{s['mean']:6.3f} {s['spread']:6.3f} {vs:>8s} {s['offline']:7.3f} {s['tok_s']:11.1f}  {s['greedy']}"
        )


def plot_curve(recipes: list, path: str):
    "Bytes per token at H = 7168 against the served accept length (mean over seeds, bars: min to max), per recipe"
    import matplotlib

    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(recipes), figsize=(5 * len(recipes), 3.6), squeeze=False)
    for ax, b in zip(axes[0], recipes):
        rows = summary(b)
        base = next(r['mean'] for r in rows if r['mode'] == 'bf16')
        ax.axhspan(base * 0.98, base, color='0.9', label='within 2% of bf16')
        for r in rows:
            lo, hi = r['mean'] - min(r['served']), max(r['served']) - r['mean']
            ax.errorbar(r['kimi'], r['mean'], yerr=[[lo], [hi]], fmt='o', capsize=4)
            ax.annotate(
                f"{r['mode']} ({r['kimi_x']:.3f}x)", (r['kimi'], r['mean']), textcoords='offset points', xytext=(6, 6)
            )
        ax.axvline(rows[0]['kimi'] / 4, ls='--', c='gray', label='a quarter of bf16')
        ax.set(
            xlabel='bytes / token at H=7168',
            ylabel='served accept length (vLLM)',
            title=f"{b['recipe']}: {b['draft'].get('arch', 'llama')} draft, {b['steps']} steps",
        )
        ax.legend(fontsize=8, loc='lower right')
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def read_path(a, modes) -> list:
    "Training's read path at H = 7168 over a synthetic store of each mode: tokens/s and RSS growth, side by side"
    import psutil
    from eagle3nb.extract import sample_tensors
    from eagle3nb.store import HiddenStates, ShardWriter, shard_meta
    from eagle3nb.train import aux_states

    H, n_aux, Vd, T, N = 7168, 3, 32000, a.read_tokens, a.read_samples
    g = torch.Generator().manual_seed(0)
    w_draft = torch.randn(Vd, H, generator=g, dtype=torch.bfloat16) * 0.02
    out, d = [], Path(tempfile.mkdtemp(prefix='e3nb-read-'))
    for m in modes:
        w = ShardWriter(d / m, shard_meta(m, [2, 30, 58], H, 'synthetic', topk=64, draft_vocab_size=Vd))
        for i in range(N):
            aux, fin = torch.randn(T, n_aux * H, generator=g) * 3, torch.randn(T, H, generator=g)
            row = dict(input_ids=torch.randint(0, Vd, (T,), generator=g), loss_mask=torch.ones(T, dtype=torch.uint8))
            w.add(f's{i}', sample_tensors(row, aux, fin, m, n_aux, w_draft, 64))
        w.flush()
    proc = psutil.Process()
    for m in modes:
        ds, rss0, peak = HiddenStates(d / m, raw=True), proc.memory_info().rss, 0  # raw: as the train phase reads
        t0 = time.perf_counter()
        for i in range(N):  # per sample, what training does before the draft: read the slice, aux to float32 there
            x = aux_states(ds[i], 'cpu')  # on a GPU the dequantization runs there (collate); here on the CPU
            peak = max(peak, proc.memory_info().rss - rss0)
            del x
        sec = time.perf_counter() - t0
        out.append(dict(mode=m, tokens_per_s=N * T / sec, rss_growth_mb=peak / 2**20, tokens=N * T))
    return out


def main():
    a = args()
    modes, report = a.modes.split(','), {}
    if not a.read_only:
        report['recipes'] = []
        for name in a.recipes.split(','):
            b = bench_recipe(name, a)
            report['recipes'].append(b)
            print_summary(b)
            if a.throughput_steps:
                b['throughput'] = throughput(name, a)
                base = next(r['tokens_per_s'] for r in b['throughput'] if r['mode'] == 'bf16')
                print(f"{name}: train tokens/s, {a.throughput_steps} steps a mode, twice, interleaved (median):")
                for r in b['throughput']:
                    runs = ', '.join(f'{x:.0f}' for x in r['runs'])
                    print(
                        f"  {r['mode']:8s} {r['tokens_per_s']:8.1f} ({r['tokens_per_s'] / base:.2f}x bf16; runs {runs})"
                    )
    if a.plot and report.get('recipes'):
        plot_curve(report['recipes'], a.plot)
    rp = read_path(a, modes)
    report['read_path'] = rp
    print(
        f"\ntraining's read path at H=7168 ({a.read_samples} samples x {a.read_tokens} tokens, one sample at a time):"
    )
    base = next((r['tokens_per_s'] for r in rp if r['mode'] == 'bf16'), None)
    for r in rp:
        x = f" ({r['tokens_per_s'] / base:.2f}x bf16)" if base else ''
        print(f"{r['mode']:8s} {r['tokens_per_s']:10,.0f} tokens/s{x}, RSS grew {r['rss_growth_mb']:.0f} MiB at most")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))


if __name__ == '__main__':
    main()
