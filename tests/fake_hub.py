"""`FakeHub`: a tiny Hugging Face Hub on loopback, for tests of `eagle3nb.download` (no network, ever).

It serves the endpoints huggingface_hub 2.4.0 calls for a dataset snapshot, and those `eagle3nb.download` calls:
- `GET /api/datasets/{repo}/revision/{rev}`: the repo at a revision (`HfApi.dataset_info`; `sha` is the commit);
- `GET /api/datasets/{repo}/tree/{rev}?recursive=...`: its files (`HfApi.list_repo_tree`, one page);
- `HEAD|GET /datasets/{repo}/resolve/{rev}/{file}`: a file (`hf_hub_download`'s HEAD, a plain GET with `Range`).
  A regular file is served there; an LFS file is redirected (302) to a second server, the "CDN", as the real Hub
  does, so a client must follow a redirect to another origin (and drop its `Authorization` there).
Commits are real: `commit()` adds one (a 40-hex sha of its content) and moves the branch, so a branch resolves to
the commit of the day and an old commit still serves its files. `fail()` makes the next requests to a path answer
429 (with `Retry-After`), 5xx, a reset connection, a body cut in half, or half a body and then silence until
`release` is set (a download to kill in the middle). `requests` logs every request.

Notebooks import it with the repository's tests/ folder on `sys.path` (they run with cwd nbs/).
"""

import fnmatch, hashlib, json, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

LFS = ('*.parquet', '*.jsonl', '*.arrow')  # files stored in LFS (sha256 listed, served by the CDN)


def git_sha1(b: bytes) -> str:
    "git's blob id of `b` (what the Hub lists as a file's `oid`)"
    return hashlib.sha1(b'blob %d\0' % len(b) + b).hexdigest()


class FakeHub:
    "A Hub of dataset repos on 127.0.0.1 (and its CDN on another port); `with FakeHub() as hub: hub.url`"

    def __init__(self, lfs=LFS):
        self.lfs = lfs
        self.repos = {}  # repo -> dict(commits={sha: {path: bytes}}, refs={branch: sha}, gated=bool)
        self.tokens = set()  # tokens that may read gated repos
        self.requests = []  # dicts: method, path, range, auth (whether it carried Authorization), status
        self.faults = []  # dicts: match, method, status, times, headers
        self.lock = threading.Lock()
        self.release = threading.Event()  # ends every 'stall'

    def commit(self, repo: str, files: dict, branch: str = 'main', gated: bool = False) -> str:
        "Add a commit of `files` (path -> bytes) to `repo`, move `branch` to it; its sha"
        rp = self.repos.setdefault(repo, dict(commits={}, refs={}, gated=gated))
        rp['gated'] = gated
        sha = hashlib.sha1(
            json.dumps([repo, len(rp['commits']), sorted((p, git_sha1(b)) for p, b in files.items())]).encode()
        )
        sha = sha.hexdigest()
        rp['commits'][sha] = dict(files)
        rp['refs'][branch] = sha
        return sha

    def fail(self, match: str, status=429, times: int = 1, headers: dict = None, method: str = 'GET'):
        "The next `times` requests whose path holds `match` get `status`: a code, 'reset', 'cut' or 'stall'"
        self.faults.append(dict(match=match, method=method, status=status, times=times, headers=headers or {}))

    def count(self, part: str = '', method: str = None) -> int:
        "Requests so far whose path holds `part` (and of `method`)"
        return sum(part in r['path'] and method in (None, r['method']) for r in self.requests)

    def is_lfs(self, path: str) -> bool:
        return any(fnmatch.fnmatch(path, p) for p in self.lfs)

    def blob(self, sha256: str):  # -> bytes | None
        "The content whose sha256 is `sha256`, in any commit of any repo"
        for rp in self.repos.values():
            for files in rp['commits'].values():
                for b in files.values():
                    if hashlib.sha256(b).hexdigest() == sha256:
                        return b
        return None

    def _fault(self, method: str, path: str):  # -> dict | None
        with self.lock:
            for f in self.faults:
                if f['times'] > 0 and f['match'] in path and f['method'] in (method, '*'):
                    f['times'] -= 1
                    return f
        return None

    def __enter__(self):
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self.servers = [ThreadingHTTPServer(('127.0.0.1', 0), Handler) for _ in range(2)]  # the Hub, its CDN
        for s in self.servers:
            s.daemon_threads = True
            threading.Thread(target=s.serve_forever, daemon=True).start()
        self.url, self.cdn = [f'http://127.0.0.1:{s.server_address[1]}' for s in self.servers]
        return self

    def __exit__(self, *exc):
        self.release.set()
        for s in self.servers:
            s.shutdown()
            s.server_close()


def _tree(files: dict, lfs) -> list:
    "The tree listing of `files`: every file (with its LFS sha256 when in LFS) and every folder"
    out, dirs = [], set()
    for p, b in sorted(files.items()):
        e = dict(type='file', oid=git_sha1(b), size=len(b), path=p)
        if lfs(p):
            e['lfs'] = dict(oid=hashlib.sha256(b).hexdigest(), size=len(b), pointerSize=134)
        out.append(e)
        parts = p.split('/')[:-1]
        dirs |= {'/'.join(parts[: i + 1]) for i in range(len(parts))}
    return [dict(type='directory', oid='0' * 40, size=0, path=d) for d in sorted(dirs)] + out


class _Handler(BaseHTTPRequestHandler):
    protocol_version = 'HTTP/1.1'
    hub: FakeHub = None

    def log_message(self, *a):  # quiet
        pass

    def do_HEAD(self):
        self.route('HEAD')

    def do_GET(self):
        self.route('GET')

    def send(self, status: int, body: bytes = b'', headers: dict = None, cut: str = ''):
        "Answer `status` with `body`; `cut`: send half of it, then drop the connection ('stall': once `release` is set)"
        self.send_response(status)
        hs = {'Content-Length': str(len(body)), 'Content-Type': 'application/octet-stream', **(headers or {})}
        for k, v in hs.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != 'HEAD':
            self.wfile.write(body[: len(body) // 2] if cut else body)
        if cut:
            self.wfile.flush()
            if cut == 'stall':
                self.hub.release.wait(60)
            self.close_connection = True
        self.log['status'] = status

    def error(self, status: int, code: str, msg: str = ''):
        self.send(status, json.dumps(dict(error=msg or code)).encode(), {'X-Error-Code': code, 'X-Error-Message': msg})

    def route(self, method: str):
        hub, url = self.hub, urlsplit(self.path)
        self.log = dict(method=method, path=url.path, range=self.headers.get('Range'), status=None)
        self.log['auth'] = self.headers.get('Authorization') is not None
        hub.requests.append(self.log)
        if f := hub._fault(method, url.path):
            if f['status'] == 'reset':  # no answer at all: the client sees the connection drop
                self.close_connection = True
                return
            if f['status'] not in ('cut', 'stall'):  # a rate limit, a server error: a JSON body and the fault's headers
                return self.send(
                    f['status'], b'{"error": "injected"}', {'Content-Type': 'application/json', **f['headers']}
                )
        parts = [unquote(p) for p in url.path.split('/')[1:]]
        cut = f['status'] if f else ''
        if parts[:2] == ['api', 'datasets'] and len(parts) >= 6:
            return self.api(parts[2] + '/' + parts[3], parts[4], parts[5])
        if parts[:1] == ['datasets'] and len(parts) >= 6 and parts[3] == 'resolve':
            return self.resolve(parts[1] + '/' + parts[2], parts[4], '/'.join(parts[5:]), cut)
        if parts[:1] == ['cdn'] and len(parts) == 2 and (b := hub.blob(parts[1])) is not None:
            return self.content(b, {'ETag': f'"{parts[1]}"'}, cut)
        self.error(404, 'NotFound', f'no route {url.path}')

    def commit_of(self, repo: str, rev: str):  # -> (sha, files) | None, having answered the error
        rp = self.hub.repos.get(repo)
        if rp is None:
            return self.error(404, 'RepoNotFound', f'Repository {repo} not found')
        sha = rev if rev in rp['commits'] else rp['refs'].get(rev)
        if sha is None:
            return self.error(404, 'RevisionNotFound', f'Invalid rev id: {rev}')
        return sha, rp['commits'][sha]

    def api(self, repo: str, what: str, rev: str):
        if (c := self.commit_of(repo, rev)) is None:
            return
        if what == 'revision':
            body = dict(id=repo, sha=c[0], private=False, gated=self.hub.repos[repo]['gated'] and 'manual', siblings=[])
        elif what == 'tree':
            body = _tree(c[1], self.hub.is_lfs)
        else:
            return self.error(404, 'NotFound', what)
        self.send(200, json.dumps(body).encode(), {'Content-Type': 'application/json'})

    def resolve(self, repo: str, rev: str, path: str, cut: str):
        if (c := self.commit_of(repo, rev)) is None:
            return
        sha, files = c
        token = (self.headers.get('Authorization') or '').removeprefix('Bearer ')
        if self.hub.repos[repo]['gated'] and token not in self.hub.tokens:
            msg = f'Access to dataset {repo} is restricted. You must have access to it and be authenticated.'
            return self.error(401, 'GatedRepo', msg)
        if path not in files:
            return self.error(404, 'EntryNotFound', f'{path} does not exist on "{rev}"')
        b, h = files[path], {'X-Repo-Commit': sha}
        if self.hub.is_lfs(path):  # the Hub sends LFS files to its CDN, another origin
            s = hashlib.sha256(b).hexdigest()
            loc = f'{self.hub.cdn}/cdn/{s}'
            h.update({'Location': loc, 'X-Linked-Etag': f'"{s}"', 'X-Linked-Size': str(len(b)), 'ETag': f'"{s}"'})
            return self.send(302, b'', h)
        self.content(b, {**h, 'ETag': f'"{git_sha1(b)}"'}, cut)

    def content(self, b: bytes, headers: dict, cut: str):
        "`b` whole (200) or from the `Range` asked (206)"
        rg, h = self.headers.get('Range'), {'Accept-Ranges': 'bytes', **headers}
        if not rg:
            return self.send(200, b, h, cut)
        start = int(rg.removeprefix('bytes=').split('-')[0])
        if start >= len(b):
            return self.send(416, b'', {**h, 'Content-Range': f'bytes */{len(b)}'})
        self.send(206, b[start:], {**h, 'Content-Range': f'bytes {start}-{len(b) - 1}/{len(b)}'}, cut)
