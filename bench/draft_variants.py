"""Draft variants side by side: llama, llama with each EAGLE-3.1 flag, and mla, on one toy target, same data, steps, seeds.

    OMP_NUM_THREADS=1 EAGLE3NB_VLLM=/work/main/.venv-vllm .venv/bin/python bench/draft_variants.py \
        [--toy kimi-tiny --n 12 --eval-n 4 --steps 300 --k 3 --max-tokens 24 --no-serve --json out.json]

Every variant trains from the same seed on the same samples (the toy's own greedy continuations, `toy_samples`) for
the same number of optimizer steps, with the same TrainConfig, one after the other in this process. Per variant:
- step_ms: wall time of `train` divided by its steps (collate + 5-step TTT forward/backward + AdamW; no evaluation);
- offline accept length (`evaluate(..., rule='inference')['accept_sim']`: greedy chain speculation simulated
  exactly on the target's continuations) on the held-out eval samples and on the train samples;
- served accept length: the export served by vLLM (CPU build) beside the target alone on the train prompts
  (`verify`), with greedy identity checked; 1 + accepted / drafts at k draft tokens.
On kimi-tiny the Llama (MHA) variants need VLLM_MLA_DISABLE=1 next to the MLA target (the CPU build has no common
block size otherwise); the mla variants run with MLA on. One baseline server per setting is shared.
"""

import argparse, json, tempfile, time
from pathlib import Path
import torch

VARIANTS = {
    'llama': {},
    'llama+fc_norm': dict(fc_norm=True),
    'llama+norm_before_fc': dict(norm_before_fc=True),
    'llama+norm_output': dict(norm_output=True),
    'mla': dict(arch='mla'),
    'mla+fc_norm+norm_output': dict(arch='mla', fc_norm=True, norm_output=True),
}


def args():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    a = p.add_argument
    a('--toy', default='kimi-tiny')
    a('--n', type=int, default=12)
    a('--eval-n', type=int, default=4)
    a('--steps', type=int, default=300)
    a('--k', type=int, default=3)
    a('--max-tokens', type=int, default=24)
    a('--seed', type=int, default=0)
    a('--variants', default=','.join(VARIANTS))
    a('--no-serve', action='store_true')
    a('--out', default=None, help='work folder (default: a temp folder)')
    a('--json', default=None)
    return p.parse_args()


def run_variant(name, opts, ts, c, out):
    from eagle3nb.draft import new_draft, draft_options
    from eagle3nb.train import train, TrainConfig, evaluate, latest_checkpoint
    from eagle3nb.export import export_draft
    from eagle3nb.toy import ensure_toy

    V = ts['V']
    dr = new_draft(
        ts['config'],
        ts['embed'],
        torch.zeros(V, dtype=torch.long),
        torch.ones(V, dtype=torch.bool),
        lm_head=ts['lm_head'],
        seed=c.seed,
        **draft_options(opts),
    )
    cfg = TrainConfig(
        max_steps=c.steps,
        warmup_steps=10,
        lr=3e-3,
        ckpt_every=c.steps,
        eval_every=c.steps,
        log_every=c.steps,
        ttt_steps=5,
        seed=c.seed,
        batch_size=1,
    )
    t0 = time.perf_counter()
    train(dr, ts['train'], out / 'run', cfg, log=lambda *a: None)
    dt = time.perf_counter() - t0
    export_draft(latest_checkpoint(out / 'run'), out / 'export', ensure_toy(c.toy))
    ev = lambda s: evaluate(dr, s, c.k, rule='inference')['all']['accept_sim']
    return dict(
        variant=name,
        params=sum(p.numel() for p in dr.parameters()),
        step_ms=round(1000 * dt / c.steps, 1),
        offline_eval=round(ev(ts['eval']), 3),
        offline_train=round(ev(ts['train']), 3),
        export=str(out / 'export'),
    )


def serve(rows, ts, c):
    "Served accept length of every export, one shared baseline per VLLM_MLA_DISABLE setting"
    from eagle3nb.engine import is_mla
    from eagle3nb.phase import EngineSession
    from eagle3nb.verify import verify
    from eagle3nb.toy import ensure_toy

    target = ensure_toy(c.toy)
    prompts = [s['input_ids'][:16].tolist() for s in ts['train']]
    mla_off = lambda r: is_mla(target) and not is_mla(r['export'])  # VLLM_MLA_DISABLE=1 for this export
    for off in sorted({mla_off(r) for r in rows}):
        with EngineSession.of(target) as es:  # its baseline is started once and shared; stopped on exit
            for r in (r for r in rows if mla_off(r) == off):
                v = verify(r['export'], target, prompts, c.max_tokens, c.k, engines=es, mla_disable=off)
                r.update(
                    served=round(v['accept_length'], 3) if v.get('loaded') else None,
                    greedy=f"{v.get('greedy_identical')}/{len(prompts)}",
                    served_offline=round(v['offline_accept_length'], 3) if v.get('offline_accept_length') else None,
                    error=v.get('error'),
                    mla_disable=off,
                )
                print(r, flush=True)


def main():
    c = args()
    from eagle3nb.train import toy_samples

    out = Path(c.out or tempfile.mkdtemp(prefix='e3nb-variants-'))
    ts = toy_samples(n=c.n, new_tokens=c.max_tokens + 8, name=c.toy, eval_n=c.eval_n)
    rows = []
    for name in c.variants.split(','):
        rows.append(run_variant(name, VARIANTS[name], ts, c, out / name))
        print(rows[-1], flush=True)
    if not c.no_serve:
        serve(rows, ts, c)
    cols = ['variant', 'params', 'step_ms', 'offline_eval', 'offline_train'] + (
        [] if c.no_serve else ['served', 'served_offline', 'greedy']
    )
    print('\n| ' + ' | '.join(cols) + ' |\n|' + '---|' * len(cols))
    for r in rows:
        print('| ' + ' | '.join(str(r.get(k)) for k in cols) + ' |')
    if c.json:
        Path(c.json).write_text(json.dumps(dict(args=vars(c), rows=rows), indent=1) + '\n')


if __name__ == '__main__':
    main()
