"""Fakes for tests and benchmarks: `FakeTarget`, an OpenAI-compatible loopback server with deterministic answers.

A real `transformers serve` answers one request at a time at ~6 ms per token: right for end-to-end checks, far too
slow to test kills, faults or thousands of requests per second. `FakeTarget` speaks just enough HTTP/1.1 (asyncio
streams, keep-alive, Content-Length bodies) for httpx and the openai SDK. Its answer to a prompt is a function of the
prompt alone: `n = length(prompt)` tokens, cut at `max_tokens`, after `latency + per_token * n` seconds (override
`pause` for other timing). `flavor='vllm'` accepts token-id prompts and returns token ids; `flavor='hf'` rejects them
as `transformers serve` does. It logs what every request asked for in `requests`, and its path and body in `calls`.

Notebooks import it with the repository's tests/ folder on `sys.path` (they run with cwd nbs/).
"""

import asyncio, json, threading, zlib
import multiprocessing as mp
from eagle3nb.server import free_port, wait_for_server

# the request fields `transformers serve` accepts; flavor 'hf' answers 422 to any other
HF_FIELDS = {
    'model',
    'prompt',
    'messages',
    'tools',
    'max_tokens',
    'temperature',
    'top_p',
    'seed',
    'chat_template_kwargs',
}


def request_key(body: dict):
    "What a request asks for: the prompt (text or ids) or the last message's content"
    if 'messages' in body:
        return body['messages'][-1].get('content')
    return tuple(body['prompt']) if isinstance(body['prompt'], list) else body['prompt']


def default_length(key) -> int:
    "4..31 tokens, fixed by the prompt"
    return 4 + zlib.crc32(repr(key).encode()) % 28


async def read_request(reader):
    "(method, path, headers, body) of one HTTP/1.1 request, or None at EOF"
    line = await reader.readline()
    if not line:
        return None
    method, path, _ = line.decode().split(' ', 2)
    headers = {}
    while (h := await reader.readline()) not in (b'\r\n', b'\n', b''):
        k, v = h.decode().split(':', 1)
        headers[k.strip().lower()] = v.strip()
    return method, path, headers, await reader.readexactly(int(headers.get('content-length', 0)))


def http_response(status: int, body: bytes, headers: dict = None) -> bytes:
    "The bytes of an HTTP/1.1 response with a JSON body"
    head = {'Content-Type': 'application/json', 'Content-Length': len(body), **(headers or {})}
    lines = ''.join(f'{k}: {v}\r\n' for k, v in head.items())
    return f'HTTP/1.1 {status} X\r\n{lines}\r\n'.encode() + body


class FakeTarget:
    "An OpenAI-compatible loopback server with deterministic answers; `with` it (a thread), or `start(process=True)`"

    def __init__(self, model='fake', flavor='vllm', latency=0.0, per_token=0.0, length=default_length, port=None):
        self.model, self.flavor, self.latency, self.per_token, self.length = model, flavor, latency, per_token, length
        self.port, self.requests, self.proc, self.thread = port or free_port(), [], None, None
        self.calls = []  # (path, body) of every request answered, /models aside

    @property
    def base_url(self) -> str:
        return f'http://127.0.0.1:{self.port}/v1'

    def answer(self, path: str, body: dict) -> tuple:
        "(status, json, completion tokens) for one request"
        if path.endswith('/models'):
            return 200, dict(data=[dict(id=self.model)]), 0
        self.calls.append((path, body))
        if body.get('model') != self.model:
            return 400, dict(detail=f"model {body.get('model')!r} is not served"), 0
        if self.flavor == 'hf' and set(body) - HF_FIELDS:
            return 422, dict(detail=f'unknown fields {sorted(set(body) - HF_FIELDS)}'), 0
        if self.flavor == 'hf' and not isinstance(body.get('prompt', ''), str):
            return 400, dict(detail='prompt must be a string.'), 0
        k = request_key(body)
        self.requests.append(k)
        want = self.length(k)
        n = min(want, body.get('max_tokens') or 1024)
        fin = 'length' if n < want else 'stop'
        text = ' '.join(f'w{i}' for i in range(n))
        if 'messages' in body:
            ch = dict(index=0, message=self.chat_message(body, text), finish_reason=fin)
        else:
            ch = dict(index=0, text=text, finish_reason=fin)
            if body.get('return_token_ids'):
                ch['token_ids'] = list(range(100, 100 + n))
        plen = len(k) if isinstance(k, tuple) else len(str(k).split())
        usage = dict(prompt_tokens=plen, completion_tokens=n)
        return 200, dict(id='x', object='completion', choices=[ch], usage=usage), n

    def chat_message(self, body: dict, text: str) -> dict:
        "The assistant message: a call of the first tool when a user speaks after an assistant turn, else `text`"
        ms, tools = body['messages'], body.get('tools')
        if tools and ms[-1]['role'] == 'user' and any(m['role'] == 'assistant' for m in ms):
            f = tools[0]['function']['name']
            call = dict(id=f'call_{len(self.requests)}', type='function', function=dict(name=f, arguments='{}'))
            return dict(role='assistant', content='', tool_calls=[call])
        return dict(role='assistant', content=text)

    async def pause(self, body: dict, n: int):
        "Wait before answering a request for `n` tokens"
        if self.latency or self.per_token:
            await asyncio.sleep(self.latency + self.per_token * n)

    async def _handle(self, reader, writer):
        try:
            while (req := await read_request(reader)) is not None:
                body = json.loads(req[3]) if req[3] else {}
                status, js, n = self.answer(req[1], body)
                await self.pause(body, n)
                writer.write(http_response(status, json.dumps(js).encode()))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # client gone, or server stopping
        finally:
            writer.close()

    def _serve(self, ready=None):
        "Run the server loop in this thread until `self._stop` is set"

        async def main():
            srv = await asyncio.start_server(self._handle, '127.0.0.1', self.port, backlog=1024)
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            if ready:
                ready.set()
            async with srv:
                await self._stop.wait()

        asyncio.run(main())

    def start(self, process: bool = False):
        "Serve from a thread of this process (requests logged), or from a forked process (`process=True`)"
        if process:
            self.proc = mp.get_context('fork').Process(target=self._serve, daemon=True)
            self.proc.start()
        else:
            ready = threading.Event()
            self.thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
            self.thread.start()
            ready.wait(10)
        wait_for_server(self.base_url, self.model, timeout=20, poll=0.05)
        return self

    def stop(self):
        if self.thread:
            self._loop.call_soon_threadsafe(self._stop.set)
            self.thread.join(5)
            self.thread = None
        if self.proc:
            self.proc.kill()
            self.proc.join(5)
            self.proc = None

    def __enter__(self):
        return self if (self.thread or self.proc) else self.start()  # `with FakeTarget().start(process=True)` too

    def __exit__(self, *a):
        self.stop()
