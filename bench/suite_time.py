"""How long a newcomer waits: `make test` (and, with --demo, `make demo`) on a fresh clone of a commit, toys cold.

Each command runs in its own fresh clone (`git clone` of the commit, no venvs, no build outputs), with its own empty toy
cache (EAGLE3NB_CACHE), so the trained toys are built inside the clock, as on CI and on a new user's machine. pip's own
cache is left as it is (warm on a machine that has installed the packages once). Every output line is time-stamped as
it arrives, so the report splits the wall time by make step (venvs, format/export checks, notebooks, docs, pytest) and
lists the slowest tests (pytest --durations) and the slowest notebooks (nbdev_test --timing).

    python bench/suite_time.py                      # make test on a clone of HEAD
    python bench/suite_time.py --demo --ref main    # make demo, then make test, each on its own clone
    python bench/suite_time.py --log out.txt        # also keep the time-stamped output

Run it on an otherwise idle machine: the figures are wall time on whatever cores the machine has (`nproc` is printed).
"""

import argparse, os, re, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the line make prints when it starts each step of `make test`, in order (Makefile)
STEPS = [
    ('venvs', re.compile(r'^(test -x \.venv/bin/python|\.venv/bin/pip|engine 1/4|engine sglang 1/3)')),
    ('format + export checks', re.compile(r'^(\.venv/bin/ruff format --check|@?\.venv/bin/nbdev_export)')),
    ('notebooks (nbdev_test)', re.compile(r'^\.venv/bin/nbdev_test')),
    ('docs', re.compile(r'^rm -rf _proc')),
    ('pytest', re.compile(r'^\.venv/bin/pytest')),
    ('the demo run', re.compile(r'^(OMP_NUM_THREADS=\d+ )?\.venv/bin/eagle3nb run')),
]


def clone(ref: str, where: Path) -> Path:
    "A fresh clone of `ref` of this repository in `where`"
    d = where / 'clone'
    subprocess.run(['git', 'clone', '-q', '--no-hardlinks', str(ROOT), str(d)], check=True)
    subprocess.run(['git', '-C', str(d), 'checkout', '-q', ref], check=True)
    return d


def timed(cmd: list, cwd: Path, env: dict, log) -> tuple:  # (exit code, [(seconds since start, line)])
    "Run `cmd`, each output line stamped with the seconds since it started"
    t0, lines = time.monotonic(), []
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    for line in p.stdout:
        t = time.monotonic() - t0
        lines.append((t, line.rstrip('\n')))
        if log:
            log.write(f'{t:8.1f} {line}')
            log.flush()
    return p.wait(), lines


def split(lines: list, total: float) -> list:  # [(step, seconds)]
    "Wall time per make step, from the first line of each step to the first line of the next"
    starts = []
    for name, pat in STEPS:
        t = next((t for t, l in lines if pat.search(l)), None)
        if t is not None and not any(n == name for n, _ in starts):
            starts.append((name, t))
    starts.sort(key=lambda x: x[1])
    ends = [t for _, t in starts[1:]] + [total]
    return [(n, e - s) for (n, s), e in zip(starts, ends)]


def slowest_tests(lines: list, n: int) -> list:  # [(seconds, phase, test)]
    "pytest's --durations section: its slowest `n` entries"
    out = []
    for _, l in lines:
        m = re.match(r'^(\d+\.\d+)s (call|setup|teardown)\s+(\S+)', l)
        if m:
            out.append((float(m[1]), m[2], m[3]))
    return sorted(out, reverse=True)[:n]


def slowest_notebooks(lines: list, n: int) -> list:  # [(seconds, notebook)]
    "nbdev_test --timing's lines: its slowest `n` notebooks"
    out = [(int(m[2]), m[1]) for _, l in lines if (m := re.match(r'^(\S+\.ipynb): (\d+) secs$', l))]
    return sorted(out, reverse=True)[:n]


def run_make(target: str, ref: str, log) -> dict:
    "`make target` on a fresh clone of `ref` with an empty toy cache: exit code, wall time, its lines"
    with tempfile.TemporaryDirectory(prefix='e3nb-suite-') as tmp:
        d = clone(ref, Path(tmp))
        env = {k: v for k, v in os.environ.items() if not k.startswith(('EAGLE3NB_', 'VIRTUAL_ENV'))}
        env['EAGLE3NB_CACHE'] = str(Path(tmp) / 'cache')  # toys cold
        t0 = time.monotonic()
        rc, lines = timed(['make', target], d, env, log)
        return dict(target=target, rc=rc, seconds=time.monotonic() - t0, lines=lines)


def report(r: dict, n: int):
    mins = r['seconds'] / 60
    print(f"\n## make {r['target']}: {mins:.1f} min, exit {r['rc']} ({os.cpu_count()} cores)")
    for name, s in split(r['lines'], r['seconds']):
        print(f'  {name:24s} {s / 60:6.1f} min')
    if t := slowest_tests(r['lines'], n):
        print(f'\nslowest {len(t)} tests:')
        for s, ph, name in t:
            print(f'  {s:7.1f} s  {ph:8s} {name}')
    if nb := slowest_notebooks(r['lines'], n):
        print(f'\nslowest {len(nb)} notebooks:')
        for s, name in nb:
            print(f'  {s:7d} s  {name}')
    if r['rc']:
        print('\nlast lines:\n' + '\n'.join(l for _, l in r['lines'][-30:]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--ref', default='HEAD', help='the commit to clone (default HEAD)')
    ap.add_argument('--demo', action='store_true', help='make demo first, on a clone of its own')
    ap.add_argument('--slowest', type=int, default=15, help='tests and notebooks listed')
    ap.add_argument('--log', help='keep the time-stamped output here')
    a = ap.parse_args(argv)
    ref = subprocess.run(['git', '-C', str(ROOT), 'rev-parse', a.ref], capture_output=True, text=True, check=True)
    ref = ref.stdout.strip()
    print(f'commit {ref[:10]}, {os.cpu_count()} cores, toys cold, pip cache as it is')
    log = open(a.log, 'w') if a.log else None
    results = [run_make(t, ref, log) for t in (['demo'] if a.demo else []) + ['test']]
    for r in results:
        report(r, a.slowest)
    return max(r['rc'] for r in results)


if __name__ == '__main__':
    sys.exit(main())
