"""Fixtures for the bench tests: a fake OpenAI-compatible streaming server and a byte tokenizer.

The fake server streams one chunk per requested token (``max_tokens``) with controlled delays,
then a usage chunk and ``data: [DONE]``. It fails on purpose where a test needs it:

- ``max_tokens == FAIL_MAX_TOKENS`` on any completions route: HTTP 500;
- ``/busy/v1/...``: every completion gets HTTP 429 with ``Retry-After``;
- ``/truncated/v1/...``: the stream stops after the tokens, without usage or ``[DONE]``.

Every completion request's headers are kept (``RECEIVED_HEADERS``, lower-case names, in arrival
order, next to the prompt). ``GET /ready`` answers like a cadenza server: counters that grow on
every poll (``READY_POLLS`` counts them). ``make_app(ready=...)`` makes another kind of server:
``"missing"`` (no route: 404), ``"html"`` (200 with a web page) or ``"partial"`` (JSON without
the counters).

Prompt tokens in its usage chunk are the prompt's UTF-8 bytes, which is exactly what the byte
tokenizer fixture counts, so synthesized prompts can be checked end to end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

MODEL_ID = "fake-model"
FAIL_MAX_TOKENS = 7
FIRST_TOKEN_DELAY_S = 0.02
TOKEN_DELAY_S = 0.005

RECEIVED = web.AppKey("received", list)
RECEIVED_HEADERS = web.AppKey("received_headers", list)
READY_POLLS = web.AppKey("ready_polls", list)
STALL_S = web.AppKey("stall_s", float)
FIRST_TOKEN_GATE = web.AppKey("first_token_gate", object)
KV_BLOCKS_TOTAL = 64


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list",
                              "data": [{"id": MODEL_ID, "object": "model"}, {"id": "other"}]})


async def _stream(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    request.app[RECEIVED].append({"path": request.path, **body})
    request.app[RECEIVED_HEADERS].append({
        "path": request.path, "prompt": body.get("prompt") or body["messages"][0]["content"],
        "headers": {k.lower(): v for k, v in request.headers.items()}})
    if (gate := request.app[FIRST_TOKEN_GATE]) is not None:
        await gate.wait()
    prefix = request.path.split("/v1/")[0]
    if prefix == "/busy":
        return web.json_response({"error": {"message": "server overloaded", "type": "overloaded"}},
                                 status=429, headers={"Retry-After": "1"})
    if body["max_tokens"] == FAIL_MAX_TOKENS:
        return web.json_response({"error": {"message": "boom"}}, status=500)
    chat = request.path.endswith("/chat/completions")
    prompt = body["messages"][0]["content"] if chat else body["prompt"]

    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await asyncio.sleep(FIRST_TOKEN_DELAY_S + request.app[STALL_S])
    if chat:  # a role-only first chunk carries no text and must not count as a token
        await resp.write(_sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}))
    for i in range(body["max_tokens"]):
        if i:
            await asyncio.sleep(TOKEN_DELAY_S)
        text = f" t{i}"
        choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
        await resp.write(_sse({"model": MODEL_ID, "choices": [choice]}))
    if prefix == "/truncated":
        return resp
    await resp.write(_sse({"choices": [], "usage": {
        "prompt_tokens": len(prompt.encode()), "completion_tokens": body["max_tokens"],
        "total_tokens": len(prompt.encode()) + body["max_tokens"]}}))
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def _ready(request: web.Request) -> web.Response:
    """Cadenza-like counters: poll n (1, 2, ...) has made 3n steps, 40n prefill and 5n decode,
    and looked up 40n prompt tokens in the prefix cache, 10n of them hits (a 25 % hit rate)."""
    polls = request.app[READY_POLLS]
    polls.append(request.path)
    n = len(polls)
    return web.json_response({
        "status": "ready", "num_steps": 3 * n, "prefill_tokens_admitted": 40 * n,
        "decode_tokens": 5 * n, "kv_blocks_used": n % 10, "kv_blocks_cached": n % 3,
        "kv_blocks_total": KV_BLOCKS_TOTAL, "kv_blocks_free": KV_BLOCKS_TOTAL - n % 10,
        "num_running": len(request.app[RECEIVED]), "num_waiting": 0, "classes": {},
        "prefix_cache_queried_tokens": 40 * n, "prefix_cache_hit_tokens": 10 * n})


async def _ready_html(request: web.Request) -> web.Response:
    request.app[READY_POLLS].append(request.path)
    return web.Response(text="<html><body>ok</body></html>", content_type="text/html")


async def _ready_partial(request: web.Request) -> web.Response:
    request.app[READY_POLLS].append(request.path)
    return web.json_response({"status": "ready", "num_steps": 1})


READY_HANDLERS = {"cadenza": _ready, "html": _ready_html, "partial": _ready_partial}


def make_fake_openai_app(stall_s: float = 0.0, ready: str = "cadenza",
                         first_token_gate: asyncio.Event | None = None) -> web.Application:
    """The fake server; ``stall_s`` adds seconds before the first token (for timeouts), ``ready``
    picks the ``/ready`` answer (``cadenza``, ``missing``, ``html`` or ``partial``), and every
    completion waits for ``first_token_gate`` (when given) to be set before it answers."""
    app = web.Application()
    app[FIRST_TOKEN_GATE] = first_token_gate
    app[RECEIVED] = []
    app[RECEIVED_HEADERS] = []
    app[READY_POLLS] = []
    app[STALL_S] = stall_s
    if ready != "missing":
        app.router.add_get("/ready", READY_HANDLERS[ready])
    for prefix in ("", "/busy", "/truncated"):
        app.router.add_get(f"{prefix}/v1/models", _models)
        app.router.add_post(f"{prefix}/v1/completions", _stream)
        app.router.add_post(f"{prefix}/v1/chat/completions", _stream)
    return app


class Fake:
    """What tests may know about the fake server (conftest is not importable as a module)."""

    MODEL_ID = MODEL_ID
    FAIL_MAX_TOKENS = FAIL_MAX_TOKENS
    FIRST_TOKEN_DELAY_S = FIRST_TOKEN_DELAY_S
    RECEIVED = RECEIVED
    RECEIVED_HEADERS = RECEIVED_HEADERS
    READY_POLLS = READY_POLLS
    KV_BLOCKS_TOTAL = KV_BLOCKS_TOTAL
    make_app = staticmethod(make_fake_openai_app)


@pytest.fixture
def fake() -> type[Fake]:
    return Fake


@pytest.fixture
def fake_app() -> web.Application:
    return make_fake_openai_app()


@pytest.fixture
def start_fake_server(aiohttp_server):
    """``await start_fake_server(stall_s, ready=...)`` -> base URL of a fresh fake server."""

    async def start(stall_s: float = 0.0, ready: str = "cadenza") -> str:
        server = await aiohttp_server(make_fake_openai_app(stall_s, ready))
        return str(server.make_url("")).rstrip("/")

    return start


@pytest.fixture
async def fake_base_url(aiohttp_server, fake_app) -> str:
    """``http://127.0.0.1:PORT`` of the fake server, on the test's event loop."""
    server = await aiohttp_server(fake_app)
    return str(server.make_url("")).rstrip("/")


@pytest.fixture
def threaded_base_url(fake_app) -> Iterator[str]:
    """The fake server on its own thread and loop, for code that calls ``asyncio.run``."""
    with _serve_in_thread(fake_app) as url:
        yield url


@pytest.fixture
def threaded_server() -> Iterator[Callable[[web.Application], str]]:
    """``threaded_server(app)`` -> base URL of ``app`` served on its own thread until the test ends."""
    with contextlib.ExitStack() as stack:
        yield lambda app: stack.enter_context(_serve_in_thread(app))


@contextlib.contextmanager
def _serve_in_thread(app: web.Application) -> Iterator[str]:
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    ready = threading.Event()
    address: list[str] = []

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        host, port = runner.addresses[0][:2]
        address.append(f"http://{host}:{port}")
        ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(5), "fake server did not start"
    yield address[0]
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


@pytest.fixture
def byte_tokenizer_path(tmp_path: Path) -> Path:
    """A ``tokenizer.json`` that makes one token of every UTF-8 byte (byte-level, no merges)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return path
