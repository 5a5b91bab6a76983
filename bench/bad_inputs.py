"""Throw the bad inputs of `tests/test_bad_input.py` at every `eagle3nb` verb and count the outcomes per kind:
clear (exit code and a one-line message naming the thing), vague, traceback, silent (exit 0), data lost (a file that
was there before changed or went away). `python bench/bad_inputs.py` prints one line per case and the counts (`-k TEXT`: only the cases named so)."""

import argparse, os, shutil, sys, tempfile
from collections import Counter
from pathlib import Path

os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('OMP_NUM_THREADS', '1')
os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / 'tests'))
from test_bad_input import build_shared, cases, sums, call, classify, error_lines


def run_case(c: dict, S: dict, d: Path) -> tuple:
    "(category, result) of case `c` in the fresh folder `d`"
    d.mkdir(parents=True, exist_ok=True)
    c = dict(c, dir=d)
    c['setup'](d, S)
    argv = c['argv'](d, S)
    before = sums(d, S['toy'], S['ckpt'].parent.parent)
    res = call(argv, d)
    return classify(c, res, before, sums(d, S['toy'], S['ckpt'].parent.parent)), res


def _last(res) -> str:
    lines = (
        error_lines(res)
        or (res['tb'] or '').strip().splitlines()[-1:]
        or (res['out'] + res['err']).strip().splitlines()[-1:]
        or ['']
    )
    return lines[0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('-k', default='', help='only the cases whose name holds this text')
    a = ap.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix='e3nb-bad-'))
    S, n = build_shared(base, toy=os.environ.get('E3NB_TOY')), Counter()
    for i, c in enumerate(cases()):
        if a.k not in c['name']:
            continue
        cat, res = run_case(c, S, base / f'c{i:02d}')
        n[cat] += 1
        print(f"{cat:10s} rc={res['code']} {c['name']}: {_last(res)[:150]}", flush=True)
    print(dict(n), 'total', sum(n.values()))
    shutil.rmtree(base, ignore_errors=True)


if __name__ == '__main__':
    main()
