"Train plan: numbers equal SQL over a real catalog, versions never overwritten, the Kimi-K2.5 recipe planned from the recipe alone"

import json, re, shutil
from collections import namedtuple
from pathlib import Path
import pytest
import yaml

from eagle3nb.catalog import query
from eagle3nb.merge import smoke_recipe
from eagle3nb.plan import plan_facts, plan_markdown, write_plan, plan_cli, next_plan_path
from eagle3nb.recipe import RecipeError, load_recipe, save_recipe
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
        assert num(ds[d['name']][9]) == s.samples and num(ds[d['name']][10]) == s.conv  # samples, conversations columns
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
    assert all(d.repo and d.revision for d in r.datasets)  # every dataset downloaded first, at a revision
    main(['recipe', 'check', str(KIMI), '--elsewhere'])  # its data and model live on the cluster, not here
    with pytest.raises(SystemExit):
        main(['recipe', 'check', str(KIMI)])  # here, the paths are missing: said, exit 1
    nbs = {phase_key(s): p for s, p in phase_notebooks(ROOT / 'nbs' / 'phases').items()}
    for key, params in r.phases.items():
        assert key in nbs, f'phases.{key}: no notebook nbs/phases/NN_{key}.ipynb'
        check_phase_params(nbs[key], params)
    assert r.phases['generate']['c_main'] in range(150, 201) and r.phases['catalog']['max_ctx'] == 10240


def _kimi_tokens(r):
    "Hidden-state tokens of the Kimi recipe, computed here from the recipe alone, policy by policy"
    p, mt = r.phases['plan'], r.phases['generate']['max_turns']
    total = 0
    for d in r.datasets:
        mean = p['dataset_tokens'].get(d.name, p['mean_tokens'])
        turns = p.get('dataset_turns', {}).get(d.name, 1)
        answer = p.get('dataset_response_tokens', {}).get(d.name, p['response_tokens'])
        if d.regenerate == 'once':
            total += d.count * (p['prompt_tokens'] + answer)
        elif d.regenerate == 'turns':
            total += d.count * (p['dataset_prompt_tokens'].get(d.name, mean * 0.5) + turns * answer)
        elif d.regenerate == 'prefix':  # the recorded trajectory once, then each answer (at most each turn whole)
            t = min(turns, mt) if mt else turns
            total += d.count * min(t * (mean / 2 + answer), mean + t * answer)
            if r.phases['generate'].get('supervise_recorded', True):  # and the recorded answers of those turns
                total += round(d.count * mean * p.get('supervised_share', 0.3) * t / turns)
        else:
            total += d.count * mean
    return round(total)


def test_kimi_plan_without_data(tmp_path, monkeypatch, capsys):
    "The plan of the user's run from the recipe alone: their mix, every other model's answer regenerated, the disk"
    d = yaml.safe_load(KIMI.read_text())
    d['catalog'] = str(tmp_path / 'no' / 'catalog.duckdb')  # whatever this machine holds
    kimi = tmp_path / KIMI.name
    kimi.write_text(yaml.safe_dump(d, sort_keys=False))
    r = load_recipe(kimi)
    assert not Path(r.target.model).exists() and not Path(r.catalog).exists()
    Usage = namedtuple('Usage', 'total used free')
    monkeypatch.setattr(
        shutil, 'disk_usage', lambda p: Usage(10**12, 0, 10**12)
    )  # 1 TB free here: not the disk planned
    path = plan_cli(str(kimi), out=str(tmp_path))
    out = capsys.readouterr().out
    md = path.read_text()
    # the user's numbering: this run's plan is their train_plan_v4.md
    assert (
        f'wrote {path}' in out and path.name == 'train_plan_v4.md' and '# Train plan v4: kimi-k2.5-agentic-100k' in md
    )
    assert '= **21504** inputs' in md and 'Aux layers [2, 30, 58]' in md and '-> 21,504 = 3 x 7168' in md
    f = plan_facts(r, version=4)
    ds = f['datasets']
    # 10 datasets of 2K-15K, 100K in all, agentic-heavy; the plan shows the mix by category
    assert len(ds) == 10 and all(2_000 <= x['count'] <= 15_000 for x in ds) and sum(x['count'] for x in ds) == 100_000
    shares = {c['category']: float(c['share'].rstrip('%')) for c in f['categories']}
    agentic = shares['tool use'] + shares['agentic coding'] + shares['Kimi-native agent traces']
    assert agentic >= 40 and max(shares, key=shares.get) == 'tool use', shares
    assert '\n## Mix\n' in md and '| tool use |' in md
    # every turn of the agent trajectories answered (max_turns 0), and the mix agentic-heavy by supervised tokens too
    assert r.phases['generate']['max_turns'] == 0
    sup = {c['category']: c['supervised_train'] for c in f['categories']}
    agent_sup = sup['tool use'] + sup['agentic coding'] + sup['Kimi-native agent traces']
    assert agent_sup >= 0.5 * sum(sup.values()), sup
    assert '| category | datasets | records | share | generated | supervised tokens | share of supervised |' in md
    # every sample answered by another model is regenerated, by its policy; the Kimi-native traces are kept
    pol = {x['name']: x['policy'] for x in ds}
    assert pol['hermes_kimi_traces'] == 'keep' and pol['ultrachat_prompts'] == 'once'
    assert pol['sharegpt_vicuna'] == 'turns' and pol['swe_agent_trajectories'] == 'prefix'
    native = sum(x['count'] for x in ds if x['kind'] == 'native')
    g = f['generation']
    assert g['samples'] == 100_000 - native == 92_500
    assert {x['policy']: x['regenerated'] for x in g['policies']} == dict(
        once=15_000, turns=39_000, prefix=38_500, keep=0
    )
    assert (
        'regenerated by the target' in f['summary'] and '92,500 of 100,000' in f['summary']['regenerated by the target']
    )
    # the long partition gets the long agent trajectories, at its own concurrency
    long = g['partitions']['long']
    assert long['samples'] == 5_000 and long['concurrency'] == 16 and long['ctx'] == 32768
    assert {x['name']: x['long'] for x in ds}['swe_rebench_openhands'] == 5_000
    # the disk: the stated 11 TB with the headroom rule; the recipe extracts the mode that fits; the user's figure beside
    h = f['hidden']
    assert h['tokens'] == _kimi_tokens(r)
    assert h['free_bytes'] == 11e12 and h['disk_source'] == 'stated'
    assert h['modes']['nf4']['bytes'] == h['tokens'] * bytes_per_token('nf4', 7168, 3, 64, 32000)
    assert h['modes']['compact']['bytes'] == h['tokens'] * bytes_per_token('compact', 7168, 3, 64, 32000)
    assert h['modes']['nf4']['fits'] and not h['modes']['compact']['fits'] and not h['modes']['bf16']['fits']
    assert h['choice'] == ['nf4'] and h['planned'] == ['nf4']  # the recommended mode (BENCHMARKS.md, storage modes)
    assert h['need_bytes'] * 1.1 <= 11e12 and 'The headroom rule' in md
    assert round(h['stated_tokens_per_sample']) == round(92e6 / bytes_per_token('bf16', 7168, 3))  # 1,604
    assert 'Your figure, 92.0 GB per 1,000 samples' in md
    # the user's measured rates are the stated assumptions; GPU-hours beside wall time; extraction through vLLM TP 8
    assert g['gen_tok_s'] == 2370 and g['source'].startswith('stated')
    e = f['extract']
    assert e['engine'] == 'vllm' and e['cached']  # vLLM's prefix cache: a trajectory's recorded part computed once
    assert abs(e['seconds'] - h['samples'] * h['tokens'] / h['whole_tokens'] / 1.48) < 1  # the user's rate, per token
    gh = {x['phase']: x for x in f['gpu_hours']}
    assert gh['generate']['gpus'] == 32 and gh['extract']['gpus'] == 32 and gh['train']['gpus'] == 8
    assert abs(gh['**total**']['gpu_hours'] - sum(gh[k]['gpu_hours'] for k in ('generate', 'extract', 'train'))) < 1e-6
    assert '\n## Time and GPU-hours\n' in md
    cmds = '\n'.join(l for _, _, ls in f['commands'] for l in ls)
    assert 'eagle3nb download RECIPE' in cmds
    vllm = 'python -m vllm.entrypoints.openai.api_server'  # every engine line from the engines' command builders
    ex = [l for l in cmds.splitlines() if l.startswith(vllm) and 'extract_hidden_states' in l]
    assert len(ex) == 1 and '--tensor-parallel-size 8' in ex[0] and '--trust-remote-code' in ex[0]
    assert '--gpu-memory-utilization 0.85' in ex[0]  # serving.extract.launch
    assert 'eagle3nb extract RECIPE --engine vllm --modes nf4' in cmds
    # the goal as a gate, with serve-bench's break-even at today's numbers
    q = f['goal']
    assert q['min_accept'] == 3.0 and abs(q['break_even'] - 2.1 * 90 / 82.3) < 1e-9
    assert 'pays above accept length **2.30**' in md and 'Accept length >= **3**' in md
    # measured rates replace the stated ones: a generate and an extract row in the catalog's `rates`
    from eagle3nb.catalog import connect, record_rate

    r.catalog = str(tmp_path / 'cat' / 'catalog.duckdb')
    Path(r.catalog).parent.mkdir()
    with connect(r.catalog):
        pass
    record_rate(r.catalog, 'kimi-1', 'generate', tokens=4_000_000, seconds=1000.0, samples=2000, gpus=32)
    record_rate(r.catalog, 'kimi-1', 'extract', tokens=9_000_000, seconds=300.0, detail=dict(nodes=1))
    m = plan_facts(r, version=6)
    assert m['generation']['gen_tok_s'] == 4000 and m['generation']['source'].startswith('measured: run kimi-1')
    assert m['extract']['tok_s'] == 30_000 and m['extract']['source'].startswith('measured')
    assert abs(m['extract']['seconds'] - h['tokens'] / (30_000 * 4)) < 1
    assert m['generation']['seconds'] < f['generation']['seconds']
    # bf16 planned on this disk would not fit: the plan names the mode that does
    r2 = r.model_copy(deep=True)
    r2.phases['extract']['modes'] = 'bf16'
    h2 = plan_facts(r2, version=7)['hidden']
    assert not h2['fits'] and h2['choice'] == ['nf4']
    assert '**set phases.extract.modes: nf4**' in plan_facts(r2, version=7)['summary']['storage']
    # no disk stated: the free space measured here (1 TB) decides, and nothing fits
    r3 = r.model_copy(deep=True)
    r3.phases['plan'] = {k: v for k, v in r3.phases['plan'].items() if k != 'disk_tb'}
    h3 = plan_facts(r3, version=8)['hidden']
    assert h3['free_bytes'] == 10**12 and not h3['fits'] and h3['choice'] == []
    # Kimi's deploy guidance: the engines run its own code and parse its tool calls (and, thinking, its reasoning)
    assert r.target.trust_remote_code and 'trust_remote_code' not in r.phases.get('doctor', {})
    kimi = '--trust-remote-code --tool-call-parser kimi_k2 --reasoning-parser kimi_k2'
    vkimi = '--trust-remote-code --enable-auto-tool-choice --tool-call-parser kimi_k2 --reasoning-parser kimi_k2'
    lines = cmds.splitlines()
    sg = [l for l in lines if l.startswith('python -m sglang.launch_server')]
    vl = [l for l in lines if l.startswith(vllm) and 'extract_hidden_states' not in l]
    sgk, vlk = '--tool-call-parser kimi_k2 --reasoning-parser kimi_k2', vkimi.split(' ', 1)[1]
    assert len(sg) == 2 and all(sgk in l and '--trust-remote-code' in l for l in sg), sg  # generation, the draft's
    assert len(vl) == 1 and all(vlk in l and '--trust-remote-code' in l for l in vl), vl  # the draft's
    assert any('--speculative-algorithm EAGLE3' in l for l in sg) and any('"method": "eagle3"' in l for l in vl)
    assert '--served-model-name kimi-k2.5' in sg[0] and '--tp 8' in sg[0]
    assert all(
        '--trust-remote-code' in l
        for l in lines
        if l.startswith(('eagle3nb doctor', 'eagle3nb verify', 'eagle3nb export'))
    )
    assert 'phases.export' in md  # the launch's parameters, among the phases' in the plan
    # the draft is measured on the user's servers (serving.draft): verify says so, serve-bench uses them
    vf = next(l for l in lines if l.startswith('eagle3nb verify'))
    assert '--engine sglang --baseline http://sglang-0:30000/v1 --speculative http://sglang-eagle3:30000/v1' in vf
    assert (
        'eagle3nb serve-bench --baseline http://sglang-0:30000/v1 --speculative http://sglang-eagle3:30000/v1' in cmds
    )


def test_rates_per_server_or_fleet():
    "A stated rate is one server's or the fleet's, as the recipe says: the hours follow, and the plan shows the sum"
    r = load_recipe(KIMI)
    fleet = plan_facts(r, version=4)  # the recipe: the user's 2,370 tok/s and 1.48 samples/s were the fleet's
    r.phases['plan'].update(gen_tok_s_per='server', extract_samples_s_per='server')
    per = plan_facts(r, version=4)
    g, e = fleet['generation'], fleet['extract']
    assert (
        abs(per['generation']['seconds'] - g['seconds'] / 4) < 1
        and abs(per['extract']['seconds'] - e['seconds'] / 4) < 1
    )
    assert (
        'tok/s for the fleet (4 servers)' in g['source']
        and '2,370 tok/s per server x 4 servers' in per['generation']['source']
    )
    assert '1.48 samples/s per server x 4 = 5.92' in per['extract']['source']
    gh = lambda f: {x['phase']: x['gpu_hours'] for x in f['gpu_hours']}
    assert abs(gh(per)['generate'] - gh(fleet)['generate'] / 4) < 1e-6  # 32 GPUs for a quarter of the hours
    r.phases['plan']['gen_tok_s_per'] = 'node'
    with pytest.raises(RecipeError, match="one server's"):
        plan_facts(r, version=4)
    r.phases['plan'].update(gen_tok_s_per='fleet', gpus_per_target=4)  # the servers' GPUs said twice, differently
    with pytest.raises(RecipeError, match='say it once'):
        plan_facts(r, version=4)


def test_plan_verb_on_the_kimi_recipe(tmp_path):
    "`eagle3nb plan RECIPE` (the phase's verb) writes the recipe's first version, with every storage mode's terabytes"
    from eagle3nb.cli import main

    d = yaml.safe_load(KIMI.read_text())
    d['catalog'] = str(tmp_path / 'no' / 'catalog.duckdb')
    kimi = tmp_path / KIMI.name
    kimi.write_text(yaml.safe_dump(d, sort_keys=False))
    main(['plan', str(kimi), '--run-dir', str(tmp_path / 'run'), '--no-progress'])  # phases.plan.version: 4
    md = (tmp_path / 'run' / 'train_plan_v4.md').read_text()
    tokens = plan_facts(load_recipe(kimi), version=4)['hidden']['tokens']
    for m in ('bf16', 'compact', 'nf4'):
        bpt = bytes_per_token(m, 7168, 3, 64, 32000)
        assert f'| {m} | ' in md and f'| {bpt:,} | {tokens * bpt / 1e12:.1f} TB |' in md, m


def test_launch_lines_follow_the_target(smoke):
    "A recipe without trust_remote_code: none on our verbs or the extraction server; the draft's launch keeps it"
    from eagle3nb.plan import PHASE_DEFAULTS
    from eagle3nb.phases.export import Params as ExportParams

    f = plan_facts(smoke, version=1)
    lines = [l for _, _, ls in f['commands'] for l in ls]
    assert not smoke.target.trust_remote_code
    assert not any('--trust-remote-code' in l for l in lines if l.startswith('eagle3nb'))
    launch = [l for l in lines if l.startswith(('python -m sglang.launch_server', 'python -m vllm.entrypoints'))]
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


def test_plan_out_writes_there_and_nowhere_else(tmp_path):
    "`eagle3nb plan RECIPE --out DIR`: the plan and its record in DIR; nothing under the recipe's data_root"
    from eagle3nb.cli import main

    d = yaml.safe_load(KIMI.read_text())
    d['catalog'] = str(tmp_path / 'no' / 'catalog.duckdb')
    d['data_root'] = str(tmp_path / 'elsewhere' / 'data')  # the recipe's data root: on another machine
    kimi = tmp_path / KIMI.name
    kimi.write_text(yaml.safe_dump(d, sort_keys=False))
    main(['plan', str(kimi), '--out', str(tmp_path / 'plans'), '--no-progress'])
    assert sorted(p.name for p in (tmp_path / 'plans').iterdir() if not p.name.startswith('.')) == [
        'plan.json',
        'train_plan_v4.md',
    ]
    assert not (tmp_path / 'elsewhere').exists()
