"Train plan: numbers equal SQL over a real catalog, versions never overwritten, the Kimi-K2.5 recipe planned from the recipe alone"

import json, re, shutil
from collections import namedtuple
from pathlib import Path
import pytest
import yaml

from eagle3nb.catalog import query
from eagle3nb.merge import smoke_recipe
from eagle3nb.plan import plan_facts, plan_markdown, write_plan, plan_cli, next_plan_path
from eagle3nb.recipe import load_recipe, save_recipe
from eagle3nb.runner import check_phase_params, phase_notebooks, phase_key, execute_phase
from eagle3nb.store import bytes_per_token

ROOT = Path(__file__).resolve().parents[1]
KIMI = ROOT / 'recipes' / 'kimi-k2.5-agentic-100k.yaml'
FIXTURES = ROOT / 'tests' / 'fixtures' / 'datasets'


def md_table(md: str, heading: str, which: int = 0) -> list:
    "Rows (lists of cell texts) of the `which`-th table under `## heading`, header included"
    sec = md.split(f'\n## {heading}\n', 1)[1].split('\n## ', 1)[0]
    tables = re.findall(r'((?:^\|.*\|$\n?)+)', sec, re.M)
    rows = [[c.strip() for c in l.strip('|').split('|')] for l in tables[which].strip().split('\n')]
    return [rows[0]] + rows[2:]  # drop the |---| line


def num(s: str) -> int:
    return int(s.replace(',', ''))


@pytest.fixture(scope='module')
def smoke(tmp_path_factory):
    "A recipe over the shipped fixtures, prepared, rendered, catalogued and partitioned (kimi-tiny)"
    return smoke_recipe(tmp_path_factory.mktemp('plan'), FIXTURES)


def test_catalog_numbers_equal_sql(smoke):
    f = plan_facts(smoke, version=1)
    md = plan_markdown(f)
    sql = query(
        smoke.catalog,
        """SELECT dataset, count(*) AS samples, sum(total_tokens) AS tokens, count(DISTINCT conversation_id) AS conv,
        sum(completion_tokens) AS sup, count(*) FILTER (partition = 'main') AS main, count(*) FILTER (partition = 'long') AS long,
        count(*) FILTER (partition = 'excluded') AS excluded FROM samples GROUP BY ALL""",
    ).set_index('dataset')
    assert set(sql.index) == {d.name for d in smoke.datasets}
    ds = {r[0]: r for r in md_table(md, 'Datasets')[1:]}
    tok = {r[0]: r for r in md_table(md, 'Token statistics')[1:]}
    part = {r[0]: r for r in md_table(md, 'Partitions')[1:]}
    for d in f['datasets']:
        s = sql.loc[d['name']]
        assert d['source'] == 'catalog'
        assert (d['samples'], d['tokens'], d['conversations'], d['supervised']) == (s.samples, s.tokens, s.conv, s.sup)
        assert (d['main'], d['long'], d['excluded']) == (s.main, s.long, s.excluded)
        assert num(ds[d['name']][6]) == s.samples and num(ds[d['name']][7]) == s.conv  # samples, conversations columns
        assert num(tok[d['name']][1]) == s.tokens and num(tok[d['name']][6]) == s.sup
        assert [num(x) for x in part[d['name']][1:4]] == [s.main, s.long, s.excluded]
    # the partition summary table against SQL over partitions
    by_part = query(
        smoke.catalog, "SELECT partition, count(*) AS n, sum(total_tokens) AS t FROM samples GROUP BY ALL"
    ).set_index('partition')
    for row in md_table(md, 'Partitions', 1)[1:]:
        assert (num(row[3]), num(row[4])) == (by_part.n.get(row[0], 0), by_part.t.get(row[0], 0))
    # generation: the prompt-only samples outside 'excluded', per partition
    gen = query(
        smoke.catalog,
        "SELECT partition, count(*) AS n FROM samples WHERE kind = 'prompt_only' AND partition <> 'excluded' GROUP BY ALL",
    )
    assert {k: v['samples'] for k, v in f['generation']['partitions'].items() if v['samples']} == dict(gen.values)
    # bytes per token per mode
    t, h = f['target'], f['hidden']
    for mode, v in h['modes'].items():
        assert v['bytes_per_token'] == bytes_per_token(mode, t['hidden_size'], 3, 64, min(32000, t['vocab_size']))
        assert v['bytes'] == h['tokens'] * v['bytes_per_token']
    hid = {r[0]: r for r in md_table(md, 'Hidden states on disk')[1:]}
    assert num(hid['bf16'][2]) == bytes_per_token('bf16', t['hidden_size'], 3)


def test_versions_never_overwrite(smoke, tmp_path):
    (tmp_path / 'train_plan_v4.md').write_text('the seeds wrote this')
    p5 = write_plan(smoke, tmp_path)
    before = p5.read_bytes()
    p6 = write_plan(smoke, tmp_path)
    assert (p5.name, p6.name) == ('train_plan_v5.md', 'train_plan_v6.md')
    assert (tmp_path / 'train_plan_v4.md').read_text() == 'the seeds wrote this' and p5.read_bytes() == before
    assert p6.read_text().startswith('# Train plan v6: smoke')
    assert sorted(p.name for p in tmp_path.iterdir()) == ['train_plan_v4.md', 'train_plan_v5.md', 'train_plan_v6.md']
    assert next_plan_path(tmp_path / 'new').name == 'train_plan_v1.md'


def test_kimi_recipe_checks():
    "The recipe loads, `eagle3nb recipe check` passes, and every phases.<key> holds only its notebook's parameters"
    from eagle3nb.cli import main

    r = load_recipe(KIMI)
    assert sum(d.count for d in r.datasets) == 100_000 and r.target.aux_layers == [2, 30, 58]
    main(['recipe', 'check', str(KIMI), '--elsewhere'])  # its data and model live on the cluster, not here
    with pytest.raises(SystemExit):
        main(['recipe', 'check', str(KIMI)])  # here, the paths are missing: said, exit 1
    nbs = {phase_key(s): p for s, p in phase_notebooks(ROOT / 'nbs' / 'phases').items()}
    for key, params in r.phases.items():
        assert key in nbs, f'phases.{key}: no notebook nbs/phases/NN_{key}.ipynb'
        check_phase_params(nbs[key], params)
    assert r.phases['generate']['c_main'] in range(150, 201) and r.phases['catalog']['max_ctx'] == 10240


def _kimi_tokens(r):
    "Hidden-state tokens of the Kimi recipe, computed here from the recipe alone"
    p = r.phases['plan']
    full = sum(
        d.count * p['dataset_tokens'].get(d.name, p['mean_tokens']) for d in r.datasets if d.kind != 'prompt_only'
    )
    po = sum(d.count for d in r.datasets if d.kind == 'prompt_only')
    return full + po * (p['prompt_tokens'] + p['response_tokens'])


def test_kimi_plan_without_data(tmp_path, monkeypatch, capsys):
    d = yaml.safe_load(KIMI.read_text())
    d['catalog'] = str(tmp_path / 'no' / 'catalog.duckdb')  # whatever this machine holds
    kimi = tmp_path / KIMI.name
    kimi.write_text(yaml.safe_dump(d, sort_keys=False))
    r = load_recipe(kimi)
    assert not Path(r.target.model).exists() and not Path(r.catalog).exists()
    Usage = namedtuple('Usage', 'total used free')
    monkeypatch.setattr(shutil, 'disk_usage', lambda p: Usage(10**12, 0, 10**12))  # 1 TB free
    path = plan_cli(str(kimi), out=str(tmp_path))
    out = capsys.readouterr().out
    assert f'wrote {path}' in out and 'does not fit' in out
    md = path.read_text()
    assert path.name == 'train_plan_v1.md' and '# Train plan v1: kimi-k2.5-agentic-100k' in md
    assert '= **21504** inputs' in md and 'Aux layers [2, 30, 58]' in md and '-> 21,504 = 3 x 7168' in md
    gen = {row[0]: row for row in md_table(md, 'Generation')[1:]}
    assert gen['main'][4:6] == ['10,240', '192'] and gen['long'][5] == '16'  # context, concurrency from the recipe
    f = plan_facts(r, version=1)
    assert all(d['source'] == 'estimate' for d in f['datasets'])
    h = f['hidden']
    assert h['tokens'] == _kimi_tokens(r)
    assert h['modes']['bf16']['bytes'] == h['tokens'] * bytes_per_token('bf16', 7168, 3, 64, 32000)
    assert not h['fits'] and '**does not fit**' in md
    monkeypatch.setattr(shutil, 'disk_usage', lambda p: Usage(10**15, 0, 10**15))  # 1 PB free: fits
    f = plan_facts(r, version=2)
    assert f['hidden']['fits'] and 'does not fit' not in plan_markdown(f)
    cmds = '\n'.join(l for _, _, ls in f['commands'] for l in ls)
    assert (
        'eagle3nb prepare --format xlam --input /data/raw/Salesforce/xlam-function-calling-60k --name xlam_60k' in cmds
    )
    assert (
        '--nnodes 4' in cmds
        and 'eagle3nb extract RECIPE --modes bf16 --device-map auto' in cmds
        and 'torchrun --nproc_per_node 8 -m eagle3nb train' in cmds
    )
    assert (
        '--name xlam_60k --out /data/eagle3/kimi-k2.5-agentic-100k/prepared --count 20000 --seed 0 --license cc-by-4.0'
        in cmds
    )
    assert '--speculative http://sglang-eagle3:30000/v1 --model kimi-k2.5' in cmds and '--concurrency 1,8,32' in cmds
    # Kimi's deploy guidance: the engines run its own code and parse its tool calls (and, thinking, its reasoning)
    assert r.target.trust_remote_code and 'trust_remote_code' not in r.phases.get('doctor', {})
    kimi = '--trust-remote-code --tool-call-parser kimi_k2 --reasoning-parser kimi_k2'
    vkimi = '--trust-remote-code --enable-auto-tool-choice --tool-call-parser kimi_k2 --reasoning-parser kimi_k2'
    lines = cmds.splitlines()
    sg = [l for l in lines if l.startswith('python -m sglang.launch_server')]
    vl = [l for l in lines if l.startswith('vllm serve') and 'extract_hidden_states' not in l]
    assert len(sg) == 2 and all(l.endswith(kimi) or f'{kimi} ' in l for l in sg), sg  # the endpoints, the draft's
    assert len(vl) == 2 and all(vkimi in l for l in vl), vl
    assert any('--speculative-algorithm EAGLE3' in l for l in sg) and any('"method": "eagle3"' in l for l in vl)
    assert '--served-model-name kimi-k2.5' in sg[0] and '--tp 8' in sg[0]
    ex = [l for l in lines if l.startswith('vllm serve') and 'extract_hidden_states' in l]
    assert len(ex) == 1 and '--trust-remote-code' in ex[0]
    assert all(
        '--trust-remote-code' in l
        for l in lines
        if l.startswith(('eagle3nb doctor', 'eagle3nb verify', 'eagle3nb export'))
    )
    assert '"tp": 8' in md and 'phases.export' in md  # the launch's parameters, among the phases' in the plan


def test_launch_lines_follow_the_target(smoke):
    "A recipe without trust_remote_code: none on our verbs or the extraction server; the draft's launch keeps it"
    from eagle3nb.plan import PHASE_DEFAULTS
    from eagle3nb.phases.export import Params as ExportParams

    f = plan_facts(smoke, version=1)
    lines = [l for _, _, ls in f['commands'] for l in ls]
    assert not smoke.target.trust_remote_code
    assert not any('--trust-remote-code' in l for l in lines if l.startswith('eagle3nb'))
    launch = [l for l in lines if l.startswith(('python -m sglang.launch_server', 'vllm serve'))]
    ex = [l for l in launch if 'extract_hidden_states' in l]  # the extraction server: the recipe's value
    launch = [l for l in launch if l not in ex]
    assert len(ex) == 1 and '--trust-remote-code' not in ex[0]
    assert launch and all('--trust-remote-code' in l for l in launch)
    assert all('--tool-call-parser kimi_k2' in l for l in launch if 'EAGLE3' in l or 'eagle3' in l)  # a Kimi-family toy
    thinking_off = smoke.model_copy(deep=True)
    thinking_off.target.thinking = False
    lines = [l for _, _, ls in plan_facts(thinking_off, version=1)['commands'] for l in ls]
    assert not any('--reasoning-parser' in l for l in lines)
    assert PHASE_DEFAULTS['export'] == {
        k: v for k, v in ExportParams.defaults().items() if k in PHASE_DEFAULTS['export']
    }
    assert set(PHASE_DEFAULTS['export']) == {'tp', 'num_steps', 'topk'}


def test_phase_notebook_writes_into_run_dir(smoke, tmp_path):
    "Run as the runner runs it: the plan lands in run_dir with plan.json, and the commands name the original recipe"
    rec = save_recipe(smoke, tmp_path / 'recipe.yaml')
    (tmp_path / 'run.json').write_text(json.dumps(dict(run_id='r1', recipe_source='recipes/smoke.yaml')))
    execute_phase(
        ROOT / 'nbs' / 'phases' / '90_plan.ipynb',
        tmp_path / '90_plan.ipynb',
        dict(recipe=str(rec), run_dir=str(tmp_path), gpus=2),
        stream=False,
    )
    j = json.loads((tmp_path / 'plan.json').read_text())
    assert Path(j['path']) == tmp_path / 'train_plan_v1.md'
    md = Path(j['path']).read_text()
    assert 'eagle3nb run recipes/smoke.yaml --run-id r1 --phases extract' in md and 'torchrun --nproc_per_node 2' in md
    assert j['summary']['datasets'].startswith('5 (5 from the catalog')


def test_phase_parameters_are_the_plan_params():
    "The plan phase's parameters are PlanParams' fields with the same defaults, plus out; its notebook cell agrees"
    import papermill as pm
    from eagle3nb.plan import PlanParams
    from eagle3nb.phases.plan import Params

    ps = pm.inspect_notebook(str(ROOT / 'nbs' / 'phases' / '90_plan.ipynb'))
    assert {k: eval(v['default']) for k, v in ps.items() if k not in ('recipe', 'run_dir')} == Params.defaults()
    assert {k: v for k, v in Params.defaults().items() if k != 'out'} == PlanParams.defaults()
