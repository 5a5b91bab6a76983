"Draft model and TTT training: reference forward, masks, loss rule, kill/resume, toy end to end."

import math, os, signal, subprocess, sys, tempfile, textwrap, time
from pathlib import Path
import pytest
import torch
import torch.nn.functional as F
from eagle3nb.draft import DraftConfig, Eagle3Draft, set_vocab, new_draft
from eagle3nb.train import (
    TTT,
    TrainConfig,
    ttt_mask,
    ttt_loss,
    collate,
    evaluate,
    train,
    read_metrics,
    toy_samples,
    target_dist,
    latest_checkpoint,
    accept_estimate,
    summarize,
)
from eagle3nb.vocab import top_k_ids, vocab_maps

torch.set_num_threads(1)


def tiny(V=20, Vd=6, H=8, nh=2, nkv=1, seed=0):
    torch.manual_seed(seed)
    c = DraftConfig(
        hidden_size=H,
        target_hidden_size=H,
        num_attention_heads=nh,
        num_key_value_heads=nkv,
        head_dim=H // nh,
        intermediate_size=12,
        vocab_size=V,
        draft_vocab_size=Vd,
        rope_theta=500.0,
    )
    m = Eagle3Draft(c, torch.randn(V, H))
    ids = torch.arange(0, 2 * Vd, 2)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    set_vocab(m, ids - torch.arange(Vd), t2d)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.5)
    return m


def ref_forward(sd, embed, aux, nxt, c, keys_of=None):
    """Row-by-row EAGLE-3 draft forward for one sequence, from the raw state dict.
    `keys_of(t)` lists the key rows query t may see (default: causal)."""
    T, H, nh, nkv, hd = aux.shape[0], c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    rms = lambda x, w: w * x / torch.sqrt((x**2).mean(-1, keepdim=True) + c.rms_norm_eps)
    W = lambda n: sd[f'midlayer.{n}.weight']
    h = torch.stack([sd['fc.weight'] @ aux[t] for t in range(T)])
    x = torch.cat([rms(embed[nxt], W('input_layernorm')), rms(h, W('hidden_norm'))], -1)

    def rot(v, pos):  # rotate pairs (j, j + hd/2) by pos * theta^(-2j/hd)
        out = v.clone()
        for j in range(hd // 2):
            a = pos * c.rope_theta ** (-2 * j / hd)
            out[j] = v[j] * math.cos(a) - v[j + hd // 2] * math.sin(a)
            out[j + hd // 2] = v[j + hd // 2] * math.cos(a) + v[j] * math.sin(a)
        return out

    q = [(W('self_attn.q_proj') @ x[t]).view(nh, hd) for t in range(T)]
    k = [(W('self_attn.k_proj') @ x[t]).view(nkv, hd) for t in range(T)]
    v = [(W('self_attn.v_proj') @ x[t]).view(nkv, hd) for t in range(T)]
    outs = []
    for t in range(T):
        ks = keys_of(t) if keys_of else range(t + 1)
        heads = []
        for n in range(nh):
            g = n // (nh // nkv)
            qn = rot(q[t][n], t)
            sc = torch.stack([qn @ rot(k[s][g], s) / math.sqrt(hd) for s in ks])
            heads.append(sum(w * v[s][g] for w, s in zip(sc.softmax(0), ks)))
        outs.append(W('self_attn.o_proj') @ torch.cat(heads))
    h = h + torch.stack(outs)
    u = rms(h, W('post_attention_layernorm'))
    h = h + (F.silu(u @ W('mlp.gate_proj').T) * (u @ W('mlp.up_proj').T)) @ W('mlp.down_proj').T
    return rms(h, sd['norm.weight']) @ sd['lm_head.weight'].T, h


def test_forward_matches_reference():
    m = tiny()
    aux, nxt = torch.randn(2, 6, 24), torch.randint(0, 20, (2, 6))
    with torch.no_grad():
        got, h = m(aux, nxt)
    for b in range(2):
        ref, rh = ref_forward(m.state_dict(), m.embed, aux[b], nxt[b], m.config)
        torch.testing.assert_close(got[b], ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(h[b], rh, atol=1e-4, rtol=1e-4)


def test_weight_names_are_the_engines():
    names = set(tiny().state_dict())
    want = {'fc.weight', 'norm.weight', 'lm_head.weight', 'd2t', 't2d'} | {
        f'midlayer.{n}.weight'
        for n in (
            'self_attn.q_proj',
            'self_attn.k_proj',
            'self_attn.v_proj',
            'self_attn.o_proj',
            'mlp.gate_proj',
            'mlp.up_proj',
            'mlp.down_proj',
            'input_layernorm',
            'hidden_norm',
            'post_attention_layernorm',
        )
    }
    assert names == want


def test_ttt_mask_hand_case():
    v = torch.tensor([[1, 1, 1, 1, 0]]).bool()  # one padded key
    m = ttt_mask(v, 1, 'eagle3')[0, 0].int()
    want0 = torch.tensor([[0, 0, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])
    assert torch.equal(m, torch.cat([want0, torch.eye(5, dtype=torch.int)], 1))
    m3 = ttt_mask(v[:, :4], 3, 'eagle3')[0, 0].int()
    assert m3.shape == (4, 16) and m3[:, :4].sum() == 1 and m3[3, 0] == 1  # only row 3 sees step-0 key 0


def test_ttt_step_matches_reference_chain():
    "Step 1 of the unroll (training mask) equals the longhand layer applied to step 0's output"
    m = tiny(seed=1)
    T = 5
    aux, ids = torch.randn(1, T, 24), torch.randint(0, 20, (1, T))
    b = dict(ids=ids, valid=torch.ones(1, T, dtype=torch.bool), aux=aux)
    with torch.no_grad():
        z0, z1 = TTT(m, 2, 'eagle3')(b)
    sd, c = m.state_dict(), m.config
    nxt0 = torch.cat([ids[0, 1:], torch.zeros(1, dtype=torch.long)])
    r0, h0 = ref_forward(sd, m.embed, aux[0], nxt0, c)
    torch.testing.assert_close(z0[0], r0, atol=1e-4, rtol=1e-4)
    # step 1 by hand: row t sees step-0 rows s <= t-1 and its own step-1 row; positions shift by one
    rms = lambda x, w: w * x / torch.sqrt((x**2).mean(-1, keepdim=True) + c.rms_norm_eps)
    W = lambda n: sd[f'midlayer.{n}.weight']
    nxt1 = torch.cat([ids[0, 2:], torch.zeros(2, dtype=torch.long)])
    hd, nh = c.head_dim, c.num_attention_heads

    def proj(emb_ids, h):
        x = torch.cat([rms(m.embed[emb_ids], W('input_layernorm')), rms(h, W('hidden_norm'))], -1)
        return x @ W('self_attn.q_proj').T, x @ W('self_attn.k_proj').T, x @ W('self_attn.v_proj').T

    def rot(v, pos):
        z = torch.complex(v[..., : hd // 2], v[..., hd // 2 :]) * torch.polar(
            torch.ones(hd // 2), pos * c.rope_theta ** (-2 * torch.arange(hd // 2) / hd)
        )
        return torch.cat([z.real, z.imag], -1)

    h0in = aux[0] @ sd['fc.weight'].T
    _, k0, v0 = proj(nxt0, h0in)
    q1, k1, v1 = proj(nxt1, h0)
    for t in range(T):
        keys = [(rot(k0[s], s), v0[s]) for s in range(t)] + [(rot(k1[t], t + 1), v1[t])]  # single kv head
        heads = []
        for n in range(nh):
            qn = rot(q1[t, n * hd : (n + 1) * hd], t + 1)
            w = torch.stack([qn @ kk / math.sqrt(hd) for kk, _ in keys]).softmax(0)
            heads.append(sum(wi * vv for wi, (_, vv) in zip(w, keys)))
        h = h0[t] + W('self_attn.o_proj') @ torch.cat(heads)
        u = rms(h, W('post_attention_layernorm'))
        h = h + W('mlp.down_proj') @ (F.silu(W('mlp.gate_proj') @ u) * (W('mlp.up_proj') @ u))
        torch.testing.assert_close(z1[0, t], sd['lm_head.weight'] @ rms(h, sd['norm.weight']), atol=1e-4, rtol=1e-4)


def test_out_of_vocab_rule():
    tids, t2d = torch.tensor([0, 2]), torch.tensor([1, 0, 1, 0]).bool()
    z = torch.tensor([[0.0, 0, 5, 0], [0, 9, 0, 0], [3, 0, 0, 0], [0, 0, 0, 0]])
    p, ok = target_dist(dict(target_logits=z), tids, t2d)
    assert ok.tolist() == [True, False, True, True]
    b = dict(
        p=p[None], ok=ok[None], loss_mask=torch.ones(1, 4, dtype=torch.bool), valid=torch.ones(1, 4, dtype=torch.bool)
    )
    logits = torch.tensor([[[0.0, 9], [9, 0], [0, 0], [0, 0]]])  # row 0 -> p[1] (out of vocab), row 1 -> p[2]
    tot, s = ttt_loss([logits], b)
    assert (s['n_0'], s['n_ce_0'], s['hit_0']) == (2, 1, 1)  # the out-of-vocab row: no loss, counted as a miss
    torch.testing.assert_close(tot, -(p[2] * logits[0, 1].log_softmax(-1)).sum())


def test_accept_estimate():
    assert accept_estimate([0.5, 0.5, 0.5]) == 1 + 0.5 + 0.25 + 0.125


@pytest.fixture(scope='module')
def toy():
    ts = toy_samples(n=8, new_tokens=48, eval_n=4)
    ts['maps'] = vocab_maps(top_k_ids(ts['counts'], 1024), ts['V'])
    return ts


def test_final_equals_logits(toy):
    s = toy['train'][0]
    d2t, t2d = toy['maps']
    tids = torch.arange(len(d2t)) + d2t
    from transformers import AutoModelForCausalLM
    from eagle3nb.toy import ensure_toy

    tgt = AutoModelForCausalLM.from_pretrained(ensure_toy('kimi-tiny')).eval()
    with torch.no_grad():
        final = tgt.model(s['input_ids'][None]).last_hidden_state[0]  # after the final norm
    pa, oka = target_dist(s, tids, t2d)
    pb, okb = target_dist(dict(final=final), tids, t2d, lm_head=toy['lm_head'])
    # batched (toy_samples) vs one-sequence fp32 forwards differ by ~1e-4 through kimi-tiny's 512-wide MLA latent
    torch.testing.assert_close(pa, pb, atol=1e-3, rtol=1e-3)
    assert torch.equal(oka, okb)


CHILD = textwrap.dedent('''
    import sys, torch
    torch.set_num_threads(1)
    from eagle3nb.train import toy_samples, train, TrainConfig
    from eagle3nb.draft import new_draft
    from eagle3nb.vocab import top_k_ids, vocab_maps
    import time
    ts = toy_samples(n=8, new_tokens=8)
    d2t, t2d = vocab_maps(top_k_ids(ts['counts'] + 1, 256), ts['V'])
    class Slow(list):
        def __getitem__(self, i): time.sleep(0.05); return list.__getitem__(self, i)
    cfg = TrainConfig(ttt_steps=3, lr=1e-3, warmup_steps=3, max_steps=60, batch_size=2, ckpt_every=3, log_every=1)
    train(new_draft(ts['config'], ts['embed'], d2t, t2d, seed=3), Slow(ts['train']), sys.argv[1], cfg)
''')


def test_killed_run_resumes_bit_for_bit(tmp_path):
    killed, whole = tmp_path / 'killed', tmp_path / 'whole'
    env = dict(os.environ, OMP_NUM_THREADS='1')
    p = subprocess.Popen([sys.executable, '-c', CHILD, str(killed)], env=env)
    t0 = time.time()
    while latest_checkpoint(killed) is None or int(latest_checkpoint(killed).name.split('_')[1]) < 6:
        assert p.poll() is None and time.time() - t0 < 120, 'child ended before it could be killed'
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    got_to = int(latest_checkpoint(killed).name.split('_')[1])
    assert got_to < 60
    ts = toy_samples(n=8, new_tokens=8)
    d2t, t2d = vocab_maps(top_k_ids(ts['counts'] + 1, 256), ts['V'])
    cfg = TrainConfig(ttt_steps=3, lr=1e-3, warmup_steps=3, max_steps=60, batch_size=2, ckpt_every=3, log_every=1)
    mk = lambda: new_draft(ts['config'], ts['embed'], d2t, t2d, seed=3)
    A = train(mk(), ts['train'], whole, cfg)
    B = train(mk(), ts['train'], killed, cfg, log=lambda *_: None)  # resumes from step `got_to`
    for k, v in A.state_dict().items():
        assert torch.equal(v, B.state_dict()[k]), k
    strip = lambda ms: [{k: v for k, v in m.items() if k not in ('s', 'tokens')} for m in ms]  # since the process began
    assert strip(read_metrics(whole)) == strip(read_metrics(killed))


def test_toy_end_to_end(toy):
    "Loss falls and accept length rises above 1 on the toy target's own generations"
    d2t, t2d = toy['maps']
    dr = new_draft(toy['config'], toy['embed'], d2t, t2d, seed=0)
    before = evaluate(dr, toy['train'], 7)['all']
    cfg = TrainConfig(
        lr=3e-3, warmup_steps=10, max_steps=100, batch_size=4, ckpt_every=10**6, eval_every=10**6, log_every=50
    )  # 100 steps: accept sim 1.0 -> 1.32 (head size 128 costs ~3x the old 16)
    with tempfile.TemporaryDirectory() as d:
        t0 = time.time()
        train(dr, toy['train'], d, cfg, log=lambda *_: None)
        secs = time.time() - t0
    after, held_out = evaluate(dr, toy['train'], 7)['all'], evaluate(dr, toy['eval'], 7)['all']
    print(
        f"\ntoy: {secs:.1f}s; step-0 loss {before['loss_0']:.3f} -> {after['loss_0']:.3f}; accept est "
        f"{before['accept_est']:.3f} -> {after['accept_est']:.3f}, sim {before['accept_sim']:.3f} -> {after['accept_sim']:.3f} "
        f"(train generations); eval split est {held_out['accept_est']:.3f} sim {held_out['accept_sim']:.3f}"
    )
    assert after['loss_0'] < before['loss_0']
    assert after['accept_sim'] > 1 and after['accept_est'] > 1


def test_store_samples_train(toy, tmp_path):
    "bf16 store samples (final + lm_head) feed `train` directly"
    from eagle3nb.store import ShardWriter, HiddenStates, shard_meta
    from transformers import AutoModelForCausalLM
    from eagle3nb.toy import ensure_toy

    tgt = AutoModelForCausalLM.from_pretrained(ensure_toy('kimi-tiny')).eval()
    w = ShardWriter(tmp_path / 'store', shard_meta('bf16', [2, 4, 5], 64, 'kimi-tiny'))
    for i, s in enumerate(toy['train'][:4]):
        with torch.no_grad():
            final = tgt.model(s['input_ids'][None]).last_hidden_state[0]
        w.add(
            f's{i}',
            dict(input_ids=s['input_ids'], loss_mask=s['loss_mask'], aux=s['aux'].bfloat16(), final=final.bfloat16()),
        )
    w.flush()
    d2t, t2d = toy['maps']
    cfg = TrainConfig(ttt_steps=2, max_steps=2, batch_size=2, log_every=1, ckpt_every=2)
    train(
        new_draft(toy['config'], toy['embed'], d2t, t2d),
        HiddenStates(tmp_path / 'store'),
        tmp_path / 'run',
        cfg,
        lm_head=toy['lm_head'],
        log=lambda *_: None,
    )
    assert [m['step'] for m in read_metrics(tmp_path / 'run')] == [1, 2]


def test_compact_store_samples_train(toy, tmp_path):
    "compact store samples (fp8 aux, top-k draft-vocab probabilities) feed `train` directly"
    from eagle3nb.store import ShardWriter, HiddenStates, shard_meta, quantize_fp8

    d2t, t2d = toy['maps']
    tids = torch.arange(len(d2t)) + d2t
    w = ShardWriter(
        tmp_path / 'store', shard_meta('compact', [2, 4, 5], 64, 'kimi-tiny', topk=16, draft_vocab_size=len(d2t))
    )
    for i, s in enumerate(toy['train'][:4]):
        T = len(s['input_ids'])
        q, sc = quantize_fp8(s['aux'].view(T, 3, -1))
        tk = s['target_logits'][:, tids].float().softmax(-1).topk(16, -1)
        w.add(
            f's{i}',
            dict(
                input_ids=s['input_ids'],
                loss_mask=s['loss_mask'],
                aux=q.view(T, -1),
                aux_scale=sc,
                topk_p=tk.values.half(),
                topk_idx=tk.indices.to(torch.int16),
            ),
        )
    w.flush()
    hs = HiddenStates(tmp_path / 'store')
    p, ok = target_dist(hs[0], tids, t2d)
    ref, _ = target_dist(toy['train'][0], tids, t2d)
    assert ok.all() and torch.equal(p.argmax(-1), ref.argmax(-1))  # top-k keeps the argmax
    cfg = TrainConfig(ttt_steps=2, max_steps=2, batch_size=2, log_every=1, ckpt_every=2)
    train(new_draft(toy['config'], toy['embed'], d2t, t2d), hs, tmp_path / 'run', cfg, log=lambda *_: None)
    assert [m['step'] for m in read_metrics(tmp_path / 'run')] == [1, 2]


FSDP_CHILD = textwrap.dedent('''
    import sys, torch
    from eagle3nb.draft import new_draft
    from eagle3nb.train import TrainConfig, train, toy_samples, Stopped
    from eagle3nb.vocab import top_k_ids, vocab_maps
    torch.set_num_threads(1)
    ts = toy_samples(n=4, new_tokens=8, eval_n=1)
    d2t, t2d = vocab_maps(top_k_ids(ts['counts'] + 1, 256), ts['V'])
    bs = int(sys.argv[2])
    cfg = TrainConfig(
        ttt_steps=3, lr=1e-3, warmup_steps=2, max_steps=4, batch_size=bs, ckpt_every=2, eval_every=2, log_every=1
    )
    stop = int(sys.argv[4]) if len(sys.argv) > 4 else None  # a simulated kill after that step
    draft = new_draft(ts['config'], ts['embed'], d2t, t2d, seed=3)
    kw = dict(eval_samples=ts['eval'], fsdp=sys.argv[3] == 'fsdp', stop_after=stop, log=lambda *_: None)
    try:
        train(draft, ts['train'], sys.argv[1], cfg, **kw)
    except Stopped:
        sys.exit(3)
''')


def _fsdp_cpu_reason():
    try:
        from torch.distributed.fsdp import fully_shard  # FSDP2
        import torch.distributed as dist

        return None if dist.is_available() and dist.is_gloo_available() else 'torch.distributed without gloo'
    except ImportError as e:
        return f'no FSDP2 in torch {torch.__version__}: {e}'


@pytest.mark.skipif(_fsdp_cpu_reason() is not None, reason=str(_fsdp_cpu_reason()))
def test_fsdp_two_cpu_ranks_match_one_process(tmp_path):
    "FSDP2 over 2 gloo ranks (batch 1 each) trains the same weights as one process with batch 2, and writes eval/checkpoints"
    from safetensors.torch import load_file

    env = dict(os.environ, OMP_NUM_THREADS='1')
    script = tmp_path / 'child.py'
    script.write_text(FSDP_CHILD)
    r = subprocess.run(
        [
            sys.executable,
            '-m',
            'torch.distributed.run',
            '--standalone',
            '--nproc_per_node',
            '2',
            str(script),
            str(tmp_path / 'fsdp'),
            '1',
            'fsdp',
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    subprocess.run([sys.executable, str(script), str(tmp_path / 'one'), '2', 'plain'], env=env, check=True, timeout=300)
    A, B = (load_file(str(latest_checkpoint(tmp_path / d) / 'model.safetensors')) for d in ('fsdp', 'one'))
    assert latest_checkpoint(tmp_path / 'fsdp').name == 'step_4' and A.keys() == B.keys()
    for k in A:
        torch.testing.assert_close(A[k], B[k], rtol=1e-4, atol=1e-5, msg=k)
    fm, om = read_metrics(tmp_path / 'fsdp'), read_metrics(tmp_path / 'one')
    assert [m['step'] for m in fm if m['split'] == 'eval'] == [2, 4]
    assert len(fm) == len(om)
    for a, b in zip(fm, om):  # `loss` of a train line is rank 0's share; the per-step sums are over the global batch
        assert (a['split'], a['step']) == (b['split'], b['step'])
        for k in ('loss_0', 'acc_0') + (('accept_est', 'accept_sim') if a['split'] == 'eval' else ()):
            assert math.isclose(a[k], b[k], rel_tol=1e-4, abs_tol=1e-6), (a['split'], a['step'], k)


@pytest.mark.skipif(_fsdp_cpu_reason() is not None, reason=str(_fsdp_cpu_reason()))
def test_fsdp_resume_after_kill(tmp_path):
    "An FSDP run stopped after step 2 and rerun ends with the weights and metrics of an unbroken FSDP run; other modes refuse its checkpoint"
    from safetensors.torch import load_file

    env = dict(os.environ, OMP_NUM_THREADS='1')
    script = tmp_path / 'child.py'
    script.write_text(FSDP_CHILD)
    fsdp = lambda out, *extra: subprocess.run(
        [
            sys.executable,
            '-m',
            'torch.distributed.run',
            '--standalone',
            '--nproc_per_node',
            '2',
            str(script),
            str(tmp_path / out),
            '1',
            'fsdp',
            *extra,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    r = fsdp('whole')
    assert r.returncode == 0, r.stderr[-3000:]
    r = fsdp('killed', '2')
    assert r.returncode != 0 and latest_checkpoint(tmp_path / 'killed').name == 'step_2'
    r = fsdp('killed')
    assert r.returncode == 0, r.stderr[-3000:]
    A, B = (load_file(str(latest_checkpoint(tmp_path / d) / 'model.safetensors')) for d in ('killed', 'whole'))
    assert latest_checkpoint(tmp_path / 'killed').name == 'step_4' and A.keys() == B.keys()
    for k in A:
        torch.testing.assert_close(A[k], B[k], rtol=0, atol=0, msg=k)
    strip = lambda ms: [{k: v for k, v in m.items() if k not in ('s', 'tokens')} for m in ms]  # since the process began
    assert strip(read_metrics(tmp_path / 'killed')) == strip(read_metrics(tmp_path / 'whole'))
    p = subprocess.run(
        [sys.executable, str(script), str(tmp_path / 'killed'), '2', 'plain'],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode != 0 and 'was written by an FSDP run' in p.stderr


PHASE_CHILD = textwrap.dedent('''
    import sys, torch
    from eagle3nb.phase import RunContext
    from eagle3nb.phases import train

    torch.set_num_threads(1)
    ctx = RunContext.open('', sys.argv[1])
    p = dict(max_steps=4, warmup_steps=2, batch_size=int(sys.argv[2]), ckpt_every=2, eval_every=2, ttt_steps=3)
    rec = train.run(ctx, p)
    print(f'rank {ctx.rank} of {ctx.world}: {rec.headline()}')
''')


ELASTIC_CHILD = textwrap.dedent('''
    import sys, torch
    from eagle3nb.draft import new_draft
    from eagle3nb.train import TrainConfig, train, toy_samples, Stopped
    from eagle3nb.vocab import top_k_ids, vocab_maps
    torch.set_num_threads(1)
    ts = toy_samples(n=7, new_tokens=8)
    d2t, t2d = vocab_maps(top_k_ids(ts['counts'] + 1, 256), ts['V'])
    cfg = TrainConfig(ttt_steps=2, lr=1e-3, warmup_steps=2, max_steps=8, batch_size=1, ckpt_every=1, log_every=1)
    stop = int(sys.argv[2]) if len(sys.argv) > 2 else None  # a simulated kill after that step
    draft = new_draft(ts['config'], ts['embed'], d2t, t2d, seed=3)
    try:
        train(draft, ts['train'], sys.argv[1], cfg, stop_after=stop, log=print)
    except Stopped:
        sys.exit(3)
''')


@pytest.mark.skipif(_fsdp_cpu_reason() is not None, reason=str(_fsdp_cpu_reason()))
@pytest.mark.parametrize('first,then', [(2, 1), (1, 2)])
def test_elastic_resume(tmp_path, first, then):
    "A run stopped after step 1 on `first` ranks resumes on `then`: each sample once per epoch, the optimizer carried"
    env = dict(os.environ, OMP_NUM_THREADS='1')
    script = tmp_path / 'child.py'
    script.write_text(ELASTIC_CHILD)
    out = tmp_path / 'run'

    def on(ranks, *args):
        launch = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node', str(ranks)]
        cmd = (launch if ranks > 1 else [sys.executable]) + [str(script), str(out), *args]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)

    r = on(first, '1')
    assert r.returncode != 0 and latest_checkpoint(out).name == 'step_1', r.stderr[-3000:]  # torchrun: 1, else 3
    r = on(then)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f'(written on {first} ranks, now {then})' in r.stdout
    reads = [m['read'] for m in read_metrics(out) if m['split'] == 'train']
    assert len(reads) == 8
    for e in sorted({x[0] for x in reads}):  # the positions of each epoch's order: read once each, in order, from 0
        spans = [(a, b) for ep, a, b in reads if ep == e]
        assert spans[0][0] == 0 and all(p[1] == q[0] for p, q in zip(spans, spans[1:])), (e, spans)
    assert [x[2] for x in reads if x[0] == 0][-1] == 7  # epoch 0: all 7 samples, across the change of world
    st = torch.load(latest_checkpoint(out) / 'train_state.pt', weights_only=False)
    assert latest_checkpoint(out).name == 'step_8' and st['world'] == then
    assert {int(v['step']) for v in st['optimizer']['state'].values()} == {
        8
    }  # AdamW's moments lived through the resume


@pytest.mark.skipif(_fsdp_cpu_reason() is not None, reason=str(_fsdp_cpu_reason()))
def test_train_phase_under_torchrun(tmp_path):
    "The train phase under torchrun (2 gloo ranks, DDP, batch 1 each) trains what one process with batch 2 trains"
    import json
    from safetensors.torch import load_file
    from eagle3nb.phases.train import run as train_phase

    env = dict(os.environ, OMP_NUM_THREADS='1')
    script = tmp_path / 'child.py'
    script.write_text(PHASE_CHILD)
    torchrun = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node', '2']
    r = subprocess.run(
        [*torchrun, str(script), str(tmp_path / 'ddp'), '1'], env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert 'rank 0 of 2: eval accept length' in r.stdout and 'rank 1 of 2: eval accept length' in r.stdout
    subprocess.run([sys.executable, str(script), str(tmp_path / 'one'), '2'], env=env, check=True, timeout=600)
    A, B = (load_file(str(tmp_path / d / 'checkpoints' / 'step_4' / 'model.safetensors')) for d in ('ddp', 'one'))
    assert A.keys() == B.keys()
    for k in A:
        torch.testing.assert_close(A[k], B[k], rtol=1e-4, atol=1e-5, msg=k)
    ddp, one = train_phase.read(tmp_path / 'ddp'), train_phase.read(tmp_path / 'one')
    assert (ddp.ranks, one.ranks, ddp.steps, ddp.checkpoint) == (
        2,
        1,
        4,
        str(tmp_path / 'ddp' / 'checkpoints' / 'step_4'),
    )
    assert json.loads((tmp_path / 'ddp' / 'accept.json').read_text()) == ddp.accept
    assert list(ddp.accept) == list(one.accept) == ['eval all (init)', 'eval all', 'train all']
    for row in ddp.accept:
        for c, v in ddp.accept[row].items():
            assert math.isclose(v, one.accept[row][c], rel_tol=1e-3, abs_tol=2e-3), (row, c)
    evals = [m['step'] for m in read_metrics(tmp_path / 'ddp') if m['split'] == 'eval']
    assert evals == [2, 4]  # rank 0 alone writes the metrics log
