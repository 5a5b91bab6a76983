"`eagle3nb prepare` end to end: the directory it writes, idempotence, nothing lost, clear errors"
import json, os, subprocess, sys
from pathlib import Path
import pyarrow.parquet as pq
from eagle3nb.prepare import conversations, read_manifest, prepare

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT/'tests'/'fixtures'/'datasets'
EAGLE3NB = str(Path(sys.executable).parent/'eagle3nb')


def cli(*args):
    return subprocess.run([EAGLE3NB, 'prepare', *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_cli_writes_shards_manifest_rejects_and_is_idempotent(tmp_path):
    p = cli('--format', 'openai', '--input', FIX/'llamafactory_reason_tool_use_demo.sample.jsonl', '--name', 'lf', '--out', tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    d = tmp_path/'lf'
    m = read_manifest(d)
    assert (m['read'], m['kept'], m['rejected']) == (4, 4, 0) and m['params']['format'] == 'openai'
    assert sorted(f.name for f in d.iterdir()) == ['data-00000-of-00001.parquet', 'manifest.json', 'rejects.jsonl']
    assert pq.read_table(d/m['shards'][0]).num_rows == 4
    calls = [tc for c in conversations(d) for msg in c['messages'] for tc in (msg['tool_calls'] or [])]
    assert calls and all(isinstance(tc['function']['arguments'], dict) and tc['id'].startswith('functions.') for tc in calls)
    before = (d/'manifest.json').stat().st_mtime_ns
    assert cli('--format', 'openai', '--input', FIX/'llamafactory_reason_tool_use_demo.sample.jsonl', '--name', 'lf', '--out', tmp_path).returncode == 0
    assert (d/'manifest.json').stat().st_mtime_ns == before  # same input and parameters: nothing rewritten


def test_rejects_are_written_with_reason_and_excerpt(tmp_path):
    m = prepare(FIX/'specforge_tool_use_conversation.jsonl', 'openai', 'sf', tmp_path, progress=False, allow_empty=True)
    assert (m['read'], m['kept'], m['rejected']) == (1, 0, 1)
    rej = [json.loads(l) for l in open(tmp_path/'sf'/'rejects.jsonl')]
    assert rej[0]['index'] == 0 and rej[0]['reason'] == 'tool call arguments are not valid JSON' and '"id": 9' in rej[0]['excerpt']


def test_every_demo_dataset_accounts_for_every_record(tmp_path):
    "The demo recipe's datasets: kept + rejected = read, per dataset, and ids are unique"
    import yaml
    r = yaml.safe_load((ROOT/'recipes'/'demo.yaml').read_text())
    for ds in r['datasets']:
        m = prepare(ROOT/ds['path'], ds['format'], ds['name'], tmp_path, progress=False)
        assert m['kept'] + m['rejected'] == m['read'] > 0, (ds['name'], m)
        ids = [c['sample_id'] for c in conversations(tmp_path/ds['name'])]
        assert len(ids) == len(set(ids)) == m['kept']


def test_count_sampling_is_seeded_and_keeps_source_ids(tmp_path):
    a = prepare(FIX/'alpaca_en_demo.sample.json', 'alpaca', 'a', tmp_path/'1', count=2, seed=3, progress=False)
    b = prepare(FIX/'alpaca_en_demo.sample.json', 'alpaca', 'a', tmp_path/'2', count=2, seed=3, progress=False)
    prepare(FIX/'alpaca_en_demo.sample.json', 'alpaca', 'a', tmp_path/'3', progress=False)
    full = {c['source_index']: c['sample_id'] for c in conversations(tmp_path/'3'/'a')}
    sa = [(c['source_index'], c['sample_id']) for c in conversations(tmp_path/'1'/'a')]
    assert a['kept'] == b['kept'] == 2 and sa == [(c['source_index'], c['sample_id']) for c in conversations(tmp_path/'2'/'a')]
    assert all(full[i] == s for i, s in sa)  # a sampled record has the id it has in the full set


def test_clear_errors(tmp_path):
    p = cli('--format', 'sharegtp', '--input', FIX/'alpaca_en_demo.sample.json', '--name', 'x', '--out', tmp_path)
    assert p.returncode == 1 and "unknown format 'sharegtp'" in p.stderr and 'Traceback' not in p.stderr
    p = cli('--format', 'alpaca', '--input', tmp_path, '--name', 'x', '--out', tmp_path/'o')
    assert p.returncode == 1 and 'no .json, .jsonl, .parquet or .traj files' in p.stderr
