"""Prefix-shared hidden states, measured: disk per agent trajectory against the turns answered (each turn's sample
stored whole, as before, against the shared store), and the draft's train tokens/s reading a shared store against a
whole one, side by side in one run.

    OMP_NUM_THREADS=2 .venv/bin/python bench/prefix_store.py [--recorded 6000 --turns 30 --answer 400 --width 1024]
        [--trajectories 4 --train-recorded 1500 --train-steps 60 --rounds 2] [--json out.json]

1. Disk. One trajectory of `--recorded` tokens with `--turns` assistant turns (evenly spaced); k of them answered
   (k = 1, 2, 4, 8, 16, all; the prefix policy's `evenly`), each answer `--answer` tokens, each turn's sample its
   recorded prefix then its answer, as `generate.raw_samples` makes them. Both stores are written by the store's own
   writer (nf4, the Kimi recipe's mode) at `--width` (the layout of H = 7168, narrower so the bench runs in seconds);
   the table gives the state rows each store wrote, its bytes on disk at that width, and the bytes at H = 7168
   (rows x `store.bytes_per_token('nf4', 7168)`, the formula the extract phase and the plan use).
2. Train. `--trajectories` trajectories, every turn answered, in a whole nf4 store and a shared one (H = 256, the
   demo draft's width; random states and top-64 probabilities: the step's work does not depend on their values). The
   real training loop (`train.train`: the reader, collate, TTT, AdamW) runs `--train-steps` steps on each, `--rounds`
   times, alternating; tokens/s from its own metrics (tokens read / seconds), the median per store. Then the read path
   alone at H = 7168 (`HiddenStates(raw=True)[i]` and `train.aux_states`, as storage_modes.py times it).
"""

import argparse, json, shutil, statistics, tempfile, time
from pathlib import Path
import torch


def args():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    a = p.add_argument
    a('--recorded', type=int, default=6000, help='tokens of the recorded trajectory (disk part)')
    a('--turns', type=int, default=30, help='its assistant turns')
    a('--answer', type=int, default=400, help="tokens of one of the target's answers")
    a('--width', type=int, default=1024, help='H of the written stores (bytes at 7168 are computed from their rows)')
    a('--trajectories', type=int, default=4, help='trajectories in the train stores')
    a('--train-recorded', type=int, default=1500, help='tokens of each train-store trajectory')
    a('--train-turns', type=int, default=12)
    a('--train-answer', type=int, default=100)
    a('--train-steps', type=int, default=60)
    a('--rounds', type=int, default=2)
    a('--read-width', type=int, default=7168)
    a('--json', default=None)
    return p.parse_args()


def turn_samples(g, recorded: int, turns: int, answer: int, k: int, name: str, vocab: int = 30000) -> list:
    "The samples of `k` of a trajectory's `turns` answered: each its recorded prefix, then a fresh answer"
    from eagle3nb.generate import evenly

    rec = torch.randint(0, vocab, (recorded,), generator=g)
    starts = [round((i + 1) * recorded / (turns + 1)) for i in range(turns)]  # where each recorded turn begins
    out = []
    for i in evenly(turns, k):
        ids = torch.cat([rec[: starts[i]], torch.randint(0, vocab, (answer,), generator=g)])
        mask = torch.cat([torch.zeros(starts[i], dtype=torch.uint8), torch.ones(answer, dtype=torch.uint8)])
        out.append(dict(sample_id=f'{name}-t{i:02d}', conversation_id=name, input_ids=ids, loss_mask=mask))
    return out


def states(g, x: dict, H: int, n_aux: int = 3, topk: int = 64, Vd: int = 2048) -> dict:
    "Random nf4 tensors of sample `x` (the bytes and the reads do not depend on the values)"
    from eagle3nb.store import quantize_nf4

    T = len(x['input_ids'])
    q, s = quantize_nf4(torch.randn(T, n_aux, H, generator=g))
    p = torch.softmax(torch.randn(T, topk, generator=g), -1).half()
    i = torch.stack([torch.randperm(Vd, generator=g)[:topk] for _ in range(T)]).to(torch.int16)
    return dict(input_ids=x['input_ids'], loss_mask=x['loss_mask'], aux=q, aux_scale=s, topk_p=p, topk_idx=i)


def write(d: Path, samples: list, H: int, share: bool, seed: int = 0, Vd: int = 2048) -> dict:
    "Write `samples` into an nf4 store at `d`, shared or whole; its state rows and bytes"
    from eagle3nb.store import ShardWriter, shard_meta, shard_files, shared_prefixes

    ids, conv = [x['sample_id'] for x in samples], [x['conversation_id'] for x in samples]
    plan = shared_prefixes(ids, conv, lambda j: samples[j]['input_ids'].numpy()) if share else {}
    g = torch.Generator().manual_seed(seed)
    w = ShardWriter(d, shard_meta('nf4', [2, 30, 58], H, 'bench', topk=64, draft_vocab_size=Vd), shard_bytes=256 << 20)
    for x in samples:
        w.add(x['sample_id'], states(g, x, H, Vd=Vd), plan.get(x['sample_id']))
    w.flush()
    return dict(rows=w.stored, tokens=w.tokens, bytes=sum(p.stat().st_size for p in shard_files(d)))


def disk_table(a) -> list:
    "Part 1: state rows and bytes of one trajectory's stores, whole and shared, against the turns answered"
    from eagle3nb.store import bytes_per_token

    kimi = bytes_per_token('nf4', 7168)
    rows, tmp = [], Path(tempfile.mkdtemp(prefix='e3nb-prefix-'))
    ks = sorted({k for k in (1, 2, 4, 8, 16, a.turns) if k <= a.turns})
    for k in ks:
        g = torch.Generator().manual_seed(k)
        samples = turn_samples(g, a.recorded, a.turns, a.answer, k, 'traj')
        got = {s: write(tmp / f'{k}-{s}', samples, a.width, s == 'shared') for s in ('whole', 'shared')}
        for s in got:
            shutil.rmtree(tmp / f'{k}-{s}')
        w, sh = got['whole'], got['shared']
        rows.append(
            dict(
                turns=k,
                whole_rows=w['rows'],
                shared_rows=sh['rows'],
                whole_bytes=w['bytes'],
                shared_bytes=sh['bytes'],
                whole_kimi_gb=w['rows'] * kimi / 1e9,
                shared_kimi_gb=sh['rows'] * kimi / 1e9,
                ratio=w['bytes'] / sh['bytes'],
            )
        )
    shutil.rmtree(tmp, ignore_errors=True)
    return rows


def train_stores(a, tmp: Path) -> dict:
    "Part 2's two stores: every turn of `--trajectories` trajectories answered, whole and shared (H = 256)"
    g = torch.Generator().manual_seed(0)
    samples = [
        x
        for t in range(a.trajectories)
        for x in turn_samples(g, a.train_recorded, a.train_turns, a.train_answer, 0, f'traj{t}', vocab=4000)
    ]
    return {s: (tmp / s, write(tmp / s, samples, 256, s == 'shared')) for s in ('whole', 'shared')}


def tiny_draft():
    "The demo-sized Llama draft (H = 256) over a 4,000-token target vocabulary, a 2,048-token draft vocabulary"
    from transformers import LlamaConfig
    from eagle3nb.draft import new_draft

    cfg = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=1024,
        vocab_size=4000,
        num_hidden_layers=4,
        max_position_embeddings=8192,
    )
    g = torch.Generator().manual_seed(0)
    d2t = torch.arange(2048) * 0  # draft token i is target token i: offsets 0
    t2d = torch.arange(4000) < 2048
    return new_draft(cfg, torch.randn(4000, 256, generator=g) * 0.02, d2t, t2d, seed=0)


def train_rate(store: Path, steps: int, run: Path) -> float:
    "tokens/s of `steps` steps of the real training loop on `store` (its own metrics: tokens read / seconds)"
    from eagle3nb.store import HiddenStates
    from eagle3nb.train import TrainConfig, train

    cfg = TrainConfig(ttt_steps=3, max_steps=steps, warmup_steps=5, ckpt_every=steps, eval_every=steps, log_every=1)
    train(tiny_draft(), HiddenStates(store, raw=True), run, cfg, log=lambda *x: None)
    lines = [json.loads(x) for x in (run / 'metrics.jsonl').read_text().splitlines()]
    lines = [x for x in lines if x.get('split') == 'train' and x['step'] > 5]  # the first steps warm up
    return sum(x['tokens'] for x in lines) / sum(x['s'] for x in lines)


def read_rate(a, tmp: Path) -> dict:
    "The read path alone at H = `--read-width`: every sample of a trajectory, whole store against shared"
    from eagle3nb.store import HiddenStates
    from eagle3nb.train import aux_states

    g = torch.Generator().manual_seed(1)
    samples = turn_samples(g, 2000, 8, 200, 0, 'traj')
    out = {}
    for s in ('whole', 'shared'):
        write(tmp / f'read-{s}', samples, a.read_width, s == 'shared')
    for _ in range(a.rounds):
        for s in ('whole', 'shared'):
            ds = HiddenStates(tmp / f'read-{s}', raw=True)
            t0, n = time.perf_counter(), 0
            for i in range(len(ds)):
                x = aux_states(ds[i], 'cpu')
                n += len(x)
            out.setdefault(s, []).append(n / (time.perf_counter() - t0))
    return {s: statistics.median(v) for s, v in out.items()}


def main():
    a = args()
    rep = dict(args=vars(a))
    rep['disk'] = disk_table(a)
    print(f"one trajectory: {a.recorded} recorded tokens, {a.turns} turns, answers of {a.answer} tokens; nf4")
    print(
        'turns | whole rows | shared rows | whole GB at H=7168 | shared GB at H=7168 | whole / shared (bytes on disk)'
    )
    for r in rep['disk']:
        print(
            f"{r['turns']:5d} | {r['whole_rows']:10,d} | {r['shared_rows']:11,d} | {r['whole_kimi_gb']:18.2f} | "
            f"{r['shared_kimi_gb']:19.2f} | {r['ratio']:.2f}x"
        )
    tmp = Path(tempfile.mkdtemp(prefix='e3nb-prefix-train-'))
    stores = train_stores(a, tmp)
    for s, (_, info) in stores.items():
        print(
            f"train store {s}: {info['tokens']:,} tokens in samples, {info['rows']:,} state rows, {info['bytes']:,} B"
        )
    got = {s: [] for s in stores}
    for i in range(a.rounds):
        for s, (d, _) in stores.items():
            got[s].append(train_rate(d, a.train_steps, tmp / f'run-{s}-{i}'))
    rep['train'] = {s: dict(tokens_per_s=statistics.median(v), runs=v, **stores[s][1]) for s, v in got.items()}
    base = rep['train']['whole']['tokens_per_s']
    for s, r in rep['train'].items():
        runs = ', '.join(f'{x:.0f}' for x in r['runs'])
        print(f"train tokens/s, {s:6s}: {r['tokens_per_s']:8.1f} ({r['tokens_per_s'] / base:.2f}x whole; runs {runs})")
    rep['read'] = read_rate(a, tmp)
    for s, v in rep['read'].items():
        print(f"read path at H={a.read_width}, {s:6s}: {v:10,.0f} tokens/s ({v / rep['read']['whole']:.2f}x whole)")
    shutil.rmtree(tmp, ignore_errors=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rep, indent=1))


if __name__ == '__main__':
    main()
