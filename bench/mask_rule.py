"""The TTT attention mask, settled by the engine: the demo draft trained with each `mask_rule`, served by vLLM.

    OMP_NUM_THREADS=1 .venv/bin/python bench/mask_rule.py --run papermill_runs/<run_id> \
        [--seeds 0,1,2 --rules eagle3,inference --n 8 --max-tokens 48 --k 3 --draft '{"fc_norm": true}' --out DIR --json out.json]

`--run` is a finished demo run (`eagle3nb run recipes/demo.yaml`): its frozen recipe names the data root, whose
hidden-state store, vocabulary and eval split are the ones the demo's train phase used. For every (rule, seed) the
draft is built and trained exactly as the train phase builds it (`new_draft`, the recipe's `phases.train` numbers),
with only `TrainConfig.mask_rule` and the seeds (draft init and data order) changed, then exported and served:
- offline: the draft's simulated accept length on the eval split's hidden states (`evaluate(..., rule='inference')`,
  the serving-time chain, whatever rule it was trained with);
- served: `verify` on the demo's held-out prompts (the eval split's, as the verify phase picks them) against one
  shared baseline server of the target alone; accept length 1 + accepted / drafts, and accepted per position.
The two rules: 'eagle3' hides step-0 keys s > t - i at TTT step i (EAGLE's trainer, SpecForge's SDPA path);
'inference' keeps step-0 keys causal plus the diagonal of each later step (speculators, TorchSpec; what an engine's
draft attends to).
"""

import argparse, json, statistics, tempfile, time
from pathlib import Path
from types import SimpleNamespace


def args():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    a = p.add_argument
    a('--run', required=True, help='a finished demo run folder (papermill_runs/<run_id>)')
    a('--seeds', default='0,1,2')
    a('--rules', default='eagle3,inference')
    a('--n', type=int, default=8)
    a('--max-tokens', type=int, default=48)
    a('--k', type=int, default=3)
    a('--steps', type=int, default=0, help="optimizer steps; 0: the recipe's phases.train.max_steps")
    a(
        '--draft',
        default=None,
        help='JSON draft family overriding the recipe\'s phases.train.draft, e.g. \'{"fc_norm": true}\'',
    )
    a('--out', default=None, help='work folder (default: a temp folder)')
    a('--json', default=None)
    return p.parse_args()


def setup(run):
    "What the demo's train phase read: recipe, target, store, vocab, target tensors, train numbers"
    from eagle3nb.recipe import load_recipe
    from eagle3nb.store import HiddenStates, shard_files
    from eagle3nb.vocab import load_vocab
    from eagle3nb.train import target_tensors

    r = load_recipe(Path(run) / 'recipe.yaml')
    root = Path(r.data_root)
    mode = next(m for m in ('bf16', 'compact') if shard_files(root / 'hidden' / m / 'train'))
    d2t, t2d, _ = load_vocab(root / 'vocab')
    c = json.loads((Path(r.target.model) / 'config.json').read_text())
    tt = target_tensors(r.target.model)
    return SimpleNamespace(
        r=r,
        root=root,
        target=r.target.model,
        d2t=d2t,
        t2d=t2d,
        tcfg=SimpleNamespace(**c.get('text_config', c)),
        embed=tt['embed'],
        lm_head=tt['lm_head'] if mode == 'bf16' else None,
        train=HiddenStates(root / 'hidden' / mode / 'train'),
        eval=HiddenStates(root / 'hidden' / mode / 'eval'),
        p=dict(r.phases.get('train') or {}),
        draft=dict((r.phases.get('train') or {}).get('draft') or {}),
    )


def train_one(s, rule, seed, steps, out):
    from eagle3nb.draft import new_draft, draft_options
    from eagle3nb.train import TrainConfig, train, evaluate, latest_checkpoint
    from eagle3nb.export import export_draft

    p = s.p
    cfg = TrainConfig(
        ttt_steps=p.get('ttt_steps', 7),
        lr=p.get('lr', 1e-4),
        max_steps=steps or p.get('max_steps', 1000),
        warmup_steps=p.get('warmup_steps', 100),
        batch_size=p.get('batch_size', 1),
        mask_rule=rule,
        seed=seed,
        ckpt_every=steps or p.get('max_steps', 1000),
        eval_every=steps or p.get('max_steps', 1000),
        log_every=steps or p.get('max_steps', 1000),
    )
    dr = new_draft(s.tcfg, s.embed, s.d2t, s.t2d, seed=seed, **draft_options(s.draft))
    t0 = time.perf_counter()
    train(dr, s.train, out / 'run', cfg, lm_head=s.lm_head, log=lambda *a: None)
    dt = time.perf_counter() - t0
    export_draft(latest_checkpoint(out / 'run'), out / 'export', s.target, data_root=s.root)
    ev = evaluate(dr, s.eval, cfg.ttt_steps, lm_head=s.lm_head, rule='inference')['all']
    return dict(
        rule=rule,
        seed=seed,
        steps=cfg.max_steps,
        train_s=round(dt, 1),
        offline_eval=round(ev['accept_sim'], 3),
        export=str(out / 'export'),
    )


def serve(rows, s, c):
    "Every export served beside one shared baseline, on the verify phase's prompts"
    from eagle3nb.phase import EngineSession
    from eagle3nb.verify import verify, recipe_prompts

    prompts = recipe_prompts(s.r, c.n)
    with EngineSession.of(s.target) as es:  # one baseline, started by the first verify, shared by the rest
        for r in rows:
            v = verify(r['export'], s.target, prompts, c.max_tokens, c.k, engines=es)
            if not v['loaded']:
                raise SystemExit(f"{r['rule']} seed {r['seed']}: the engine did not serve the export: {v['error']}")
            r.update(
                served=round(v['accept_length'], 3),
                offline_prompts=round(v['offline_accept_length'], 3),
                per_position=[round(a / v['drafts'], 3) for a in v['accepted_per_position']],
                greedy=f"{v['greedy_identical']}/{len(prompts)}",
                distinct=f"{len({t for x in v['continuations'] for t in x})}/{sum(map(len, v['continuations']))}",
            )
            print({k: r[k] for k in r if k != 'export'}, flush=True)


def main():
    c = args()
    s = setup(c.run)
    if c.draft:
        s.draft = json.loads(c.draft)
    out = Path(c.out or tempfile.mkdtemp(prefix='e3nb-mask-'))
    rows = []
    for rule in c.rules.split(','):
        for seed in map(int, c.seeds.split(',')):
            rows.append(train_one(s, rule, seed, c.steps, out / f'{rule}-{seed}'))
            print(rows[-1], flush=True)
    serve(rows, s, c)
    cols = [
        'rule',
        'seed',
        'steps',
        'train_s',
        'served',
        'per_position',
        'offline_prompts',
        'offline_eval',
        'greedy',
        'distinct',
    ]
    print('\n| ' + ' | '.join(cols) + ' |\n|' + '---|' * len(cols))
    for r in rows:
        print('| ' + ' | '.join(str(r.get(k)) for k in cols) + ' |')
    print('\n| rule | served mean | sd | per position (mean) | offline on the prompts (mean) |\n|---|---|---|---|---|')
    means = {}
    for rule in c.rules.split(','):
        rs = [r for r in rows if r['rule'] == rule]
        xs = [r['served'] for r in rs]
        means[rule] = statistics.mean(xs)
        pp = [round(statistics.mean(r['per_position'][i] for r in rs), 3) for i in range(c.k)]
        print(
            f"| {rule} | {means[rule]:.3f} | {statistics.stdev(xs) if len(xs) > 1 else 0:.3f} | {pp} | {statistics.mean(r['offline_prompts'] for r in rs):.3f} |"
        )
    if len(means) == 2:
        (a, ma), (b, mb) = means.items()
        print(f'\nserved accept length {a} / {b}: {ma / mb:.3f}x')
    if c.json:
        Path(c.json).write_text(json.dumps(dict(args=vars(c), rows=rows), indent=1) + '\n')


if __name__ == '__main__':
    main()
