"""What extract's `compact` store (fp8 aux + top-k target probabilities) costs in accept length against `bf16`, on kimi-tiny.

    OMP_NUM_THREADS=1 .venv/bin/python bench/compact_cost.py [--n 8 --eval-n 4 --new-tokens 48 --steps 200 --json out.json]

Data: the toy target's own greedy generations (`toy_samples`, as the 60_train smoke run), extracted twice with
`eagle3nb.extract.extract` (fp32 target, the same one that generated) into a `bf16` store and a `compact` store (same
draft vocab: top-1024 ids of the training generations; compact keeps the default topk=64). The same draft (same init
seed, same data order, same TrainConfig as the smoke run) is trained once from each store.

Both drafts are then measured against the same reference, the bf16 store (aux in bf16, full target distribution from
`final` @ lm_head), since serving feeds the draft unquantized hidden states and the target's full distribution decides
acceptance. Splits: 'train' = the training generations themselves, 'eval' = held-out generations. The random-weight
toy's text is unpredictable off the training set (held-out accept length stays at 1.000), so the 'train' split is the
only one where the comparison says something; it measures fit, not generalisation.
Accept length: `accept_est` = 1 + sum_k prod acc_j (per-step top-1 accuracies), `accept_sim` = exact offline
simulation of greedy chain decoding (`chain_hits` / `accept_lengths`). Relative difference = compact / bf16 - 1.
"""

import argparse, json, os, tempfile, time
from pathlib import Path
import torch


def args():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    a = p.add_argument
    a('--n', type=int, default=8, help='training generations')
    a('--eval-n', type=int, default=4, help='held-out generations')
    a('--new-tokens', type=int, default=48)
    a('--steps', type=int, default=200)
    a('--lr', type=float, default=3e-3)
    a('--batch-size', type=int, default=4)
    a('--ttt', type=int, default=7)
    a('--topk', type=int, default=64)
    a('--draft-vocab', type=int, default=1024)
    a('--seed', type=int, default=0)
    a('--json', default=None, help='also write the figures here')
    a('--keep', default=None, help='work folder to keep')
    return p.parse_args()


def main():
    c = args()
    t_all = time.time()
    from eagle3nb.toy import ensure_toy
    from eagle3nb.extract import extract, load_target
    from eagle3nb.store import HiddenStates
    from eagle3nb.vocab import top_k_ids, vocab_maps
    from eagle3nb.draft import new_draft
    from eagle3nb.train import TrainConfig, train, evaluate, toy_samples

    work = Path(c.keep or tempfile.mkdtemp(prefix='e3nb-compact-'))
    t0 = time.time()
    ts = toy_samples(n=c.n, new_tokens=c.new_tokens, eval_n=c.eval_n)
    d2t, t2d = vocab_maps(top_k_ids(ts['counts'], c.draft_vocab), ts['V'])
    rows = {
        split: [
            dict(sample_id=f'{split}-{i}', input_ids=s['input_ids'].tolist(), loss_mask=s['loss_mask'].tolist())
            for i, s in enumerate(ts[split])
        ]
        for split in ('train', 'eval')
    }
    print(
        f"{len(rows['train'])} train / {len(rows['eval'])} eval generations of {len(ts['train'][0]['input_ids'])} tokens "
        f"in {time.time() - t0:.1f}s"
    )
    tgt = load_target(ensure_toy('kimi-tiny'), dtype=torch.float32)  # the generating precision: its argmax is the text
    stores, ext = {}, {}
    for mode in ('bf16', 'compact'):
        for split in ('train', 'eval'):
            st = extract(tgt, rows[split], work / mode / split, mode=mode, d2t=d2t, topk=c.topk)
            ext[f'{mode}/{split}'] = dict(bytes=st['bytes'], tokens=st['tokens'], bytes_per_token=st['bytes_per_token'])
            stores[mode, split] = HiddenStates(work / mode / split)
    lm_head = ts['lm_head']
    cfg = TrainConfig(
        ttt_steps=c.ttt,
        lr=c.lr,
        max_steps=c.steps,
        warmup_steps=10,
        batch_size=c.batch_size,
        ckpt_every=c.steps,
        eval_every=c.steps,
        log_every=10,
        seed=c.seed,
    )
    res = {}
    for mode in ('bf16', 'compact'):
        t0 = time.time()
        draft = new_draft(ts['config'], ts['embed'], d2t, t2d, seed=c.seed)
        train(
            draft,
            stores[mode, 'train'],
            work / 'runs' / mode,
            cfg,
            lm_head=lm_head if mode == 'bf16' else None,
            log=lambda *a: None,
        )
        secs = time.time() - t0
        for split in ('train', 'eval'):  # both measured on the bf16 store: the reference signal
            m = evaluate(draft, stores['bf16', split], cfg.ttt_steps, cfg.decay, lm_head=lm_head)['all']
            res[mode, split] = dict(
                accept_est=m['accept_est'],
                accept_sim=m['accept_sim'],
                rounds=m['rounds'],
                acc_0=m['acc_0'],
                train_s=round(secs, 1),
            )
        print(f'{mode}: trained {c.steps} steps in {secs:.1f}s')
    out = dict(config=vars(c), extract=ext, results=[])
    print(f"\n{'split':6} {'store':8} {'accept_est':>10} {'accept_sim':>10} {'rounds':>6} {'acc_0':>6}")
    for split in ('train', 'eval'):
        for mode in ('bf16', 'compact'):
            r = res[mode, split]
            print(
                f"{split:6} {mode:8} {r['accept_est']:10.3f} {r['accept_sim']:10.3f} {r['rounds']:6d} {r['acc_0']:6.3f}"
            )
            out['results'].append(dict(split=split, store=mode, **r))
        rel = {k: res['compact', split][k] / res['bf16', split][k] - 1 for k in ('accept_est', 'accept_sim')}
        print(f"{split:6} {'rel diff':8} {rel['accept_est']:+10.2%} {rel['accept_sim']:+10.2%}   (compact / bf16 - 1)")
        out[f'rel_{split}'] = rel
    for k, v in ext.items():
        print(f"store {k}: {v['bytes']} bytes, {v['tokens']} tokens, {v['bytes_per_token']} bytes/token (planned)")
    print(f'total {time.time() - t_all:.1f}s; work folder {work}')
    if c.json:
        Path(c.json).write_text(json.dumps(out, indent=1))


if __name__ == '__main__':
    main()
