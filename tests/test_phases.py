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
    "The 14 phase notebooks and the registered phases are the same set, stem for stem"
    ps = phases()
    assert len(NOTEBOOKS) == 14
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
