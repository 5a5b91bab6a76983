"""Render throughput: eagle3nb.render side by side with SpecForge 0.2.0's `preprocess_conversations`, in one run.

    bash bench/setup_bench_venv.sh                          # once: .venv-bench with eagle3nb AND specforge==0.2.0
    .venv-bench/bin/python bench/render.py [--n 3000] [--repeat 5] [--toys kimi-tiny qwen3-tiny]
        [--turns 10,25,50,100,200,400]
    .venv-bench/bin/python bench/render.py --n 0 --toys kimi-k25-tiny --turns 10,100   # the slow remote-code tokenizer

Both sides get the same conversations and the same tokenizer files, in one process, one core (OMP_NUM_THREADS=1,
TOKENIZERS_PARALLELISM=false, as the Makefile sets them), and each does render + tokenize + loss mask:
  specforge  specforge.data.preprocessing.preprocess_conversations(tok, messages, template, tools=...): the target's
             chat template over the whole conversation, one tokenization, then per assistant turn a regex over the
             text for `assistant_header ... end_of_turn_token` and two re-tokenizations of the text up to the span's
             start and end to find its token indices. Templates: SpecForge's own registry entries `kimi-k2-thinking`
             (kimi-tiny) and `qwen3-thinking` (qwen3-tiny), both its ThinkingParser with enable_thinking, with one
             change: system_prompt=None, so that SpecForge does not insert "You are a helpful assistant." where the
             conversation has no system turn and both sides render the target template's own text.
             max_length=2**30, so nothing is truncated.
  eagle3nb   eagle3nb.render.render_conversations(convs, tok, thinking=True, merge=True): one prompt per assistant
             turn (generation event) from the chat template, the completion as the target emits it, masks from
             the token boundary between the two, events merged into one row where each continues the previous one.
             Without the Arrow/datasets plumbing of render_dataset (that is I/O, not the algorithm).
specforge 0.2.0 is installed with --no-deps; its preprocessing import path needs only torch, transformers, datasets,
tqdm and pydantic (eagle3nb's own pins), so nothing is stubbed.

Conversations: every demo recipe dataset with answers (recipes/demo.yaml, the shipped fixtures; not the prompt-only
ones) through eagle3nb.prepare.prepare, 16 canonical conversations; each copy given a unique ' #i' on its user/assistant texts, and grouped by shape:
  plain      user/assistant turns (a system turn allowed), no reasoning, no tools
  tools      tools declared and/or tool calls and tool results, no reasoning
  reasoning  assistant turns with reasoning_content (in these fixtures they all also use tools)
Each shape gets N/3 copies of its seeds. Timings are the best of --repeat rounds, the two sides alternating.
conv/s counts input conversations (the same for both sides, so E3/SF is the speed ratio); tok/s counts the tokens each
side outputs (eagle3nb may emit more than one row per conversation, each with its full prefix: `E3 rows`).
`all` = all conversations / summed times.

Long agent trajectories (--turns, on the first toy of --toys; kimi-tiny by default): for each number of turns T, one
synthetic trajectory: a system and a user turn, then T turns of reasoning (~80 words) + content (~20) + one tool call,
each followed by its tool result (~150 words), and a final reasoned answer, about 350 tokens a turn; every word drawn
from a seeded generator, so no two turns are alike. Both sides render it; eagle3nb best of --repeat, SpecForge best of
--repeat too unless one round takes more than --sf-round-s seconds (then that one round), and only up to --sf-max-turns
turns (its cost grows faster than the square of the turns: 400 turns would take many minutes). tok/s counts output tokens;
`renders` is eagle3nb's chat-template renders for the trajectory (`fallback` would name a per-event fallback).
--n 0 skips the short chat shapes, --turns '' the trajectories.

kimi-k25-tiny is packaged as Kimi-K2.5 ships: a remote-code, slow tokenizer (`TikTokenTokenizer`, tiktoken ranks, no
offsets) whose own `apply_chat_template` declares the tools in TypeScript. Both sides load it with
trust_remote_code=True. SpecForge takes it as it is: its parser renders through `tokenizer.apply_chat_template` and
finds the spans by re-encoding the text up to each span's ends with the tokenizer itself (no offsets needed), so it
runs on the slow tokenizer, with the same `kimi-k2-thinking` registry entry. eagle3nb renders through the same
method and encodes with the fast twin of the slow tokenizer, checking every text it encoded against the slow
tokenizer; the twin is built once per tokenizer, before the timings (`twin build` says how long it took), and
`encoding` says what eagle3nb encoded with.

Agreement, per conversation: `same` = eagle3nb made one row whose input_ids and loss_mask equal SpecForge's;
`same sup` = the supervised (mask 1) token sequences are equal, eagle3nb's rows taken in order (ids differ elsewhere);
`differ` = the supervised tokens differ; `SF sup tok` / `E3 sup tok` = supervised tokens in all. After the table, per
toy and shape with differences: the runs of supervised tokens that only one side has (difflib over the two supervised
sequences), each with the number of conversations it occurs in.
"""

import argparse, copy, os, random, sys, tempfile, time, warnings
from collections import Counter
from difflib import SequenceMatcher
from pathlib import Path

os.environ.setdefault('OMP_NUM_THREADS', '1')
os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')
os.environ.setdefault('HF_HUB_OFFLINE', '1')
ROOT = Path(__file__).resolve().parent.parent
try:
    from specforge.data.preprocessing import preprocess_conversations
    from specforge.data.template import TEMPLATE_REGISTRY
except ImportError as e:
    sys.exit(
        f"bench/render.py needs specforge ({e}): run `bash bench/setup_bench_venv.sh`, then `.venv-bench/bin/python bench/render.py`"
    )
import yaml
from transformers import AutoTokenizer
from eagle3nb.prepare import prepare, conversations
from eagle3nb.render import render_conversations, render_encoding, render_tokenizer
from eagle3nb.schema import conversation, message, tool_call
from eagle3nb.toy import SAMPLE_TOOLS
from eagle3nb.toy import ensure_toy

TOYS = {
    'kimi-tiny': 'kimi-k2-thinking',
    'qwen3-tiny': 'qwen3-thinking',
    'kimi-k25-tiny': 'kimi-k2-thinking',
}  # toy -> SpecForge template
REMOTE = {'kimi-k25-tiny'}  # toys whose tokenizer is remote code (loaded with trust_remote_code=True)
SHAPES = ('plain', 'tools', 'reasoning')


def load(toy):
    "Two tokenizers from the toy's files (no shared state), and a line on how eagle3nb encodes with its own"
    d = ensure_toy(toy)
    tok_sf, tok_e3 = (AutoTokenizer.from_pretrained(d, trust_remote_code=toy in REMOTE) for _ in range(2))
    t0 = time.perf_counter()
    render_tokenizer(tok_e3)  # a slow tokenizer's fast twin, built once
    note = f"{toy}: {type(tok_e3).__name__} (fast: {tok_e3.is_fast}); eagle3nb encoding: {render_encoding(tok_e3)}"
    if not tok_e3.is_fast:
        note += f'; twin build {time.perf_counter() - t0:.3f} s'
    print(note, file=sys.stderr, flush=True)
    return tok_sf, tok_e3, note


def seeds(tmp):
    "The canonical conversations of every demo recipe dataset with answers (the prompt-only ones have nothing to supervise)"
    out = []
    for d in (
        d
        for d in yaml.safe_load((ROOT / 'recipes' / 'demo.yaml').read_text())['datasets']
        if d.get('kind') != 'prompt_only'
    ):
        prepare(ROOT / d['path'], d['format'], d['name'], tmp, progress=False)
        out += list(conversations(tmp / d['name']))
    return out


def shape(c):
    ms = c['messages']
    if any(m.get('reasoning_content') for m in ms):
        return 'reasoning'
    if c['tools'] or any(m.get('tool_calls') or m['role'] == 'tool' for m in ms):
        return 'tools'
    return 'plain'


def vary(c, i):
    "A copy of `c` with ' #i' after each non-empty user/assistant text"
    c = copy.deepcopy(c)
    c['sample_id'] = f"{c['sample_id']}-{i}"
    for m in c['messages']:
        if m['role'] in ('user', 'assistant') and m['content'].strip():
            m['content'] += f' #{i}'
    return c


def run_specforge(tok, tmpl, convs):
    out = preprocess_conversations(
        tok, [c['messages'] for c in convs], tmpl, max_length=2**30, tools=[c['tools'] for c in convs]
    )
    return [(i[0].tolist(), m[0].tolist()) for i, m in zip(out['input_ids'], out['loss_mask'])]


def run_eagle3nb(tok, convs):
    return render_conversations(convs, tok, thinking=True, merge=True)


def timed(f, *a):
    t = time.perf_counter()
    r = f(*a)
    return time.perf_counter() - t, r


def sup(ids, mask):
    return [t for t, m in zip(ids, mask) if m]


def compare(convs, sf, rows):
    "Per-conversation agreement counts, supervised-token totals, and per seed: differing copies and one of them"
    by = {}
    for r in rows:
        by.setdefault(r['conversation_id'], []).append(r)
    n = dict(same=0, same_sup=0, differ=0, sf_sup=0, e3_sup=0, e3_rows=0, e3_rejects=0)
    diffs = {}
    for c, (ids, mask) in zip(convs, sf):
        rs = by.get(c['sample_id'], [])
        ok = [r for r in rs if 'reject' not in r]
        n['e3_rows'] += len(ok)
        n['e3_rejects'] += len(rs) - len(ok)
        a, b = sup(ids, mask), [t for r in ok for t in sup(r['input_ids'], r['loss_mask'])]
        n['sf_sup'] += len(a)
        n['e3_sup'] += len(b)
        if len(ok) == 1 and ok[0]['input_ids'] == ids and ok[0]['loss_mask'] == mask:
            n['same'] += 1
        elif a == b:
            n['same_sup'] += 1
        else:
            n['differ'] += 1
            d = diffs.setdefault(c['sample_id'].rsplit('-', 1)[0], [0, a, b])
            d[0] += 1
    return n, diffs


def _trim(t):
    return t.strip() or t  # '<think>\n\n</think>\n' and '...\n\n' are one run, aligned apart


def explain(tok, diffs, top=3):
    "The token runs that only one side supervises (difflib over the supervised sequences, outer whitespace trimmed), counted in conversations"
    only = dict(specforge=Counter(), eagle3nb=Counter())
    for k, a, b in diffs.values():
        seen = dict(specforge=set(), eagle3nb=set())
        for op, i1, i2, j1, j2 in SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
            if op in ('delete', 'replace'):
                seen['specforge'].add(_trim(tok.decode(a[i1:i2])))
            if op in ('insert', 'replace'):
                seen['eagle3nb'].add(_trim(tok.decode(b[j1:j2])))
        for side, runs in seen.items():
            for r in runs:
                only[side][r] += k
    short = lambda t: repr(t if len(t) <= 40 else t[:28] + '...' + t[-9:])
    return '\n'.join(
        f"      only {side:9s}: "
        + (
            '; '.join(f'{short(t)} in {k}' for t, k in c.most_common(top))
            + (f'; {len(c) - top} more' if len(c) > top else '')
            if c
            else '-'
        )
        for side, c in only.items()
    )


WORDS = (
    'the a file test function error value return import class module path line fix patch check run output list '
    'assert config parse token branch commit build failing passes expected got raise call'
).split()


def trajectory(n, seed=0):
    "A synthetic agent trajectory of `n` turns: reasoning + content + one tool call, then its result; a reasoned answer last"
    r = random.Random(seed)
    w = lambda k: ' '.join(r.choice(WORDS) for _ in range(k))
    ms = [message('system', 'You are a coding agent. ' + w(20)), message('user', 'Fix the failing test. ' + w(40))]
    for t in range(n):
        ms += [
            message(
                'assistant',
                w(20),
                reasoning_content=w(80),
                tool_calls=[tool_call('bash', {'command': f'grep -n "{w(3)}" src/m{t}.py'})],
            ),
            message('tool', w(150)),
        ]
    ms.append(message('assistant', 'Done. ' + w(30), reasoning_content=w(40)))
    return conversation('bench-traj', n, ms, tools=SAMPLE_TOOLS)


def turns_table(toy, turns, repeat, sf_round_s, sf_max_turns):
    "Render seconds and tokens/s by trajectory length, both sides, same trajectory"
    tok_sf, tok_e3, note = load(toy)
    tmpl = TEMPLATE_REGISTRY.get(TOYS[toy]).model_copy(update=dict(system_prompt=None))
    run_specforge(tok_sf, tmpl, [trajectory(3)])
    run_eagle3nb(tok_e3, [trajectory(3)])  # warm-up
    hdr = (
        f"{'toy':13s} {'turns':>5s} {'SF tokens':>9s} {'SF s':>8s} {'SF tok/s':>9s} {'E3 rows':>7s} {'E3 tokens':>9s} {'E3 s':>7s} "
        f"{'E3 tok/s':>9s} {'E3/SF':>7s} {'renders':>7s}  {'same':>4s} {'same sup':>8s} {'differ':>6s} {'SF sup tok':>10s} {'E3 sup tok':>10s}"
    )
    lines, rates = [note, hdr], {}
    for n in turns:
        convs = [trajectory(n, seed=n)]
        t_e3 = t_sf = float('inf')
        for _ in range(repeat):
            t, rows = timed(run_eagle3nb, tok_e3, convs)
            t_e3 = min(t_e3, t)
        n_e3 = sum(len(r['input_ids']) for r in rows if 'reject' not in r)
        rates[n] = n_e3 / t_e3
        fb = {r['fallback'] for r in rows if r.get('fallback')}
        e3 = f"{len([r for r in rows if 'reject' not in r]):7d} {n_e3:9,d} {t_e3:7.3f} {n_e3 / t_e3:9,.0f}"
        if n > sf_max_turns:  # SpecForge's cost grows faster than the square of the turns: minutes beyond this
            lines.append(
                f"{toy:13s} {n:5d} {'-':>9s} {'-':>8s} {'-':>9s} {e3} {'-':>7s} {sum(r.get('renders', 0) for r in rows):7d}"
            )
            print(lines[-1], file=sys.stderr, flush=True)
            continue
        for _ in range(repeat):
            t, sf = timed(run_specforge, tok_sf, tmpl, convs)
            t_sf = min(t_sf, t)
            if t > sf_round_s:
                break
        n_sf = sum(len(i) for i, _ in sf)
        agree, _ = compare(convs, sf, rows)
        lines.append(
            f"{toy:13s} {n:5d} {n_sf:9,d} {t_sf:8.3f} {n_sf / t_sf:9,.0f} {e3} "
            f"{t_sf / t_e3:6.1f}x {sum(r.get('renders', 0) for r in rows):7d}  {agree['same']:4d} {agree['same_sup']:8d} {agree['differ']:6d} "
            f"{agree['sf_sup']:10,d} {agree['e3_sup']:10,d}" + (f"  fallback: {', '.join(fb)}" if fb else '')
        )
        print(lines[-1], file=sys.stderr, flush=True)
    lo, hi = min(rates), max(rates)
    lines.append(f"eagle3nb tok/s at {hi} turns / at {lo} turns: {rates[hi] / rates[lo]:.2f}")
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--n', type=int, default=3000, help='conversations per toy, split evenly over the shapes')
    ap.add_argument('--repeat', type=int, default=5, help='timing rounds; the best is kept')
    ap.add_argument('--toys', nargs='+', default=list(TOYS), choices=list(TOYS))
    ap.add_argument('--turns', default='10,25,50,100,200,400', help="trajectory lengths, comma-separated ('' to skip)")
    ap.add_argument(
        '--sf-round-s', type=float, default=20.0, help='SpecForge trajectory rounds stop after one this slow'
    )
    ap.add_argument(
        '--sf-max-turns', type=int, default=200, help='SpecForge renders trajectories up to this many turns'
    )
    a = ap.parse_args()
    turns = [int(x) for x in a.turns.split(',') if x.strip()]
    if turns:
        print('\n'.join(turns_table(a.toys[0], turns, a.repeat, a.sf_round_s, a.sf_max_turns)) + '\n', flush=True)
    if not a.n:
        return
    warnings.simplefilter('ignore')  # SpecForge warns once per conversation that has its own system turn
    S = seeds(Path(tempfile.mkdtemp(prefix='e3nb-bench-render-')))
    per = {s: [c for c in S if shape(c) == s] for s in SHAPES}
    k = a.n // len(SHAPES)
    sets = {s: [vary(cs[i % len(cs)], i) for i in range(k)] for s, cs in per.items()}
    print(
        f"seeds: {len(S)} demo conversations ({', '.join(f'{s} {len(v)}' for s, v in per.items())}); "
        f"{k} copies per shape; best of {a.repeat}\n"
    )
    hdr = (
        f"{'toy':13s} {'shape':9s} {'convs':>5s} {'SF conv/s':>9s} {'SF tok/s':>9s} {'E3 conv/s':>9s} {'E3 rows':>7s} "
        f"{'E3 tok/s':>9s} {'E3/SF':>6s}  {'same':>5s} {'same sup':>8s} {'differ':>6s} {'SF sup tok':>10s} {'E3 sup tok':>10s}"
    )
    lines, examples = [hdr], []
    for toy in a.toys:
        tok_sf, tok_e3, note = load(toy)  # same files, no shared state
        lines.append(note)
        tmpl = TEMPLATE_REGISTRY.get(TOYS[toy]).model_copy(update=dict(system_prompt=None))
        tot = dict(n=0, t_sf=0.0, t_e3=0.0, tok_sf=0, tok_e3=0, rows=0)
        for shp, convs in sets.items():
            run_specforge(tok_sf, tmpl, convs[:50])
            run_eagle3nb(tok_e3, convs[:50])  # warm-up: template compile, caches
            t_sf = t_e3 = float('inf')
            for _ in range(a.repeat):
                t, sf = timed(run_specforge, tok_sf, tmpl, convs)
                t_sf = min(t_sf, t)
                t, rows = timed(run_eagle3nb, tok_e3, convs)
                t_e3 = min(t_e3, t)
            n_sf = sum(len(i) for i, _ in sf)
            n_e3 = sum(len(r['input_ids']) for r in rows if 'reject' not in r)
            agree, diffs = compare(convs, sf, rows)
            if diffs:
                examples.append(f"  {toy} {shp}: {agree['differ']} of {len(convs)} differ\n" + explain(tok_e3, diffs))
            N = len(convs)
            lines.append(
                f"{toy:13s} {shp:9s} {N:5d} {N / t_sf:9,.0f} {n_sf / t_sf:9,.0f} {N / t_e3:9,.0f} {agree['e3_rows']:7d} {n_e3 / t_e3:9,.0f} "
                f"{t_sf / t_e3:5.2f}x  {agree['same']:5d} {agree['same_sup']:8d} {agree['differ']:6d} {agree['sf_sup']:10,d} {agree['e3_sup']:10,d}"
                + (f"  ({agree['e3_rejects']} eagle3nb rejects)" if agree['e3_rejects'] else '')
            )
            for key, v in (
                ('n', N),
                ('t_sf', t_sf),
                ('t_e3', t_e3),
                ('tok_sf', n_sf),
                ('tok_e3', n_e3),
                ('rows', agree['e3_rows']),
            ):
                tot[key] += v
            print(lines[-1], file=sys.stderr, flush=True)
        lines.append(
            f"{toy:13s} {'all':9s} {tot['n']:5d} {tot['n'] / tot['t_sf']:9,.0f} {tot['tok_sf'] / tot['t_sf']:9,.0f} {tot['n'] / tot['t_e3']:9,.0f} "
            f"{tot['rows']:7d} {tot['tok_e3'] / tot['t_e3']:9,.0f} {tot['t_sf'] / tot['t_e3']:5.2f}x"
        )
    print('\n'.join(lines))
    if examples:
        print(
            '\nwhere the supervised tokens differ: runs supervised by one side only, and in how many conversations:\n'
            + '\n'.join(examples)
        )


if __name__ == '__main__':
    main()
