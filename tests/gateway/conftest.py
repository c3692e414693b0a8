"""Fake replicas and a gateway in front of them.

A :class:`FakeReplica` answers like a ``cadenza serve`` process, just enough for the gateway:

- ``POST /v1/completions`` and ``/v1/chat/completions``: with ``"stream": true``, ``chunks`` SSE
  events ``data: {"replica": NAME, "i": I}`` ``delay_s`` apart (with ``paced``, each event after
  the first waits for a ``send_next.release()`` instead), then ``data: [DONE]``; else one JSON
  body ``{"replica": NAME}``. Every answer carries ``x-request-id: NAME-N``.
- ``GET /v1/models``: a model list naming the replica.

It records what it received (``received``: path, lower-case headers, body) and when it sent each
event (``sent_at``), counts requests in flight, and can misbehave on purpose (``mode``): ``"429"`` (with ``Retry-After: retry_after``),
``"503"``, ``"close"`` (drops the connection before answering), ``"die"`` (streams
``die_after`` events, then drops the connection). ``gate`` holds every request before it answers
until set; ``disconnected`` is set when the client of a stream went away before its end.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from cadenza.gateway.app import create_gateway_app
from cadenza.gateway.upstreams import Upstreams


@dataclass(eq=False)
class FakeReplica:
    name: str
    chunks: int = 3
    delay_s: float = 0.0
    paced: bool = False
    mode: str = "ok"
    retry_after: str = "7"
    die_after: int = 2
    url: str = ""
    received: list[dict] = field(default_factory=list)
    sent_at: list[float] = field(default_factory=list)  # time.monotonic() of each streamed event
    in_flight: int = 0
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    send_next: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(0))

    def __post_init__(self) -> None:
        self.gate.set()

    @property
    def calls(self) -> int:
        return len(self.received)

    def make_app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        return app

    async def models(self, request: web.Request) -> web.Response:
        self.received.append({"path": request.path_qs, "headers": _lower(request.headers), "body": b""})
        return web.json_response({"object": "list", "data": [{"id": "fake", "owned_by": self.name}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.received.append({"path": request.path_qs, "headers": _lower(request.headers), "body": body})
        request_id = {"x-request-id": f"{self.name}-{self.calls}"}
        self.in_flight += 1
        try:
            await self.gate.wait()
            if self.mode == "429":
                return web.json_response({"error": {"message": "busy", "type": "rate_limit_error", "param": None,
                                                     "code": None}}, status=429,
                                         headers={"Retry-After": self.retry_after, **request_id})
            if self.mode == "503":
                return web.json_response({"error": {"message": "draining", "type": "service_unavailable",
                                                     "param": None, "code": None}}, status=503, headers=request_id)
            if self.mode == "close":
                request.transport.close()
                return web.Response()
            if not json.loads(body or b"{}").get("stream"):
                return web.json_response({"replica": self.name}, headers=request_id)
            return await self._stream(request, request_id)
        finally:
            self.in_flight -= 1

    async def _stream(self, request: web.Request, headers: dict) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", **headers})
        await resp.prepare(request)
        try:
            for i in range(self.chunks):
                if self.mode == "die" and i == self.die_after:
                    request.transport.close()
                    return resp
                if i and self.paced:
                    await self.send_next.acquire()
                elif i:
                    await asyncio.sleep(self.delay_s)
                self.sent_at.append(time.monotonic())
                await resp.write(f"data: {json.dumps({'replica': self.name, 'i': i})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionError, asyncio.CancelledError):
            self.disconnected.set()
            raise
        await resp.write_eof()
        return resp


def _lower(headers) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


def _unused_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def dead_url() -> str:
    """A URL where nothing listens (connection refused)."""
    return _unused_url()


@pytest.fixture
def other_dead_url(dead_url) -> str:
    """Another URL where nothing listens."""
    url = _unused_url()
    return url if url != dead_url else _unused_url()


@pytest.fixture
def start_replica(aiohttp_server) -> Callable[..., Awaitable[FakeReplica]]:
    async def start(name: str, **settings) -> FakeReplica:
        replica = FakeReplica(name, **settings)
        server = await aiohttp_server(replica.make_app())
        replica.url = str(server.make_url("")).rstrip("/")
        return replica

    return start


@pytest.fixture
def start_gateway(aiohttp_client):
    """``await start_gateway({"interactive": [urls], "batch": [urls]}, **create_gateway_app kwargs)``.

    Health checks are off unless a test asks for them (``health_interval_s``), so what a test
    arranges is not changed under it by a check.
    """

    async def start(roles: dict[str, list[str]], **settings):
        settings.setdefault("health_interval_s", 0)
        return await aiohttp_client(create_gateway_app(Upstreams(roles), **settings))

    return start
