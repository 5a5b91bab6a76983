"Every phase is one library object: its notebook's parameters cell, its CLI flags and the recipe check all read its Params"

import ast
from pathlib import Path

import nbformat
import pytest

from eagle3nb.cli import parse_cli
from eagle3nb.phase import cell_parameters, parameters_source, phases
from eagle3nb.runner import phase_key, phase_notebooks

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = phase_notebooks(ROOT / 'nbs' / 'phases')
CONTROL = (ast.If, ast.For, ast.While, ast.Try, ast.With)


def params_cell(nb: Path) -> str:
    cells = [c for c in nbformat.read(nb, 4).cells if 'parameters' in c.metadata.get('tags', [])]
    assert len(cells) == 1, f'{nb.name}: one cell tagged parameters'
    return cells[0].source


def code_lines(src: str) -> list:
    "The lines of a cell that are code: no blanks, comments or magics"
    return [l for l in src.splitlines() if l.strip() and not l.strip().startswith(('#', '%', '!'))]


def test_every_notebook_is_a_library_phase():
    "The 15 phase notebooks and the registered phases are the same set, stem for stem"
    ps = phases()
    assert len(NOTEBOOKS) == 15
    assert {phase_key(s): s for s in NOTEBOOKS} == {k: ph.stem for k, ph in ps.items()}


@pytest.mark.parametrize('stem', list(NOTEBOOKS))
def test_parameters_cell_is_params(stem):
    "The notebook's parameters cell is `parameters_source(Params)`: same names, types, defaults and help"
    ph = phases()[phase_key(stem)]
    src = params_cell(NOTEBOOKS[stem])
    assert src == parameters_source(ph.Params), f'{stem}: rewrite its parameters cell from eagle3nb.phases.{ph.key}'
    got = cell_parameters(src)
    assert list(got) == ['recipe', 'run_dir', *ph.Params.model_fields]
    assert {k: v for k, (_, v) in got.items() if k not in ('recipe', 'run_dir')} == ph.Params.defaults()


def verb_argv(key: str) -> list:
    "The shortest command line of phase `key`'s verb: the verb and a recipe (a tool verb's positional takes it)"
    return [key.replace('_', '-'), 'r.yaml']


@pytest.mark.parametrize('stem', list(NOTEBOOKS))
def test_cli_defaults_are_params(stem):
    "The verb's flags parse, unset, to the phase's defaults; given, each reaches the phase's field"
    ph = phases()[phase_key(stem)]
    a = parse_cli(verb_argv(ph.key))[1]
    assert a.phase == ph.key
    assert {k: getattr(a, k) for k in ph.Params.model_fields} == ph.Params.defaults()
    given = parse_cli(verb_argv(ph.key), suppress=True)[1]
    assert not [k for k in ph.Params.model_fields if hasattr(given, k)], 'nothing given, nothing overrides the recipe'


@pytest.mark.parametrize('stem', list(NOTEBOOKS))
def test_notebook_is_thin(stem):
    "No orchestration in a phase notebook: its largest code cell at most 12 lines, at most 4 if/for/while/try/with"
    nb = nbformat.read(NOTEBOOKS[stem], 4)
    cells = [c.source for c in nb.cells if c.cell_type == 'code' and 'parameters' not in c.metadata.get('tags', [])]
    largest = max(len(code_lines(c)) for c in cells)
    control = sum(isinstance(n, CONTROL) for c in cells for n in ast.walk(ast.parse('\n'.join(code_lines(c)))))
    assert largest <= 12, f'{stem}: a cell of {largest} lines; move the logic into eagle3nb.phases'
    assert control <= 4, f'{stem}: {control} control statements; move the logic into eagle3nb.phases'
    src = '\n'.join(cells)
    assert '.run(ctx, p)' in src and 'RunContext.open(recipe, run_dir' in src


def test_cli_starts_without_the_heavy_libraries():
    "Building the parser reads every phase's Params without importing torch, transformers or datasets"
    import subprocess
    import sys

    code = (
        "import sys; from eagle3nb.cli import parser; parser(); "
        "print(sorted(m for m in ('torch', 'transformers', 'datasets', 'duckdb') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == '[]', f'imported at CLI start: {out}'


@pytest.mark.parametrize('stem', list(NOTEBOOKS))
def test_notebook_names_its_kernel(stem):
    "papermill needs the notebook's kernelspec (its language) to execute it: every phase notebook carries one"
    ks = nbformat.read(NOTEBOOKS[stem], 4).metadata.get('kernelspec', {})
    assert ks.get('name') == 'python3' and ks.get('language') == 'python', f'{stem}: kernelspec {ks}'


def store_recipe(tmp_path: Path) -> Path:
    "A recipe on kimi-tiny whose data root holds what the train phase reads: a bf16 store of toy samples and a vocab"
    import yaml
    from eagle3nb.phase import RunContext, smoke_recipe
    from eagle3nb.phases.train import Inputs, smoke_inputs, toy_store
    from eagle3nb.train import toy_samples

    r = smoke_recipe(tmp_path / 'r')
    ctx = RunContext.open(r, tmp_path / 'setup')
    ts = toy_samples(n=4, new_tokens=16, eval_n=2, final=True)
    inp = smoke_inputs(ctx)
    toy_store(ctx.data_root, Inputs(ts['train'], ts['eval'], ts['embed'], None, ts['config'], inp.d2t, inp.t2d))
    d = r.model_dump(mode='json')
    d['target']['model'] = ctx.target
    d['phases'] = dict(train=dict(max_steps=2, warmup_steps=1, batch_size=1, ckpt_every=2, eval_every=2, ttt_steps=2))
    p = tmp_path / 'r.yaml'
    p.write_text(yaml.safe_dump(d))
    return p


def test_train_verb_and_run_on_two_ranks(tmp_path):
    "`torchrun -m eagle3nb train RECIPE` and `eagle3nb run RECIPE --phases train --nproc 2`: 2 gloo ranks, one record"
    import json
    import subprocess
    import sys

    from eagle3nb.phases.train import run as train_phase

    recipe = store_recipe(tmp_path)
    env = {**__import__('os').environ, 'OMP_NUM_THREADS': '1'}
    torchrun = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node', '2']
    verb = [*torchrun, '-m', 'eagle3nb', 'train', str(recipe), '--run-dir', str(tmp_path / 'verb'), '--no-progress']
    p = subprocess.run(verb, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rec = train_phase.read(tmp_path / 'verb')
    assert (rec.ranks, rec.steps) == (2, 2) and (tmp_path / 'verb' / 'checkpoints' / 'step_2').is_dir()
    assert p.stdout.count('train: eval accept length') == 1, p.stdout  # rank 0 alone prints the headline
    rid = f'pytest-nproc-{tmp_path.name[-8:]}'
    run = [str(Path(sys.executable).parent / 'eagle3nb'), 'run', str(recipe), '--run-id', rid, '--phases', 'train']
    try:
        p = subprocess.run([*run, '--nproc', '2'], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        rd = ROOT / 'papermill_runs' / rid
        assert (rd / '60_train.ipynb').is_file() and (rd / '60_train.rank1.ipynb').is_file()  # a record per rank
        assert train_phase.read(rd).ranks == 2
        assert json.loads((rd / 'run.json').read_text())['phases']['60_train']['status'] == 'completed'
    finally:
        import shutil

        shutil.rmtree(ROOT / 'papermill_runs' / rid, ignore_errors=True)
