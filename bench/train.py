"""Draft train-step throughput: eagle3nb vs speculators 0.9.0's Eagle3 draft, side by side in one process, on CPU.

    bash bench/setup_bench_venv.sh                      # once: .venv-bench with eagle3nb + speculators==0.9.0 --no-deps
    OMP_NUM_THREADS=1 .venv-bench/bin/python bench/train.py [--hidden 256 --heads 4 --inter 1024 --seq 512 --vocab 4096
                                                             --draft-vocab 2048 --ttt 3 --rounds 6 --warmup 1]

One training step = what each library's trainer does per batch: forward of the k-step TTT unroll with its loss,
zero_grad, backward, grad-norm clip, AdamW step, LR-scheduler step. eagle3nb's step also includes `collate` (the
target distribution is built from the sample there); speculators' step computes its targets inside forward from the
verifier's last hidden state through its frozen verifier_norm/verifier_lm_head. Both get the same synthetic sample:
random ids, aux states (T, 3H), loss mask, and the same target distribution over the draft vocab (eagle3nb reads it
as `target_logits` (T, Vd) = rmsnorm(final) @ lm_head[draft ids].T, speculators recomputes those logits each step).
Sides alternate every round; the figure is the median step time, tokens/s = T / median.

Speculators runs as its trainer configures it: fp32 on CPU (its bf16 autocast is a GPU setting), attention 'eager'
(dense float mask), loss 'kl_div' with the 'eager' implementation (the fused one is a GPU kernel), its draft
lm_head FROZEN (it is copied from the verifier and never trained). Because eagle3nb trains lm_head, a second
speculators side with lm_head.requires_grad=True ("speculators+lm_head") is timed too, for the like-for-like ratio.
--sdpa adds a side with speculators' draft_attn_impl='sdpa' (eagle3nb's attention is F.scaled_dot_product_attention
with a bool mask), for reference; the headline ratio is against 'eager', as the issue asks.
"""

import argparse, json, os, statistics, sys, time
import torch


def args():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    a = p.add_argument
    a('--hidden', type=int, default=256)
    a('--heads', type=int, default=4)
    a('--inter', type=int, default=1024)
    a('--seq', type=int, default=512)
    a('--vocab', type=int, default=4096)
    a('--draft-vocab', type=int, default=2048)
    a('--ttt', type=int, default=3)
    a('--rounds', type=int, default=6)
    a('--warmup', type=int, default=1)
    a('--sdpa', action='store_true', help="also time speculators with draft_attn_impl='sdpa' (lm_head frozen)")
    a('--seed', type=int, default=0)
    a('--json', default=None, help='also write the figures here')
    return p.parse_args()


def make_data(c, g):
    "One synthetic sample, shared by both sides"
    H, T, V, Vd = c.hidden, c.seq, c.vocab, c.draft_vocab
    draft_ids = torch.randperm(V, generator=g)[:Vd].sort().values  # (Vd,) target ids of the draft vocab
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[draft_ids] = True
    d2t = draft_ids - torch.arange(Vd)
    embed = torch.randn(V, H, generator=g) * 0.02  # the target's input embeddings
    lm_head = torch.randn(V, H, generator=g) * 0.02 * 50  # the target's lm_head (peaky enough targets)
    ids = torch.randint(0, V, (T,), generator=g)
    loss_mask = (torch.arange(T) >= T // 8).long()  # a prompt, then the completion
    aux = torch.randn(T, 3 * H, generator=g)
    final = torch.randn(T, H, generator=g)  # the target's last hidden state
    nf = final * torch.rsqrt(final.pow(2).mean(-1, keepdim=True) + 1e-6)  # its RMSNorm (unit weight)
    target_logits = nf @ lm_head[draft_ids].T  # (T, Vd)
    return dict(
        H=H,
        T=T,
        V=V,
        Vd=Vd,
        t2d=t2d,
        d2t=d2t,
        embed=embed,
        lm_head=lm_head,
        draft_ids=draft_ids,
        ids=ids,
        loss_mask=loss_mask,
        aux=aux,
        final=final,
        target_logits=target_logits,
    )


def tcfg(c, d):
    "A tiny Llama target config with the bench's sizes"
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        hidden_size=d['H'],
        num_attention_heads=c.heads,
        num_key_value_heads=c.heads,
        head_dim=d['H'] // c.heads,
        intermediate_size=c.inter,
        vocab_size=d['V'],
        num_hidden_layers=1,
        rms_norm_eps=1e-6,
        max_position_embeddings=4 * c.seq,
        attention_bias=False,
        mlp_bias=False,
    )
    cfg.rope_theta = 10000.0
    return cfg


def eagle3nb_side(c, d):
    from eagle3nb.draft import new_draft, draft_target_ids
    from eagle3nb.train import TTT, TrainConfig, collate, ttt_loss, lr_factor

    m = new_draft(tcfg(c, d), d['embed'], d['d2t'], d['t2d'], seed=c.seed, lm_head=d['lm_head'])
    tc = TrainConfig(ttt_steps=c.ttt, max_steps=10_000, warmup_steps=10)
    net = TTT(m, tc.ttt_steps, tc.mask_rule)
    opt = torch.optim.AdamW(
        [p for p in m.parameters() if p.requires_grad], lr=tc.lr, betas=(0.9, tc.beta2), weight_decay=tc.weight_decay
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, tc))
    tids, t2d = draft_target_ids(m), m.t2d
    sample = dict(input_ids=d['ids'], loss_mask=d['loss_mask'], aux=d['aux'], target_logits=d['target_logits'])

    def step():  # the body of eagle3nb.train.train's loop, less logging/checkpointing
        b = collate([sample], tids, t2d)
        loss, _ = ttt_loss(net(b), b, tc.decay)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), tc.grad_clip)
        opt.step()
        sched.step()
        return loss.item()

    return step, sum(p.numel() for p in m.parameters() if p.requires_grad)


def speculators_side(c, d, train_lm_head=False, attn='eager'):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    tl = tcfg(c, d)
    tl._attn_implementation = attn
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=tl,
        draft_vocab_size=d['Vd'],
        norm_before_residual=False,
        speculators_config=SpeculatorsConfig(
            algorithm='eagle3',
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=c.ttt)],
            default_proposal_method='greedy',
            verifier=VerifierConfig(name_or_path=None, architectures=[]),
        ),
    )
    torch.manual_seed(c.seed)
    m = Eagle3DraftModel(cfg)
    assert m._attn_impl == attn
    with torch.no_grad():  # what load_vocab_mappings + load_verifier_weights do, from tensors instead of a checkpoint
        m.t2d.copy_(d['t2d'])
        m.d2t.copy_(d['d2t'])
        m.embed_tokens.weight.copy_(d['embed'])
        m.lm_head.weight.copy_(d['lm_head'][d['draft_ids']])
        m.verifier_lm_head.weight.copy_(d['lm_head'][d['draft_ids']])
        m.verifier_norm.weight.fill_(1.0)
    m.embed_tokens.weight.requires_grad_(False)
    m.verifier_lm_head.weight.requires_grad_(False)
    m.verifier_norm.weight.requires_grad_(False)
    m.lm_head.weight.requires_grad_(train_lm_head)
    m.train()
    loss_config = resolve_loss_config('kl_div', 'eager')
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    batch = dict(
        hidden_states=d['aux'][None],
        input_ids=d['ids'][None],
        document_ids=torch.zeros(1, d['T'], dtype=torch.long),
        loss_mask=d['loss_mask'][None].bool(),
        verifier_last_hidden_states=d['final'][None],
    )

    def step():  # the body of speculators.train.trainer.Trainer.train_epoch, less metrics/logging
        _, loss, _ = m(**batch, ttt_steps=c.ttt, ttt_step_loss_decay=1.0, loss_config=loss_config)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        sched.step()
        return loss.item()

    return step, sum(p.numel() for p in m.parameters() if p.requires_grad)


def main():
    c = args()
    torch.manual_seed(c.seed)
    d = make_data(c, torch.Generator().manual_seed(c.seed))
    sides = {
        'eagle3nb': eagle3nb_side(c, d),
        'speculators': speculators_side(c, d),
        'speculators+lm_head': speculators_side(c, d, train_lm_head=True),
    }
    if c.sdpa:
        sides['speculators(sdpa)'] = speculators_side(c, d, attn='sdpa')
    import importlib.metadata as md

    print(
        f"torch {torch.__version__} threads={torch.get_num_threads()} | speculators {md.version('speculators')} "
        f"| transformers {md.version('transformers')}"
    )
    print(
        f"config: H={c.hidden} heads={c.heads} inter={c.inter} T={c.seq} V={c.vocab} Vd={c.draft_vocab} "
        f"TTT={c.ttt} rounds={c.rounds} (+{c.warmup} warmup), batch = 1 sequence, fp32, CPU"
    )
    for k, (_, n) in sides.items():
        print(f"  {k:20s} trainable params {n:,}")
    times, last = {k: [] for k in sides}, {}
    for r in range(c.warmup + c.rounds):
        for k, (step, _) in sides.items():
            t0 = time.perf_counter()
            loss = step()
            dt = time.perf_counter() - t0
            assert loss == loss, f'{k}: nan loss'
            if r >= c.warmup:
                times[k].append(dt)
            last[k] = dt
        print(
            f"  round {r}{' (warmup)' if r < c.warmup else ''}: "
            + ', '.join(f"{k} {dt:.3f}s" for k, dt in last.items()),
            flush=True,
        )
    med = {k: statistics.median(v) for k, v in times.items()}
    tps = {k: c.seq / v for k, v in med.items()}
    print(f"{'side':20s} {'median step s':>14s} {'tokens/s':>10s}")
    for k in sides:
        print(f"{k:20s} {med[k]:14.3f} {tps[k]:10.1f}")
    r1, r2 = tps['eagle3nb'] / tps['speculators'], tps['eagle3nb'] / tps['speculators+lm_head']
    print(f"ratio eagle3nb/speculators (its default: lm_head frozen)      = {r1:.2f}x")
    print(f"ratio eagle3nb/speculators+lm_head (lm_head trained, like eagle3nb) = {r2:.2f}x")
    if c.sdpa:
        print(
            f"ratio eagle3nb/speculators(sdpa) (lm_head frozen, attention 'sdpa') = {tps['eagle3nb'] / tps['speculators(sdpa)']:.2f}x"
        )
    if c.json:
        with open(c.json, 'w') as f:
            json.dump(dict(config=vars(c), median_s=med, tokens_per_s=tps, ratio=r1, ratio_lm_head=r2), f, indent=1)


if __name__ == '__main__':
    main()
