"Export of a training checkpoint to an engine-loadable EAGLE-3 draft folder"

import json
import pytest, torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig
from eagle3nb.draft import new_draft
from eagle3nb.recipe import default_aux_layers
from eagle3nb.train import save_checkpoint, TrainConfig
from eagle3nb.export import export_draft, check_export, random_checkpoint, ExportError


@pytest.fixture
def ckpt(kimi_tiny, tmp_path):
    tc = AutoConfig.from_pretrained(str(kimi_tiny))
    tt = tc.get_text_config()
    V, H, Vd = tt.vocab_size, tt.hidden_size, 16
    tids = torch.arange(Vd) * 5 + 2
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[tids] = True
    dr = new_draft(tc, torch.zeros(V, H), tids - torch.arange(Vd), t2d, seed=1)
    opt = torch.optim.AdamW(dr.parameters())
    sch = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return save_checkpoint(tmp_path / 'run', 3, dr, opt, sch, TrainConfig()), tt, dr


def test_export_roundtrip(ckpt, kimi_tiny, tmp_path):
    ck, tt, dr = ckpt
    cfg = export_draft(ck, tmp_path / 'out', kimi_tiny, aux_layers=[1, 2, 3])
    assert check_export(tmp_path / 'out') == []
    c = json.loads((tmp_path / 'out' / 'config.json').read_text())
    assert c == cfg and c['architectures'] == ['LlamaForCausalLMEagle3'] and c['model_type'] == 'llama'
    assert (
        c['num_hidden_layers'],
        c['tie_word_embeddings'],
        c['vocab_size'],
        c['draft_vocab_size'],
        c['target_hidden_size'],
    ) == (1, False, tt.vocab_size, 16, tt.hidden_size)
    assert c['eagle_aux_hidden_state_layer_ids'] == [1, 2, 3] and c['eagle_config'][
        'eagle_aux_hidden_state_layer_ids'
    ] == [0, 1, 2]
    w = load_file(str(tmp_path / 'out' / 'model.safetensors'))
    assert not any('embed' in k for k in w) and w['fc.weight'].dtype == torch.bfloat16
    assert w['d2t'].dtype == torch.int64 and w['t2d'].dtype == torch.bool and torch.equal(w['t2d'], dr.t2d)
    assert torch.allclose(w['lm_head.weight'].float(), dr.lm_head.weight.detach(), atol=1e-2, rtol=1e-2)
    assert not list(tmp_path.glob('.out.tmp'))


def test_default_aux_layers(ckpt, kimi_tiny, tmp_path):
    ck, tt, _ = ckpt
    cfg = export_draft(ck, tmp_path / 'out', kimi_tiny)
    assert cfg['eagle_aux_hidden_state_layer_ids'] == default_aux_layers(tt.num_hidden_layers)


def test_refuses_bad_checkpoints(ckpt, kimi_tiny, tmp_path):
    ck, _, _ = ckpt
    f = ck / 'model.safetensors'
    with safe_open(str(f), 'pt') as s:
        meta = s.metadata()
    sd = load_file(str(f))
    save_file({k: v for k, v in sd.items() if k != 'lm_head.weight'}, str(f), metadata=meta)
    with pytest.raises(ExportError, match='lm_head'):
        export_draft(ck, tmp_path / 'a', kimi_tiny)
    save_file({**sd, 'fc.weight': sd['fc.weight'][:, :-1].contiguous()}, str(f), metadata=meta)
    with pytest.raises(ExportError, match='3 x'):
        export_draft(ck, tmp_path / 'b', kimi_tiny)
    assert not (tmp_path / 'a').exists() and not (tmp_path / 'b').exists()


def test_check_export_flags_bad_maps(ckpt, kimi_tiny, tmp_path):
    ck, _, _ = ckpt
    export_draft(ck, tmp_path / 'out', kimi_tiny)
    f = tmp_path / 'out' / 'model.safetensors'
    w = load_file(str(f))
    w['d2t'] = w['d2t'] + 1
    save_file(w, str(f))
    assert check_export(tmp_path / 'out') == ["d2t does not map the draft vocab onto the ids t2d marks"]
    w['d2t'] = w['d2t'].int()
    save_file(w, str(f))
    assert any('int64' in p for p in check_export(tmp_path / 'out'))


def _data_root(d, aux=None, template='t' * 64):
    "A data root with what the training record reads: a render manifest, vocab.json and (optionally) a hidden-state shard"
    (d / 'rendered' / 'ds').mkdir(parents=True)
    (d / 'vocab').mkdir()
    (d / 'rendered' / 'ds' / 'render.json').write_text(
        json.dumps(dict(params=dict(template_sha256=template, tokenizer_sha256='k')))
    )
    (d / 'vocab' / 'vocab.json').write_text(
        json.dumps(dict(draft_vocab=16, special_used={'<|im_end|>': dict(id=2, count=1, rank=0)}))
    )
    if aux:
        (d / 'hidden' / 'bf16' / 'train').mkdir(parents=True)
        save_file(
            {'x': torch.zeros(1)},
            str(d / 'hidden' / 'bf16' / 'train' / 'r000-000000.safetensors'),
            metadata=dict(layer_ids=json.dumps(aux), template_sha256=json.dumps(template)),
        )
    return d


def test_cli_export_writes_training_record(ckpt, kimi_tiny, tmp_path, capsys):
    from eagle3nb.cli import main

    ck, tt, _ = ckpt
    root = _data_root(tmp_path / 'data', aux=[1, 3, 5])
    main(['export', str(ck), '--out', str(tmp_path / 'out'), '--target', str(kimi_tiny), '--data', str(root)])
    assert json.loads(capsys.readouterr().out)['problems'] == []
    rec = json.loads((tmp_path / 'out' / 'eagle3nb.json').read_text())
    assert (
        rec['aux_layers'] == [1, 3, 5]
        and rec['template_sha256'] == ['t' * 64]
        and rec['special_tokens'] == {'<|im_end|>': 2}
    )
    c = json.loads((tmp_path / 'out' / 'config.json').read_text())  # the hidden states' layers win over the default
    assert c['eagle_aux_hidden_state_layer_ids'] == [1, 3, 5] and c['eagle_config'][
        'eagle_aux_hidden_state_layer_ids'
    ] == [0, 2, 4]


def test_export_refuses_aux_layers_other_than_extracted(ckpt, kimi_tiny, tmp_path, capsys):
    from eagle3nb.cli import main

    ck, _, _ = ckpt
    root = _data_root(tmp_path / 'data', aux=[1, 3, 5])
    with pytest.raises(SystemExit) as e:
        main(
            [
                'export',
                str(ck),
                '--out',
                str(tmp_path / 'out'),
                '--target',
                str(kimi_tiny),
                '--data',
                str(root),
                '--aux-layers',
                '2,3,5',
            ]
        )
    assert e.value.code == 1 and 'extracted at input-of-layer ids [1, 3, 5]' in capsys.readouterr().err
    assert not (tmp_path / 'out').exists()


def test_launch_commands_parse_back(tmp_path):
    import shlex
    from eagle3nb.export import launch_commands

    c = launch_commands(tmp_path / 'my draft', '/models/Kimi-K2.5', tp=8, num_steps=5, topk=4)
    a = shlex.split(c['sglang'])
    flag = lambda f: a[a.index(f) + 1]
    assert (flag('--speculative-algorithm'), flag('--speculative-draft-model-path'), flag('--tp')) == (
        'EAGLE3',
        str(tmp_path / 'my draft'),
        '8',
    )
    assert (
        flag('--speculative-num-steps'),
        flag('--speculative-eagle-topk'),
        flag('--speculative-num-draft-tokens'),
    ) == ('5', '4', '10')
    v = shlex.split(c['vllm'])
    assert v[:5] == ['python', '-m', 'vllm.entrypoints.openai.api_server', '--model', '/models/Kimi-K2.5']
    assert json.loads(v[v.index('--speculative-config') + 1]) == dict(
        method='eagle3', model=str(tmp_path / 'my draft'), num_speculative_tokens=5
    )


def test_cli_export_reads_target_and_data_from_the_run(ckpt, kimi_tiny, tmp_path, capsys):
    "A checkpoint inside papermill_runs/<run>/checkpoints/ needs no --target/--data: the run's frozen recipe has them"
    from eagle3nb.cli import main

    ck, _, _ = ckpt
    with pytest.raises(SystemExit) as e:
        main(['export', str(ck), '--out', str(tmp_path / 'out')])  # no recipe.yaml yet
    assert e.value.code == 1 and 'pass --target TARGET_DIR' in capsys.readouterr().err
    root = _data_root(tmp_path / 'data', aux=[1, 3, 5])
    (ck.parent.parent / 'recipe.yaml').write_text(
        json.dumps(dict(name='r', target=dict(model=str(kimi_tiny)), data_root=str(root)))
    )
    main(['export', str(ck), '--out', str(tmp_path / 'out')])
    assert json.loads(capsys.readouterr().out)['problems'] == []
    assert json.loads((tmp_path / 'out' / 'eagle3nb.json').read_text())['aux_layers'] == [1, 3, 5]


def test_cli_export_chooses_the_best_checkpoint(kimi_tiny, tmp_path, capsys):
    "`eagle3nb export RUN`: the step with the highest eval accept length, latest or step_N on request; the record says"
    from eagle3nb.cli import main

    ids = torch.arange(32) * 3 + 1
    run = tmp_path / 'run'
    for s in (100, 200, 300):
        random_checkpoint(kimi_tiny, run, ids, step=s)
    evals = [dict(split='eval', dataset='all', step=s, accept_sim=a) for s, a in ((100, 1.4), (200, 1.9), (300, 1.7))]
    (run / 'metrics.jsonl').write_text(''.join(json.dumps(m) + '\n' for m in evals))
    for rule, step in (('best', 200), ('latest', 300), ('step_100', 100)):
        main(['export', str(run), '--checkpoint', rule, '--out', str(tmp_path / rule), '--target', str(kimi_tiny)])
        out = json.loads(capsys.readouterr().out)
        assert (out['step'], out['rule'], out['problems']) == (step, rule, []), out
    main(['export', str(run), '--out', str(tmp_path / 'default'), '--target', str(kimi_tiny)])
    out = json.loads(capsys.readouterr().out)
    assert (
        out['step'] == 200
        and out['why'] == 'the highest eval accept length (step_100 1.400, step_200 1.900, step_300 1.700)'
    )
    with pytest.raises(SystemExit) as e:
        main(['export', str(run), '--checkpoint', 'step_150', '--out', str(tmp_path / 'x'), '--target', str(kimi_tiny)])
    assert (
        e.value.code == 1
        and 'has no checkpoint step_150; it has step_100, step_200, step_300' in capsys.readouterr().err
    )


def test_random_checkpoint_exports(kimi_tiny, tmp_path):
    "A smoke run's checkpoint: the draft vocab asked for, every weight moved by the noise, and it exports cleanly"
    ids = torch.arange(32) * 3 + 1
    ck = random_checkpoint(kimi_tiny, tmp_path / 'run', ids, step=4, noise=0.05)
    assert ck == tmp_path / 'run' / 'checkpoints' / 'step_4'
    export_draft(ck, tmp_path / 'out', kimi_tiny)
    assert check_export(tmp_path / 'out') == []
    w = load_file(str(tmp_path / 'out' / 'model.safetensors'))
    assert torch.equal(torch.arange(32) + w['d2t'], ids) and int(w['t2d'].sum()) == 32
    plain = random_checkpoint(kimi_tiny, tmp_path / 'plain', ids, step=4)  # the same init, no noise
    export_draft(plain, tmp_path / 'out_plain', kimi_tiny)
    w0 = load_file(str(tmp_path / 'out_plain' / 'model.safetensors'))
    assert torch.equal(w0['norm.weight'].float(), torch.ones_like(w0['norm.weight'].float()))  # RMSNorm init: ones
    assert all(not torch.equal(w[k], w0[k]) for k in w if w[k].is_floating_point())  # noise moved every weight
