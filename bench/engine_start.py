"""How long a vLLM server of a CPU toy takes to answer, with its worker inside the engine core (`engine.CPU_ONE_WORKER`,
what eagle3nb starts on a CPU build) and with vLLM's own three processes, side by side in one run.

    python bench/engine_start.py            # qwen3-tiny, 2 rounds
    python bench/engine_start.py --toy kimi-tiny --rounds 3

Each round starts and stops one server of each kind in turn (ready = listed and a first completion answered), so
both see the same machine. Run it on an otherwise idle machine.
"""

import argparse, statistics, sys, tempfile, time
from pathlib import Path

import eagle3nb.engine as engine
from eagle3nb.engine import CPU_ONE_WORKER, VllmServer, group_pids
from eagle3nb.toy import ensure_toy


def ready_seconds(model: Path, one_worker: bool, log: Path) -> tuple:  # (seconds to ready, processes in its group)
    engine.CPU_ONE_WORKER = CPU_ONE_WORKER if one_worker else ([], {})  # what VllmServer reads when it builds argv
    try:
        s = VllmServer(model, log_path=log)
        t0 = time.monotonic()
        s.start()
        s.wait_ready()
        t = time.monotonic() - t0
        n = len(group_pids(s.pid))
        s.stop()
        return t, n
    finally:
        engine.CPU_ONE_WORKER = CPU_ONE_WORKER


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--toy', default='qwen3-tiny')
    ap.add_argument('--rounds', type=int, default=2)
    a = ap.parse_args(argv)
    model, logs = ensure_toy(a.toy), Path(tempfile.mkdtemp(prefix='e3nb-start-'))
    got = {True: [], False: []}
    for r in range(a.rounds):
        for one in (True, False):
            t, n = ready_seconds(model, one, logs / f'{r}-{int(one)}.log')
            got[one].append(t)
            print(f"round {r + 1}: {'one worker (uni)' if one else 'vLLM default (mp)':18s} {t:5.1f} s, {n} processes")
    one, mp = statistics.median(got[True]), statistics.median(got[False])
    print(f'\n{a.toy}: median ready {one:.1f} s with the worker in the engine core, {mp:.1f} s with its own process')
    print(f'ratio {mp / one:.2f}x; {mp - one:.1f} s saved a server start')
    return 0


if __name__ == '__main__':
    sys.exit(main())
