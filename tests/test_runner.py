"The runner end to end through the `eagle3nb` command: a live toy server, records, resume, failures, secrets"

import json, os, shutil, subprocess, sys, uuid
from pathlib import Path
import nbformat, pytest
from eagle3nb.server import free_port

ROOT = Path(__file__).resolve().parent.parent
EAGLE3NB = str(Path(sys.executable).parent / 'eagle3nb')


def eagle3nb(*args, env=None, timeout=1200):
    "Run the CLI from the repository root, as the README does; `timeout`: a limit for a hang, not a budget"
    e = {**os.environ, 'OMP_NUM_THREADS': '1', **(env or {})}
    return subprocess.run([EAGLE3NB, *map(str, args)], cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def run_id():
    "A fresh run id; its papermill_runs/ folder is removed after the test"
    rid = f'pytest-{uuid.uuid4().hex[:8]}'
    yield rid
    shutil.rmtree(ROOT / 'papermill_runs' / rid, ignore_errors=True)


def recipe(tmp_path, wait: float = 120, **target):  # wait: target_check's limit for a server to answer
    p = tmp_path / 'recipe.yaml'
    p.write_text(
        json.dumps(
            dict(
                name='t',
                target=target,
                catalog=str(tmp_path / 'catalog.duckdb'),
                data_root=str(tmp_path / 'data'),
                phases=dict(target_check=dict(max_tokens=8, timeout=wait)),
            )
        )
    )
    return p


def code_outputs(nb_path):
    nb = nbformat.read(nb_path, as_version=4)
    return '\n'.join(str(o) for c in nb.cells if c.cell_type == 'code' for o in c.get('outputs', []))


def test_run_builds_toy_serves_checks_and_resumes(tmp_path, run_id):
    "A toy recipe with no endpoints: the runner builds the toy, serves it, the check passes, the server stops, a rerun skips"
    secret = 'sk-e3nb-' + uuid.uuid4().hex
    model = tmp_path / 'kimi-tiny'  # built by the runner itself
    # transformers serve (the default without an engine); the demo test runs the same with vLLM serving the target
    r = recipe(tmp_path, toy='kimi-tiny', model=str(model), api_key_env='E3NB_TEST_KEY', engine='transformers')
    p = eagle3nb('run', r, '--run-id', run_id, env={'E3NB_TEST_KEY': secret})
    assert p.returncode == 0, p.stderr[-3000:]
    rd = ROOT / 'papermill_runs' / run_id
    rec = rd / '00_target_check.ipynb'
    assert 'target check passed' in code_outputs(rec)
    seen = json.loads((rd / 'target_check.json').read_text())
    assert all(c['ok'] for c in seen['checks']) and seen['family'] == 'kimi'
    assert seen['completions'][0]['completion_tokens'] <= 8
    assert json.loads((rd / 'run.json').read_text())['phases']['00_target_check']['status'] == 'completed'
    from eagle3nb.catalog import query

    runs = query(
        tmp_path / 'catalog.duckdb', 'select phase, status from runs where run_id = ? order by phase', [run_id]
    )
    phases = sorted(p.stem for p in (ROOT / 'nbs' / 'phases').glob('[0-9]*_*.ipynb'))
    assert runs.values.tolist() == [[ph, 'ok'] for ph in phases]
    for nb in rd.glob('[0-9]*_*.ipynb'):  # no kernel noise in a record: kernels talk over IPC, not plain TCP
        assert 'TCP without encryption' not in code_outputs(nb), nb.name
    assert 'TCP without encryption' not in p.stderr
    assert not list((ROOT / 'nbs').rglob('kernel-ipc*')), 'kernel sockets left in the repository'
    # no file of the run holds the key: the record keeps only the variable's name
    for f in rd.rglob('*'):
        if f.is_file():
            assert secret not in f.read_text(errors='ignore'), f
    assert (model / 'eagle3nb_toy.json').exists() and secret not in p.stdout + p.stderr
    # the server the runner launched for this model is gone
    assert subprocess.run(['pgrep', '-f', f'serve {model}'], capture_output=True).returncode == 1
    mtime = rec.stat().st_mtime
    p2 = eagle3nb('run', r, '--run-id', run_id, env={'E3NB_TEST_KEY': secret})
    assert p2.returncode == 0 and 'skip 00_target_check: completed with the same parameters' in p2.stderr, p2.stderr[
        -2000:
    ]
    assert rec.stat().st_mtime == mtime


def test_run_stops_on_failure_names_cell_and_keeps_record(tmp_path, kimi_tiny, run_id):
    "Nothing listens at the endpoint: the phase fails, the error names the cell and the cause, a rerun sets the record aside"
    url = f'http://127.0.0.1:{free_port()}/v1'
    r = recipe(tmp_path, wait=3, model=str(kimi_tiny), endpoints=[url], served_name='kimi')  # waits 3 s, not 120
    p = eagle3nb('run', r, '--run-id', run_id)
    assert p.returncode == 1
    err = p.stderr
    assert 'phase 00_target_check failed in cell' in err and 'ServerNotReady' in err and url in err, err[-3000:]
    assert f'--run-id {run_id}' in err
    rd = ROOT / 'papermill_runs' / run_id
    assert (rd / '00_target_check.ipynb').exists()
    assert json.loads((rd / 'run.json').read_text())['phases']['00_target_check']['status'] == 'failed'
    p2 = eagle3nb('run', r, '--run-id', run_id)
    assert p2.returncode == 1
    assert sorted(f.name for f in rd.glob('*.ipynb')) == ['00_target_check.failed-1.ipynb', '00_target_check.ipynb']


def test_run_detects_server_serving_another_model(tmp_path, kimi_tiny, toy_server, run_id):
    "The endpoint answers but lists another model: the check fails and says which models it serves"
    r = recipe(tmp_path, model=str(kimi_tiny), endpoints=[toy_server.base_url], served_name='moonshotai/Kimi-K2.5')
    p = eagle3nb('run', r, '--run-id', run_id)
    assert p.returncode == 1
    assert 'ModelMismatch' in p.stderr and 'moonshotai/Kimi-K2.5' in p.stderr, p.stderr[-3000:]


def test_recipe_errors_name_the_key(tmp_path, run_id):
    "Bad keys fail before any phase runs, one line, naming the key"
    bad = tmp_path / 'bad.yaml'
    bad.write_text('name: t\ntarget: {toy: kimi-tiny, endpionts: []}\n')
    p = eagle3nb('run', bad, '--run-id', run_id)
    assert p.returncode == 1 and 'target.endpionts: unknown key' in p.stderr and 'Traceback' not in p.stderr
    bad.write_text('name: t\ntarget: {toy: kimi-tiny}\nphases: {target_check: {max_tokenz: 3}}\n')
    p = eagle3nb('run', bad, '--run-id', run_id)
    assert p.returncode == 1 and 'phases.target_check.max_tokenz: not a parameter of 00_target_check.ipynb' in p.stderr
    bad.write_text('name: t\ntarget: {toy: kimi-tiny, api_key: sk-live-123}\n')
    p = eagle3nb('run', bad, '--run-id', run_id)
    assert p.returncode == 1 and 'secrets never go in a recipe' in p.stderr
    assert not (ROOT / 'papermill_runs' / run_id).exists()


def test_prompt_only_recipe_through_generate(tmp_path, kimi_tiny, toy_server, run_id):
    "A recipe whose only dataset is prompt-only (nothing supervised before generate) runs target_check to generate"
    p = tmp_path / 'recipe.yaml'
    p.write_text(
        json.dumps(
            dict(
                name='t',
                target=dict(model=str(kimi_tiny), endpoints=[toy_server.base_url]),
                catalog=str(tmp_path / 'catalog.duckdb'),
                data_root=str(tmp_path / 'data'),
                datasets=[
                    dict(
                        name='prompts',
                        format='alpaca',
                        kind='prompt_only',
                        path=str(ROOT / 'tests' / 'fixtures' / 'datasets' / 'alpaca_en_demo.sample.json'),
                    )
                ],
                phases=dict(target_check=dict(max_tokens=8, timeout=120), generate=dict(max_new_tokens=8)),
            )
        )
    )
    r = eagle3nb('run', p, '--run-id', run_id, '--phases', 'target_check,prepare,render,catalog,generate', timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rd = ROOT / 'papermill_runs' / run_id
    state = json.loads((rd / 'run.json').read_text())['phases']
    assert {s: st['status'] for s, st in state.items()} == {
        s: 'completed' for s in ('00_target_check', '10_prepare', '15_render', '20_catalog', '30_generate')
    }
    assert 'no token amplification to plot' in code_outputs(rd / '15_render.ipynb')
    assert any((tmp_path / 'data' / 'generated').rglob('*')), 'generate wrote nothing'
