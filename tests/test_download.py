"The download phase against a fake Hub on loopback (`fake_hub.FakeHub`) and a filled HF cache: nothing leaves the host"

import hashlib, json, signal, socket, subprocess, sys, time
from pathlib import Path

import pytest
import yaml
from huggingface_hub import constants as hf_constants

from eagle3nb.catalog import query
from eagle3nb.download import MANIFEST, PARTIAL, DownloadError, Hub, download_recipe, read_download_manifest
from eagle3nb.recipe import load_recipe, raw_dir
from fake_hub import FakeHub

TRAIN = b''.join(b'{"conversations": [{"from": "human", "value": "q%d"}]}\n' % i for i in range(400))  # LFS, ~21 kB
FILES = {'data/train.jsonl': TRAIN, 'README.md': b'# a toy dataset\n', 'extra/notes.txt': b'not data\n'}


@pytest.fixture
def hub(tmp_path, monkeypatch):
    "A fake Hub, with HF_ENDPOINT pointing at it, the HF cache and home in `tmp_path`, no token, online"
    with FakeHub() as h:
        monkeypatch.setenv('HF_ENDPOINT', h.url)
        monkeypatch.setenv('HF_HOME', str(tmp_path / 'hf-home'))
        monkeypatch.setenv('HF_HUB_CACHE', str(tmp_path / 'hf-cache'))
        monkeypatch.setenv('HF_HUB_OFFLINE', '0')
        for k in ('HF_TOKEN', 'HUGGING_FACE_HUB_TOKEN', 'HF_OIDC_RESOURCE'):
            monkeypatch.delenv(k, raising=False)
        monkeypatch.setattr(hf_constants, 'HF_HUB_OFFLINE', False)  # read at import, where conftest set it to 1
        monkeypatch.setenv('HF_HUB_DISABLE_TELEMETRY', '1')  # its user agent asks huggingface.co for a list of agents
        monkeypatch.setattr(hf_constants, 'HF_HUB_DISABLE_TELEMETRY', True)
        monkeypatch.setattr(hf_constants, 'HF_TOKEN_PATH', str(tmp_path / 'hf-home' / 'token'))  # no saved token
        h.commit('org/toy', FILES)
        looked_up, real = [], socket.getaddrinfo
        guard = lambda host, *a, **kw: (looked_up.append(host) if host != '127.0.0.1' else None) or real(host, *a, **kw)
        monkeypatch.setattr(socket, 'getaddrinfo', guard)  # every connection looks its host up first
        yield h
        assert not looked_up, f'reached beyond the fake Hub: {looked_up}'


def recipe(tmp_path: Path, **ds) -> Path:
    "A recipe file in `tmp_path` with one dataset of the fake Hub (`ds` overrides its keys)"
    d = {'name': 'toy', 'format': 'sharegpt', 'repo': 'org/toy', 'revision': 'main', 'subdir': 'data', **ds}
    y = dict(name='dl', target=dict(model='m'), data_root=str(tmp_path / 'data'), catalog=str(tmp_path / 'c.duckdb'))
    p = tmp_path / 'r.yaml'
    p.write_text(yaml.safe_dump(dict(y, datasets=[d])))
    return p


def fetch(p: Path, **kw) -> dict:
    "Download recipe `p` with the Hub the environment names, no waits between tries"
    return download_recipe(load_recipe(p), hub=Hub.from_env(wait=0, **kw), progress=False)['toy']


def test_sha256_recorded_in_manifest_and_catalog(hub, tmp_path):
    "Each file's sha256 is hashlib's of the bytes the Hub holds, in the raw folder, the manifest and the catalog"
    p = recipe(tmp_path)
    s = fetch(p)
    raw = raw_dir(load_recipe(p), 'toy')
    want = {f: hashlib.sha256(b).hexdigest() for f, b in FILES.items()}
    assert {f: hashlib.sha256((raw / f).read_bytes()).hexdigest() for f in FILES} == want
    assert {x['file']: x['sha256'] for x in s['rows']} == want and s['path'] == str(raw / 'data')
    m = json.loads((raw / MANIFEST).read_text())
    assert (m['repo'], m['revision'], m['commit'], m['complete']) == ('org/toy', 'main', s['commit'], True)
    assert {f: e['sha256'] for f, e in m['files'].items()} == want
    df = query(tmp_path / 'c.duckdb', "SELECT * FROM downloads WHERE dataset = 'toy' ORDER BY file")
    assert dict(zip(df.file, df.sha256)) == want and set(df.commit) == {s['commit']} and set(df.revision) == {'main'}
    assert dict(zip(df.file, df.bytes)) == {f: len(b) for f, b in FILES.items()}
    cdn = [r for r in hub.requests if r['path'].startswith('/cdn/')]  # the LFS file, from the CDN: no token sent
    assert len(cdn) == 1 and not cdn[0]['auth']


def test_second_run_fetches_nothing(hub, tmp_path):
    "A rerun asks nothing of the Hub on a pinned commit; on a branch, only which commit it is at"
    s = fetch(recipe(tmp_path))
    n = len(hub.requests)
    again = fetch(recipe(tmp_path))
    assert again['fetched'] == [] and [r['path'] for r in hub.requests[n:]] == ['/api/datasets/org/toy/revision/main']
    n = len(hub.requests)
    pinned = fetch(recipe(tmp_path, revision=s['commit']))  # the same commit by its sha: no request at all
    assert (pinned['fetched'], pinned['pinned'], len(hub.requests) - n) == ([], True, 0)
    assert read_download_manifest(pinned['out'])['revision'] == s['commit']


def test_killed_download_resumes(hub, tmp_path):
    "A download killed (SIGKILL) in the middle of a file leaves its partial; the next run asks for the rest alone"
    p = recipe(tmp_path, files=['data/*', 'README.md'])
    hub.fail('/cdn/', 'stall')  # half the LFS file, then silence: the process is killed waiting for the rest
    code = (
        "from eagle3nb.download import Hub, download_recipe; from eagle3nb.recipe import load_recipe; "
        f"download_recipe(load_recipe({str(p)!r}), hub=Hub.from_env(wait=0), progress=False)"
    )
    proc = subprocess.Popen([sys.executable, '-c', code], stderr=subprocess.PIPE)  # the environment `hub` set
    part = tmp_path / 'data' / 'raw' / 'toy' / PARTIAL / 'data' / 'train.jsonl.part'
    for _ in range(300):
        if part.exists() and part.stat().st_size == len(TRAIN) // 2 or proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert part.stat().st_size == len(TRAIN) // 2, proc.stderr.read().decode()[-2000:]
    hub.release.set()
    s = fetch(p)
    assert s['fetched'] == ['data/train.jsonl'] and not part.exists()  # README.md was fetched before the kill
    last = [r for r in hub.requests if r['path'].startswith('/cdn/')][-1]
    assert (last['range'], last['status']) == (f'bytes={len(TRAIN) // 2}-', 206)
    assert (tmp_path / 'data' / 'raw' / 'toy' / 'data' / 'train.jsonl').read_bytes() == TRAIN


def test_rate_limit_then_success(hub, tmp_path):
    "429 (Retry-After honoured), a 503 and a reset connection are tried again; tries that run out say what to do"
    hub.fail('/revision/', 429, times=2, headers={'Retry-After': '1'})
    hub.fail('/cdn/', 503)
    hub.fail('/resolve/main/README.md', 'reset')
    t0 = time.monotonic()
    s = fetch(recipe(tmp_path))
    assert time.monotonic() - t0 >= 2  # the two waits Retry-After asked for
    assert hub.count('/revision/') == 3 and len(s['fetched']) == 3
    hub.fail('/revision/', 429, times=9, headers={'Retry-After': '0'})
    with pytest.raises(
        DownloadError, match=r'org/toy: rate-limited by the Hub \(429, retry after 0 s\), after 3 tries'
    ):
        fetch(recipe(tmp_path), tries=3)


def test_user_files_survive(hub, tmp_path):
    "A file the repo does not list is left and reported; a user's file at a repo path is moved aside, not overwritten"
    raw = tmp_path / 'data' / 'raw' / 'toy'
    (raw / 'data').mkdir(parents=True)
    (raw / 'mine.txt').write_text('my notes')
    (raw / 'README.md').write_text('my own readme')
    s = fetch(recipe(tmp_path, files=['data/*', 'README.md']))
    assert (raw / 'mine.txt').read_text() == 'my notes' and (raw / 'README.md.local-1').read_text() == 'my own readme'
    assert (raw / 'README.md').read_bytes() == FILES['README.md']
    assert s['aside'] == [dict(file='README.md', moved_to='README.md.local-1')]
    assert s['extra'] == ['README.md.local-1', 'mine.txt'] and s['files'] == 2  # extra/notes.txt is not asked for


def test_unpinned_revision_follows_its_branch(hub, tmp_path):
    "A branch is reported unpinned with the commit to pin; when it moves, the changed file is fetched and replaced"
    s = fetch(recipe(tmp_path))
    assert (s['pinned'], s['pin']) == (False, f"revision: {s['commit']}")
    c2 = hub.commit('org/toy', {**FILES, 'README.md': b'# a toy dataset, v2\n'})
    s2 = fetch(recipe(tmp_path))
    assert (s2['commit'], s2['fetched'], s2['aside']) == (c2, ['README.md'], [])  # ours, of the old commit: replaced
    df = query(tmp_path / 'c.duckdb', "SELECT file, commit FROM downloads WHERE dataset = 'toy'")
    assert set(df.commit) == {c2}


def test_gated_repo_needs_a_token(hub, tmp_path, monkeypatch):
    "A gated repo without a token fails naming the repo, the file and HF_TOKEN; with an allowed token it downloads"
    hub.commit('org/gated', {'data/x.jsonl': b'{}\n'}, gated=True)
    p = recipe(tmp_path, repo='org/gated')
    with pytest.raises(DownloadError, match='org/gated: data/x.jsonl: a gated dataset, and no HF_TOKEN is set'):
        fetch(p)
    hub.tokens.add('hf_ok')
    monkeypatch.setenv('HF_TOKEN', 'hf_ok')
    assert fetch(p)['fetched'] == ['data/x.jsonl']
    assert [r['auth'] for r in hub.requests if r['path'].endswith('data/x.jsonl')][-1]


def test_offline_from_a_filled_hf_cache(hub, tmp_path, monkeypatch):
    "HF_HUB_OFFLINE=1 with a cache huggingface_hub filled itself: raw/<name>/ and the catalog rows, no request"
    from huggingface_hub import snapshot_download

    cache = tmp_path / 'hf-cache'
    snapshot_download('org/toy', repo_type='dataset', cache_dir=cache, endpoint=hub.url)  # datasets--org--toy/...
    assert (cache / 'datasets--org--toy' / 'refs' / 'main').is_file()
    monkeypatch.setenv('HF_HUB_OFFLINE', '1')
    n = len(hub.requests)
    s = fetch(recipe(tmp_path))
    assert len(hub.requests) == n and s['commit'] == (cache / 'datasets--org--toy' / 'refs' / 'main').read_text()
    raw = tmp_path / 'data' / 'raw' / 'toy'
    assert {f: (raw / f).read_bytes() for f in FILES} == FILES
    df = query(tmp_path / 'c.duckdb', "SELECT file, sha256 FROM downloads WHERE dataset = 'toy'")
    assert dict(zip(df.file, df.sha256)) == {f: hashlib.sha256(b).hexdigest() for f, b in FILES.items()}
    with pytest.raises(DownloadError, match="HF cache .* does not know revision 'v2'"):
        fetch(recipe(tmp_path, revision='v2'))
    next((cache / 'datasets--org--toy' / 'snapshots').glob('*/README.md')).unlink()  # a snapshot cut short
    (tmp_path / 'b').mkdir()
    with pytest.raises(DownloadError, match=r'snapshot of \w+ lacks 1 of the files asked \(README.md\)'):
        fetch(recipe(tmp_path / 'b'))  # huggingface_hub's listing of the commit names it


def test_download_verb(hub, tmp_path, capsys):
    "`eagle3nb download RECIPE` runs the phase: its headline and record; a failure is one line and exit 1"
    from eagle3nb.cli import main

    p = recipe(tmp_path)
    main(['download', str(p), '--run-dir', str(tmp_path / 'run'), '--no-progress'])
    out = capsys.readouterr().out
    assert out.startswith('download: 1 dataset, 3 files') and 'unpinned' in out, out
    assert json.loads((tmp_path / 'run' / 'download.json').read_text())['datasets']['toy']['pinned'] is False
    hub.commit('org/gated', {'x.json': b'[]'}, gated=True)
    with pytest.raises(SystemExit) as e:
        main(['download', str(recipe(tmp_path, repo='org/gated', subdir=None)), '--run-dir', str(tmp_path / 'run')])
    err = capsys.readouterr().err.splitlines()[-1]  # after the progress bar's lines
    assert e.value.code == 1 and err.startswith('eagle3nb download: error: org/gated: x.json: a gated dataset'), err


@pytest.mark.parametrize('evil', ['../../victim.txt', '/tmp/abs-victim.txt', 'data/../../../victim.txt'])
def test_a_listing_that_climbs_out_is_refused_whole(hub, tmp_path, evil):
    "A mirror whose listing names a path outside raw/<name>/ gets nothing written, anywhere: one line names the path"
    victim = tmp_path / 'victim.txt'
    victim.write_text('mine')
    hub.commit('org/toy', {**FILES, evil: b'pwned'})
    with pytest.raises(DownloadError, match='no file inside the dataset'):
        fetch(recipe(tmp_path, subdir=None))
    assert victim.read_text() == 'mine' and not list(tmp_path.glob('victim.txt.local-*'))
    raw = raw_dir(load_recipe(recipe(tmp_path)), 'toy')
    left = [p.name for p in raw.rglob('*') if p.is_file()] if raw.exists() else []
    assert left in ([], ['.eagle3nb_download.lock']), left  # its lock at most: no file fetched
