"""Length-grouped batches against random ones: padding, train step time and offline accept length, side by side.

    OMP_NUM_THREADS=1 .venv/bin/python bench/length_groups.py RECIPE [--steps 200]

RECIPE is a recipe whose run reached the extract phase (its hidden-state store is read as the train phase reads it),
e.g. the demo's: `eagle3nb run recipes/demo.yaml --phases target_check,download,prepare,render,catalog,generate,merge,
vocab,extract`. Both sides train the same draft (same init, seed, learning-rate schedule, steps) on the same store;
only the order differs: `length_window` 64 (the default: windows of 64 samples sorted longest first) against 0 (a
plain random permutation). Printed: padded tokens and attention area over one epoch of batches, seconds and tokens/s
of the training steps, and the offline accept length on the eval split at the end.
"""

import argparse, tempfile, time
from dataclasses import replace


def padding(order: list, lengths: list, bs: int) -> tuple:  # padded tokens / tokens, padded attention / attention
    tok = area = pad_tok = pad_area = 0
    for j in range(0, len(order) - bs + 1, bs):
        ls = [lengths[i] for i in order[j : j + bs]]
        tok, area = tok + sum(ls), area + sum(x * x for x in ls)
        pad_tok, pad_area = pad_tok + bs * max(ls), pad_area + bs * max(ls) ** 2
    return pad_tok / tok, pad_area / area


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('recipe')
    ap.add_argument('--steps', type=int, default=200)
    ap.add_argument('--batch', type=int, default=2)
    a = ap.parse_args()
    from eagle3nb.draft import new_draft
    from eagle3nb.phase import RunContext
    from eagle3nb.phases.train import Params, store_inputs, train_config
    from eagle3nb.train import epoch_order, evaluate, read_metrics, sample_lengths, train

    ctx = RunContext.open(a.recipe, tempfile.mkdtemp())
    inp = store_inputs(ctx)
    assert not isinstance(inp, str), inp
    p = Params(max_steps=a.steps, batch_size=a.batch, ttt_steps=3, lr=0.003, warmup_steps=20)
    base = replace(train_config(p, False), ckpt_every=a.steps, eval_every=a.steps)
    L, n = sample_lengths(inp.train), len(inp.train)
    rows = []
    for window in (0, 64):
        cfg = replace(base, length_window=window)
        order = epoch_order(n, cfg.seed, 0, L if window else None, window).tolist()
        pt, pa = padding(order, L, a.batch)
        draft = new_draft(inp.config, inp.embed, inp.d2t, inp.t2d, seed=p.seed)
        d = tempfile.mkdtemp()
        t0 = time.time()
        train(draft, inp.train, d, cfg, lm_head=inp.lm_head, log=lambda *_: None)
        secs = time.time() - t0
        last = [m for m in read_metrics(d) if m['split'] == 'train'][-1]
        ev = evaluate(draft, inp.eval, cfg.ttt_steps, lm_head=inp.lm_head)['all'] if inp.eval is not None else {}
        rows.append((window, pt, pa, secs, last['tokens'] / last['s'], ev.get('accept_est')))
    print(f'{n} train samples ({min(L)}..{max(L)} tokens), batches of {a.batch}, {a.steps} steps a side')
    print('| length_window | padded tokens | padded attention | train s | tokens/s | offline accept |')
    print('|---|---|---|---|---|---|')
    for w, pt, pa, s, ts, acc in rows:
        print(f'| {w} | {pt:.2f}x | {pa:.2f}x | {s:.1f} | {ts:.0f} | {acc:.2f} |')
    print(f'ratio: {rows[0][3] / rows[1][3]:.2f}x faster grouped (train seconds, random / grouped)')
    ctx.close()


if __name__ == '__main__':
    main()
