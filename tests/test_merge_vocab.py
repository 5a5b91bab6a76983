"Merge and draft vocabulary: hand-computed cases (ties included), properties, and both phases on real rendered samples"

import json, os
from pathlib import Path
import numpy as np, pandas as pd, pytest, torch
from datasets import Dataset
from hypothesis import given, settings, strategies as st
from eagle3nb.merge import (
    merge_corpus,
    merge_recipe,
    merge_cli,
    smoke_recipe,
    load_corpus,
    read_corpus_manifest,
    corpus_features,
    sample_hash,
    mix_counts,
    record_merge,
    CORPUS_COLUMNS,
)
from eagle3nb.vocab import (
    count_tokens,
    ranking,
    top_k_ids,
    vocab_maps,
    check_maps,
    force_include,
    build_vocab,
    coverage,
    vocab_recipe,
    vocab_cli,
    vocab_summary,
    load_vocab,
)
from eagle3nb.catalog import query

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / 'tests' / 'fixtures' / 'datasets'


def rows(*rs):
    "Rendered-layout Dataset from (sample_id, dataset, input_ids, loss_mask[, prompt_only])"
    rs = [r + (False,) * (5 - len(r)) for r in rs]
    return Dataset.from_dict(
        dict(
            sample_id=[r[0] for r in rs],
            conversation_id=[r[0].rsplit('-', 1)[0] for r in rs],
            dataset=[r[1] for r in rs],
            input_ids=[r[2] for r in rs],
            loss_mask=[r[3] for r in rs],
            spans=[[] for _ in rs],
            prompt_only=[r[4] for r in rs],
        ),
        features=corpus_features(True),
    )


# ---------------------------------------------------------------- vocab: the hand-computed case


def test_vocab_hand_computed_with_ties():
    "Counts from a tiny corpus by hand; K cuts through a three-way tie, which goes to the lowest ids"
    # supervised tokens (mask 1) only: sample 1 -> 4 4 2 7; sample 2 -> 2 7 9 1; sample 3 -> 4 1 0 (its 9 9 are prompt)
    ds = Dataset.from_dict(
        dict(
            input_ids=[[9, 4, 4, 2, 7], [3, 2, 7, 9, 1], [9, 9, 4, 1, 0]],
            loss_mask=[[0, 1, 1, 1, 1], [0, 1, 1, 1, 1], [0, 0, 1, 1, 1]],
        )
    )
    counts = count_tokens(ds, n_target=12)
    #                         id: 0  1  2  3  4  5  6  7  8  9 10 11
    assert counts.tolist() == [1, 2, 2, 0, 3, 0, 0, 2, 0, 1, 0, 0]
    # rank: 4 (3); then 1, 2, 7 tied at 2 -> id order; then 0, 9 tied at 1; then the zeros by id
    assert ranking(counts).tolist() == [4, 1, 2, 7, 0, 9, 3, 5, 6, 8, 10, 11]
    assert top_k_ids(counts, 3).tolist() == [1, 2, 4]  # 7 loses the tie at count 2
    assert top_k_ids(counts, 5).tolist() == [0, 1, 2, 4, 7]  # 9 loses the tie at count 1
    assert top_k_ids(counts, 8).tolist() == [0, 1, 2, 3, 4, 5, 7, 9]  # unseen ids fill up in id order
    v = build_vocab(counts, k=5)
    assert v['d2t'].tolist() == [0, 0, 0, 1, 3] and v['d2t'].dtype == torch.int64  # target = i + d2t[i]: 0 1 2 4 7
    assert v['t2d'].nonzero().flatten().tolist() == [0, 1, 2, 4, 7] and v['t2d'].dtype == torch.bool
    assert v['t2d'].shape == (12,) and int(v['t2d'].sum()) == 5
    assert v['coverage'] == pytest.approx(10 / 11) and v['draft_vocab'] == 5 and v['target_vocab'] == 12
    assert build_vocab(counts, k=100)['draft_vocab'] == 12  # K capped at the target vocabulary


def test_vocab_forces_supervised_special_tokens():
    "A special token ranked outside K replaces the lowest-ranked choice; an unsupervised one is not forced"
    counts = torch.tensor([1, 2, 2, 0, 3, 0, 0, 2, 0, 1, 0, 0])
    v = build_vocab(counts, k=3, special={'</think>': 9, '<|im_end|>': 4, '<think>': 10})
    assert v['ids'].tolist() == [1, 4, 9] and v['forced'] == [9] and v['displaced'] == [2]
    assert v['special_outside_top_k'] == ['</think>'] and v['special_outside'] == []
    assert set(v['special_used']) == {'</think>', '<|im_end|>'}  # <think> never supervised
    assert v['special_used']['</think>'] == dict(id=9, count=1, rank=6)
    with pytest.raises(ValueError, match='K is only 1'):
        build_vocab(counts, k=1, special={'a': 9, 'b': 4})
    with pytest.raises(ValueError, match='no supervised tokens'):
        build_vocab(torch.zeros(4, dtype=torch.long), k=2)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=40), st.data())
def test_top_k_matches_brute_force(cs, data):
    "top_k_ids is the first k of sorted((-count, id)), and the maps round-trip"
    counts = torch.tensor(cs, dtype=torch.int64)
    k = data.draw(st.integers(1, len(cs)))
    want = sorted(i for _, i in sorted((-c, i) for i, c in enumerate(cs))[:k])
    ids = top_k_ids(counts, k)
    assert ids.tolist() == want
    d2t, t2d = vocab_maps(ids, len(cs))
    check_maps(d2t, t2d)
    assert (torch.arange(k) + d2t).tolist() == want and bool((d2t[1:] >= d2t[:-1]).all())
    assert float(coverage(counts)[k - 1]) == pytest.approx(sum(counts[want].tolist()) / max(1, sum(cs)))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=2, max_size=30), st.data())
def test_force_include_properties(cs, data):
    "Size stays k, every required id is in, and only the lowest-ranked non-required choices leave"
    counts = torch.tensor(cs)
    n = len(cs)
    k = data.draw(st.integers(1, n))
    req = data.draw(st.sets(st.integers(0, n - 1), max_size=k))
    order = ranking(counts)
    ids, forced, displaced = force_include(order, k, req)
    assert len(ids) == k and len(set(ids.tolist())) == k and set(req) <= set(ids.tolist())
    top = order[:k].tolist()
    assert set(ids.tolist()) == (set(top) - set(displaced)) | set(forced) and len(forced) == len(displaced)
    keep = [i for i in top if i not in displaced and i not in req]
    pos = {t: j for j, t in enumerate(top)}
    assert all(pos[d] > pos[x] for d in displaced for x in keep)


# ---------------------------------------------------------------- merge


def test_merge_dedup_fates_and_mix():
    "Exact duplicates across datasets keep the first; prompt-only, excluded and replaced rows get their reasons"
    a = rows(
        ('a0-e00', 'a', [1, 2, 3], [0, 1, 1]),
        ('a1-e00', 'a', [1, 2, 4], [0, 1, 1]),
        ('a2-e00', 'a', [5, 6], [0, 0], True),
        ('a3-e00', 'a', [8, 8], [1, 1]),
    )
    b = rows(
        ('b0-e00', 'b', [1, 2, 3], [0, 1, 1]),  # same stream and mask as a0
        ('b1-e00', 'b', [1, 2, 3], [1, 1, 1]),  # same stream, other supervision: kept
        ('a2-e00', 'a', [5, 6, 7], [0, 0, 1]),
    )  # a2's generated completion
    tr, ev, rep, fates = merge_corpus([a, b], eval_fraction=0.0, excluded={'a3-e00': 'too long'})
    assert sorted(tr['sample_id']) == ['a0-e00', 'a1-e00', 'a2-e00', 'b1-e00'] and len(ev) == 0
    assert tr.column_names == list(CORPUS_COLUMNS)
    assert tr['input_ids'][tr['sample_id'].index('a2-e00')] == [5, 6, 7]
    f = fates.set_index(['sample_id', 'state']).detail
    assert f['b0-e00', 'skipped'] == 'duplicate of a0-e00' and f['a3-e00', 'skipped'] == 'excluded partition: too long'
    assert f['a2-e00', 'skipped'] == 'prompt_only: not generated' and f['a2-e00', 'done'] == 'train'
    assert rep['duplicates'] == {'b <- a': 1} and rep['datasets']['b']['duplicates'] == 1
    assert rep['datasets']['a'] == dict(
        available=5,
        prompt_only=1,
        excluded=1,
        no_supervised=0,
        replaced=0,
        regenerated=0,
        duplicates=0,
        not_sampled=0,
        sampled=3,
        train=3,
        eval=0,
        train_tokens=9,
        train_supervised=5,
    )
    tr, _, rep, fates = merge_corpus([a, b], mix={'a': 1, 'b': 0.0}, eval_fraction=0.0, seed=3)
    assert len(tr) == 1 and rep['datasets']['a']['not_sampled'] == 3 and rep['datasets']['b']['not_sampled'] == 1
    assert (fates.detail == 'not sampled by mix').sum() == 4
    assert sample_hash([1, 2, 3], [0, 1, 1]) != sample_hash([1, 2, 3], [1, 1, 1])


def test_merge_split_is_seeded_and_keeps_conversations_whole():
    "Same seed, same corpus; eval holds whole conversations and about eval_fraction of the samples"
    d = rows(*[(f'c{i // 3}-e{i % 3:02d}', 'x', [i, i + 1], [0, 1]) for i in range(60)])
    tr, ev, rep, _ = merge_corpus([d], eval_fraction=0.1, seed=7)
    tr2, ev2, _, _ = merge_corpus([d], eval_fraction=0.1, seed=7)
    assert tr['sample_id'] == tr2['sample_id'] and ev['sample_id'] == ev2['sample_id']
    assert tr['sample_id'] != sorted(tr['sample_id'])  # shuffled
    assert len(ev) == 6 and len(tr) == 54
    conv = lambda ds: {s.rsplit('-', 1)[0] for s in ds['sample_id']}
    assert not conv(tr) & conv(ev)
    assert merge_corpus([d], eval_fraction=0.1, seed=8)[1]['sample_id'] != ev['sample_id']


@settings(max_examples=15, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 5),
            st.sampled_from('xy'),
            st.lists(st.integers(0, 3), min_size=1, max_size=3),
            st.booleans(),
            st.booleans(),
        ),
        max_size=25,
    ),
    st.floats(0, 0.5),
    st.integers(0, 3),
)
def test_merge_invariants(spec, frac, seed):
    "Every row gets one fate; the corpus has unique ids and streams; counts add up"
    rs = [(f'c{c}-e{i:02d}', ds, ids, [0] * (len(ids) - 1) + [1], po) for i, (c, ds, ids, po, _) in enumerate(spec)]
    tr, ev, rep, fates = merge_corpus(
        [rows(*rs)], mix={'x': 0.5} if any(r[1] == 'x' for r in rs) else {}, eval_fraction=frac, seed=seed
    )
    assert len(fates) == len(rs) and set(fates.state) <= {'done', 'skipped'} and fates.detail.notna().all()
    ids = list(tr['sample_id']) + list(ev['sample_id'])
    assert len(ids) == len(set(ids)) == (fates.state == 'done').sum() == rep['train'] + rep['eval']
    streams = [tuple(x) for x in list(tr['input_ids']) + list(ev['input_ids'])]
    assert len(streams) == len(
        set(streams)
    )  # every stream here is supervised on its last token only: one mask per stream
    assert sum(d['sampled'] for d in rep['datasets'].values()) == len(ids)
    for d in rep['datasets'].values():
        assert d['available'] == sum(
            d[k]
            for k in ('prompt_only', 'excluded', 'no_supervised', 'replaced', 'duplicates', 'not_sampled', 'sampled')
        )
    assert not {s.rsplit('-', 1)[0] for s in tr['sample_id']} & {s.rsplit('-', 1)[0] for s in ev['sample_id']}


def test_mix_errors_name_the_key():
    with pytest.raises(ValueError, match="names \\['nope'\\]"):
        mix_counts({'nope': 1}, {'a': 3})
    with pytest.raises(ValueError, match='mix.a = 2.0'):
        mix_counts({'a': 2.0}, {'a': 3})
    assert mix_counts({'a': 0.5, 'b': 5}, {'a': 4, 'b': 3, 'c': 1}) == {'a': 2, 'b': 3, 'c': 1}


# ---------------------------------------------------------------- both phases on rendered samples (kimi-tiny)


@pytest.fixture(scope='module')
def smoke(tmp_path_factory):
    "Shipped samples prepared, rendered, catalogued and partitioned for kimi-tiny"
    return smoke_recipe(tmp_path_factory.mktemp('smoke'), FIXTURES)


def test_merge_recipe_writes_corpus_and_catalog(smoke):
    r = smoke
    m = merge_recipe(r, eval_fraction=0.2, seed=1)
    corpus = Path(r.data_root) / 'corpus'
    assert read_corpus_manifest(corpus)['fingerprint'] == m['fingerprint']
    tr, ev = load_corpus(corpus), load_corpus(corpus, 'eval')
    assert (len(tr), len(ev)) == (m['train'], m['eval']) and m['eval'] >= 1 and tr.column_names == list(CORPUS_COLUMNS)
    ds = m['datasets']
    assert ds['alpaca_copy']['duplicates'] == ds['alpaca_copy']['available'] == 4 and m['duplicates'] == {
        'alpaca_copy <- alpaca': 4
    }
    assert ds['alpaca_prompts']['prompt_only'] == 4 and ds['alpaca_prompts']['sampled'] == 0
    excl = query(r.catalog, "select count(*) from samples where partition = 'excluded'").iloc[0, 0]
    assert sum(d['excluded'] for d in ds.values()) == excl > 0
    st = query(r.catalog, "select state, count(*) n from sample_state where phase = 'merge' group by 1 order by 1")
    assert dict(zip(st.state, st.n)) == {'done': m['train'] + m['eval'], 'skipped': m['rows'] - m['train'] - m['eval']}
    det = query(
        r.catalog,
        "select detail from sample_state s join samples using (sample_id) where phase = 'merge' and dataset = 'alpaca_prompts'",
    )
    assert set(det.detail) == {'prompt_only: not generated'}
    assert set(tr['sample_id']) == set(
        query(r.catalog, "select sample_id from sample_state where phase = 'merge' and detail = 'train'").sample_id
    )
    again = merge_recipe(r, eval_fraction=0.2, seed=1)  # same inputs and parameters: skipped
    assert again == read_corpus_manifest(corpus) and 'catalog' not in again
    assert merge_recipe(r, eval_fraction=0.2, seed=2)['fingerprint'] != m['fingerprint']


def test_vocab_recipe_and_cli(smoke, capsys):
    r = smoke
    merge_recipe(r, eval_fraction=0.2, seed=1)
    s = vocab_recipe(r, draft_vocab=16)
    d2t, t2d, saved = load_vocab(Path(r.data_root) / 'vocab')
    assert saved == s and len(d2t) == 16 and t2d.shape == (4096,) and int(t2d.sum()) == 16
    assert {'<|im_end|>', '<think>', '</think>', '<|tool_call_begin|>'} <= set(s['special_used']) and s[
        'special_outside'
    ] == []
    assert s['forced'] and all(t2d[i] for i in s['forced'])  # K=16 is too small for them all: forced in
    counts = torch.load(Path(r.data_root) / 'vocab' / 'counts.pt')
    assert (
        int(counts.sum())
        == s['supervised_tokens']
        == sum(sum(x) for x in load_corpus(Path(r.data_root) / 'corpus')['loss_mask'])
    )
    recipe = Path(r.data_root).parent / 'recipe.yaml'
    from eagle3nb.recipe import save_recipe

    save_recipe(r.model_copy(update=dict(phases={'vocab': {'draft_vocab': 300}})), recipe)
    out = vocab_cli(str(recipe))
    assert out['draft_vocab'] == 300 and out['forced'] == [] and 'coverage at K' in capsys.readouterr().out
    assert vocab_cli(str(recipe))['params'] == out['params']  # rerun: read back, not recounted


def test_vocab_reuse_same_files_same_coverage(smoke, tmp_path, capsys):
    "The phase's own vocabulary, reused from a user's folder on the same corpus: same files and coverage, folder kept"
    import shutil
    from eagle3nb.recipe import save_recipe

    r, out = smoke, Path(smoke.data_root) / 'vocab'
    merge_recipe(r, eval_fraction=0.2, seed=1)
    s = vocab_recipe(r, draft_vocab=64, force=True)
    mine = tmp_path / 'previous'
    shutil.copytree(out, mine)
    before = {f.name: f.read_bytes() for f in mine.iterdir()}
    recipe = tmp_path / 'recipe.yaml'  # the recipe key, as a user writes it
    save_recipe(r.model_copy(update=dict(phases={'vocab': {'from_dir': str(mine)}})), recipe)
    u = vocab_cli(str(recipe))
    assert f'reused from {mine}: coverage of this corpus {s["coverage"]:.2%}' in capsys.readouterr().out
    for f in ('d2t.pt', 't2d.pt', 'counts.pt'):
        assert (out / f).read_bytes() == before[f], f
    assert (u['draft_vocab'], u['coverage'], u['previous_coverage'], u['from_dir']) == (
        64,
        s['coverage'],
        s['coverage'],
        str(mine),
    )
    assert (u['special_used'], u['special_outside'], u['supervised_tokens']) == (
        s['special_used'],
        [],
        s['supervised_tokens'],
    )
    assert {f.name: f.read_bytes() for f in mine.iterdir()} == before  # never written
    assert vocab_recipe(r, from_dir=str(mine)) == u  # same folder, same files: read back, not measured again
    st = vocab_recipe(r, from_dir=str(mine), from_coverage=0.983)
    assert st['previous_coverage'] == 0.983 and '98.30% stated for it' in vocab_summary(st)


def test_vocab_reuse_refuses_broken_maps(smoke, tmp_path):
    "A wrong length, maps that disagree, a wrong dtype, a missing file, the vocab folder: each named, none written"
    import re

    r, out = smoke, Path(smoke.data_root) / 'vocab'
    merge_recipe(r, eval_fraction=0.2, seed=1)
    vocab_recipe(r, draft_vocab=32, force=True)
    d2t, t2d, _ = load_vocab(out)
    unmarked, extra = t2d.clone(), t2d.clone()
    unmarked[int(d2t[5]) + 5] = False
    extra[int((~t2d).nonzero()[0])] = True

    def folder(name, d, t=None):
        p = tmp_path / name
        p.mkdir()
        torch.save(d, p / 'd2t.pt')
        if t is not None:
            torch.save(t, p / 't2d.pt')
        return str(p)

    kept = {f.name: f.read_bytes() for f in out.iterdir()}
    for src, says in (
        (folder('short', d2t, t2d[:4000]), 'short/t2d.pt: 4000 entries, but the target has 4096 ids'),
        (folder('unmarked', d2t, unmarked), f'disagree: draft id 5 maps to target id {int(d2t[5]) + 5}'),
        (folder('extra', d2t, extra), 'disagree: t2d marks 33 target ids, d2t maps 32'),
        (folder('int32', d2t.int(), t2d), 'int32/d2t.pt: d2t must be a non-empty 1-D int64 tensor, not torch.int32'),
        (folder('no_t2d', d2t), 'no_t2d has no t2d.pt'),
        (str(out), 'the folder the vocab phase replaces'),
    ):
        with pytest.raises((ValueError, FileNotFoundError), match=re.escape(says)):
            vocab_recipe(r, from_dir=src)
    assert {f.name: f.read_bytes() for f in out.iterdir()} == kept  # the vocabulary in place, as it was


def test_generated_samples_join_as_a_later_input(smoke, tmp_path):
    "A generated completion (rendered layout, same sample_id) turns a prompt-only sample into a corpus sample"
    from datasets import load_from_disk

    r = smoke
    prompts = load_from_disk(str(Path(r.data_root) / 'rendered' / 'alpaca_prompts'))
    answer = [101, 102, 3842]  # stand-in completion ids ending in <|im_end|>
    gen = prompts.map(
        lambda x: dict(
            input_ids=x['input_ids'] + answer,
            loss_mask=[0] * len(x['input_ids']) + [1] * len(answer),
            spans=[[len(x['input_ids']), len(x['input_ids']) + len(answer)]],
            prompt_only=False,
            kind='generated',
        )
    )
    gen.save_to_disk(str(tmp_path / 'generated_alpaca'))
    m = merge_recipe(r, extra=[str(tmp_path / 'generated_alpaca')], eval_fraction=0.0)
    d = m['datasets']['alpaca_prompts']
    assert (d['available'], d['prompt_only'], d['sampled'], d['train']) == (8, 4, 4, 4)
    assert f"extra:generated_alpaca" in m['inputs'] and m['catalog']['not_in_catalog'] == 0
    st = query(
        r.catalog,
        "select state, count(*) n from sample_state s join samples using (sample_id) "
        "where phase = 'merge' and dataset = 'alpaca_prompts' group by 1",
    )
    assert st.values.tolist() == [['done', 4]]
    tr = load_corpus(Path(r.data_root) / 'corpus')
    got = [x for s_, x in zip(tr['sample_id'], tr['input_ids']) if s_ in set(prompts['sample_id'])]
    assert len(got) == 4 and all(x[-3:] == answer for x in got)


def test_inputs_for_different_targets_refuse_to_merge(smoke, tmp_path):
    import shutil

    r = smoke
    other = tmp_path / 'other'
    shutil.copytree(Path(r.data_root) / 'rendered' / 'alpaca', other)
    m = json.loads((other / 'render.json').read_text())
    m['params']['template_sha256'] = 'f' * 64
    (other / 'render.json').write_text(json.dumps(m))
    with pytest.raises(ValueError, match='rendered for different targets'):
        merge_recipe(r, extra=[str(other)])


def test_empty_recipe_merges_to_an_empty_corpus(tmp_path):
    r = smoke_recipe(tmp_path, FIXTURES, datasets=False)
    m = merge_recipe(r)
    assert (m['train'], m['eval'], m['datasets']) == (0, 0, {})
    assert len(load_corpus(Path(r.data_root) / 'corpus')) == 0
    with pytest.raises(ValueError, match='no supervised tokens'):
        vocab_recipe(r)


def test_merge_cli_prints_the_report(smoke, capsys):
    from eagle3nb.recipe import save_recipe

    recipe = Path(smoke.data_root).parent / 'merge_recipe.yaml'
    save_recipe(
        smoke.model_copy(update=dict(phases={'merge': {'eval_fraction': 0.1, 'mix': {'glaive_toolcall': 2}}})), recipe
    )
    m = merge_cli(str(recipe), force=True)
    out = capsys.readouterr().out
    assert m['datasets']['glaive_toolcall']['sampled'] == 2 and m['params']['eval_fraction'] == 0.1
    assert 'alpaca_copy' in out and 'duplicates dropped 4' in out


def test_vocab_without_corpus_says_run_merge(tmp_path):
    r = smoke_recipe(tmp_path, FIXTURES, datasets=False)
    with pytest.raises(FileNotFoundError, match='run the merge phase'):
        vocab_recipe(r)


def test_phase_notebooks_on_a_recipe_without_datasets(tmp_path):
    "Both phase notebooks, as the runner executes them, on a recipe that lists no datasets"
    pm = pytest.importorskip('papermill')
    from eagle3nb.recipe import parse_recipe, resolve, save_recipe

    r = resolve(
        parse_recipe(
            dict(
                name='empty',
                target=dict(toy='kimi-tiny', model=str(tmp_path / 'toy')),
                data_root=str(tmp_path / 'data'),
                catalog=str(tmp_path / 'catalog.duckdb'),
            )
        )
    )
    save_recipe(r, tmp_path / 'recipe.yaml')
    for ph in ('40_merge', '45_vocab'):
        nb = ROOT / 'nbs' / 'phases' / f'{ph}.ipynb'
        pm.execute_notebook(
            str(nb),
            str(tmp_path / f'{ph}.ipynb'),
            cwd=str(nb.parent),
            kernel_name='python3',
            progress_bar=False,
            parameters=dict(recipe=str(tmp_path / 'recipe.yaml'), run_dir=str(tmp_path / 'run')),
        )
        text = (tmp_path / f'{ph}.ipynb').read_text()
        assert 'empty corpus' in text
    assert json.loads((tmp_path / 'run' / 'merge.json').read_text())['train'] == 0
