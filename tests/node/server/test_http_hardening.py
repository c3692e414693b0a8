"""HTTP connection hardening, spoken to over raw sockets: JSON for malformed requests, and timeouts.

Each test serves a tiny app (or the real gateway app) on a free loopback port through
:func:`cadenza.node.http.hardening.app_runner`, the runner ``run_app`` uses. Timeouts are tiny (0.5 s)
and every wait is bounded generously (5 s), so a slow machine does not fail a test; a server that
never times out does. These tests also guard the aiohttp internals the module relies on.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from cadenza.node.core.config import CacheConfig, ConfigError, EngineConfig, SchedulerConfig
from cadenza.gateway.app import create_gateway_app
from cadenza.gateway.upstreams import Upstreams
from cadenza.node.http import hardening as http
from cadenza.node.server import admin, auth
from cadenza.node.http.errors import error_middleware
from cadenza.node.server.app import create_app
from cadenza.node.server.app_keys import ENGINE
from cadenza.node.http.runner import run_app
from cadenza.node.wire import MAX_BODY_BYTES
from waiting import until

SECRET = "sk-cadenza-SECRET-0123456789"
BOUND_S = 5.0  # the most any test waits for the server to act on a 0.5 s timeout
FAST = dict(header_timeout_s=0.5, idle_timeout_s=0.5, body_timeout_s=0.5)


async def ping(request: web.Request) -> web.Response:
    return web.json_response({"pong": True})


async def echo(request: web.Request) -> web.Response:
    async with http.body_timeout(request):
        body = await request.read()
    return web.json_response({"bytes": len(body)})


async def crash(request: web.Request) -> web.Response:
    raise RuntimeError(SECRET)


def tiny_app(middlewares=(error_middleware,)) -> web.Application:
    app = web.Application(middlewares=list(middlewares))
    app.router.add_get("/ping", ping)
    app.router.add_post("/echo", echo)
    app.router.add_get("/crash", crash)
    return app


Serve = Callable[..., Awaitable[int]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """``port = await serve(app, **HttpTimeouts fields)``: the app served as ``run_app`` serves it."""
    runners: list[web.AppRunner] = []

    async def start(app: web.Application | None = None, **timeouts: float) -> int:
        runner = http.app_runner(app or tiny_app(), http.HttpTimeouts(**timeouts), handler_cancellation=True,
                                 access_log=None)
        runners.append(runner)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner.addresses[0][1]

    yield start
    for runner in runners:
        await runner.cleanup()


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One response (status, lower-case headers, body), read within ``BOUND_S``."""
    async with asyncio.timeout(BOUND_S):
        head = await reader.readuntil(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").rstrip("\r\n").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
        body = await reader.readexactly(int(headers.get("content-length", "0")))
    return int(status_line.split()[1]), headers, body


async def closed_by_server(reader: asyncio.StreamReader) -> bytes:
    """What the server sends until it closes the connection, which must happen within ``BOUND_S``."""
    try:
        async with asyncio.timeout(BOUND_S):
            return await reader.read()
    except TimeoutError:
        pytest.fail(f"the server kept the connection open for more than {BOUND_S} s")
    except ConnectionResetError:
        return b""


async def request(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes, bytes]:
    """Send ``raw`` on a new connection: the response and what came after it until the server closed."""
    reader, writer = await connect(port)
    try:
        writer.write(raw)
        status, headers, body = await read_response(reader)
        return status, headers, body, await closed_by_server(reader)
    finally:
        writer.close()


def assert_json_error(status: int, headers: dict[str, str], body: bytes, code: str | None) -> dict:
    assert headers["content-type"].startswith("application/json")
    assert headers.get("connection", "").lower() == "close"
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    return error


async def drip(writer: asyncio.StreamWriter, data: bytes, every_s: float = 0.2, sent: list | None = None) -> None:
    """Send ``data`` one byte at a time, ``every_s`` apart, until done or the server hangs up;
    ``sent`` gets one entry per byte written."""
    try:
        for i in range(len(data)):
            writer.write(data[i:i + 1])
            await writer.drain()
            if sent is not None:
                sent.append(i)
            await asyncio.sleep(every_s)
    except ConnectionError:
        pass


# --- malformed requests ------------------------------------------------------------------------------

async def test_an_over_long_header_gets_a_json_431_that_echoes_none_of_it(serve, caplog):
    caplog.set_level(logging.DEBUG)
    port = await serve()
    token = (SECRET * 400)[:9000]
    status, headers, body, rest = await request(
        port, f"GET /ping HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\r\n".encode())
    assert status == 431
    error = assert_json_error(status, headers, body, http.TOO_LARGE_CODE)
    assert error["type"] == "invalid_request_error"
    assert rest == b""  # and then the connection was closed
    for leak in (body.decode(), json.dumps(headers), caplog.text):
        assert "SECRET" not in leak and "Bearer" not in leak


async def test_too_many_headers_get_a_json_431(serve):
    port = await serve()
    many = "".join(f"X-Header-{i}: {i}\r\n" for i in range(300))
    status, headers, body, rest = await request(port, f"GET /ping HTTP/1.1\r\nHost: x\r\n{many}\r\n".encode())
    assert status == 431
    assert_json_error(status, headers, body, http.TOO_LARGE_CODE)
    assert rest == b""


@pytest.mark.parametrize("raw", [
    f"NOT-HTTP {SECRET}\r\n\r\n".encode(),
    f"GET /ping HTTP/1.1\r\nHost: x\r\nBad Header {SECRET}\r\n\r\n".encode(),
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 tls hello\r\n\r\n",
])
async def test_a_malformed_request_gets_a_json_400_that_echoes_none_of_it(serve, caplog, raw):
    caplog.set_level(logging.DEBUG)
    port = await serve()
    status, headers, body, rest = await request(port, raw)
    assert status == 400
    error = assert_json_error(status, headers, body, http.MALFORMED_CODE)
    assert error["message"] == "malformed HTTP request"
    assert rest == b""
    assert SECRET not in body.decode() and SECRET not in caplog.text


async def test_a_handler_crash_outside_the_error_middleware_is_a_json_500_without_details(serve):
    port = await serve(tiny_app(middlewares=()))
    status, headers, body, _ = await request(port, b"GET /crash HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 500
    assert_json_error(status, headers, body, None)
    assert SECRET not in body.decode()


# --- header and idle timeouts ------------------------------------------------------------------------

async def test_a_slowloris_client_is_cut_after_the_header_timeout_while_others_are_served(serve):
    port = await serve(header_timeout_s=0.5, idle_timeout_s=30)
    reader, writer = await connect(port)
    started = time.monotonic()
    sent: list[int] = []
    dripping = asyncio.create_task(drip(writer, b"GET /ping HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100,
                                        sent=sent))
    try:
        await until(lambda: sent)  # the slow request has begun
        status, _, body, _ = await request(port, b"GET /ping HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert (status, json.loads(body)) == (200, {"pong": True})
        answer = await closed_by_server(reader)
        assert time.monotonic() - started >= 0.4  # cut by the timeout, not at once
    finally:
        dripping.cancel()
        writer.close()
    assert answer.startswith(b"HTTP/1.1 408 ")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"application/json" in head and json.loads(body)["error"]["code"] == "header_timeout"


async def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(serve):
    port = await serve(header_timeout_s=0.5, idle_timeout_s=30)
    reader, writer = await connect(port)
    try:
        assert await closed_by_server(reader) == b""  # nothing was asked, so nothing is answered
    finally:
        writer.close()


async def test_an_idle_keep_alive_connection_is_closed_after_the_idle_timeout(serve):
    port = await serve(header_timeout_s=30, idle_timeout_s=0.5)
    reader, writer = await connect(port)
    try:
        for _ in range(2):  # keep-alive works, then the idle connection is closed
            writer.write(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
            status, headers, _ = await read_response(reader)
            assert status == 200 and headers.get("connection", "keep-alive").lower() == "keep-alive"
        assert await closed_by_server(reader) == b""
    finally:
        writer.close()


async def test_a_request_begun_before_the_idle_deadline_gets_the_whole_header_timeout(serve):
    port = await serve(header_timeout_s=5, idle_timeout_s=1)
    reader, writer = await connect(port)
    try:
        writer.write(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await read_response(reader))[0] == 200
        await asyncio.sleep(0.2)
        writer.write(b"GET /ping HTTP/1.1\r\n")
        await asyncio.sleep(1.5)  # past the idle deadline, well within the header timeout
        writer.write(b"Host: x\r\n\r\n")
        assert (await read_response(reader))[0] == 200
    finally:
        writer.close()


# --- body timeout ------------------------------------------------------------------------------------

async def test_a_slow_body_is_cut_with_a_json_408_and_the_connection_closed(serve):
    port = await serve(header_timeout_s=30, idle_timeout_s=30, body_timeout_s=0.5)
    reader, writer = await connect(port)
    writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
    dripping = asyncio.create_task(drip(writer, b"x" * 100))
    try:
        status, headers, body = await read_response(reader)
        assert status == 408
        error = assert_json_error(status, headers, body, "body_timeout")
        assert "0.5 s" in error["message"]
        assert await closed_by_server(reader) == b""  # at once, not after aiohttp's 10 s lingering
    finally:
        dripping.cancel()
        writer.close()


async def test_a_prompt_body_within_the_timeout_is_read_and_the_connection_kept(serve):
    port = await serve(**FAST)
    reader, writer = await connect(port)
    try:
        for _ in range(2):
            writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
            status, _, body = await read_response(reader)
            assert (status, json.loads(body)) == (200, {"bytes": 5})
    finally:
        writer.close()


async def declared_too_large(port: int, method: str, path: str, extra: str = "") -> tuple[int, dict, bytes, float]:
    """``method path`` declaring a 1 GiB body and sending none of it: the answer and its delay."""
    started = time.monotonic()
    reader, writer = await connect(port)
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: x\r\n{extra}Content-Type: application/json\r\n"
                 f"Content-Length: {2**30}\r\n\r\n".encode())
    try:
        status, headers, body = await read_response(reader)
        assert await closed_by_server(reader) == b""  # the unsent body is not waited for either
    finally:
        writer.close()
    return status, headers, body, time.monotonic() - started


async def test_a_body_declared_over_the_limit_is_a_413_at_once_not_a_408_after_the_body_timeout(
        serve, monkeypatch, tiny_llama_dir):
    slow_body = dict(header_timeout_s=30, idle_timeout_s=30, body_timeout_s=30)
    monkeypatch.setenv(auth.TOKEN_ENV, SECRET)
    config = EngineConfig(model=str(tiny_llama_dir), served_model_name="tiny",
                          scheduler=SchedulerConfig(token_budget=64, chunk_size=16, max_model_len=256),
                          cache=CacheConfig(block_size=16, num_kv_blocks=64))
    server = create_app(config, "tiny")
    gateway = create_gateway_app(Upstreams({"interactive": []}), health_interval_s=0)
    ports = {"server": await serve(server, **slow_body), "gateway": await serve(gateway, **slow_body)}
    await server[ENGINE].wait_ready()
    for name, method, path, extra in [
            ("server", "POST", "/v1/chat/completions", ""), ("server", "POST", "/v1/completions", ""),
            ("server", "PUT", "/admin/config", f"Authorization: Bearer {SECRET}\r\n"),
            ("gateway", "POST", "/v1/completions", "")]:
        status, headers, body, seconds = await declared_too_large(ports[name], method, path, extra)
        assert status == 413, (name, path, body)
        error = assert_json_error(status, headers, body, "body_too_large")
        assert str(MAX_BODY_BYTES) in error["message"] and seconds < BOUND_S
    assert server[ENGINE].stats().num_finished == 0  # nothing reached the engine


# --- the real gateway, and run_app ---------------------------------------------------------------------

async def test_the_gateway_refuses_long_headers_and_slow_bodies_in_json(serve):
    port = await serve(create_gateway_app(Upstreams({"interactive": []}), health_interval_s=0), **FAST)
    status, headers, body, _ = await request(
        port, f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {SECRET * 400}\r\n\r\n".encode())
    assert status == 431 and SECRET not in body.decode()
    assert_json_error(status, headers, body, http.TOO_LARGE_CODE)

    reader, writer = await connect(port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{")
    try:
        status, headers, body = await read_response(reader)
        assert status == 408
        assert_json_error(status, headers, body, "body_timeout")
    finally:
        writer.close()


async def test_the_admin_api_cuts_a_slow_put_body_with_a_json_408(serve, monkeypatch):
    monkeypatch.setenv(auth.TOKEN_ENV, SECRET)
    app = web.Application(middlewares=[error_middleware])
    admin.add_routes(app)  # the body is read before the engine is asked: no model needed
    port = await serve(app, **FAST)
    reader, writer = await connect(port)
    writer.write(f"PUT /admin/config HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {SECRET}\r\n"
                 "Content-Length: 30\r\n\r\n{".encode())
    try:
        status, headers, body = await read_response(reader)
        assert status == 408
        assert_json_error(status, headers, body, "body_timeout")
    finally:
        writer.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_run_app_serves_with_the_timeouts_it_is_given():
    port = free_port()

    async def main(stop: asyncio.Event) -> int:
        reader, writer = await connect(port)
        try:
            writer.write(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await read_response(reader))[0] == 200
            assert await closed_by_server(reader) == b""  # the 0.5 s idle timeout, not the default 75 s
        finally:
            writer.close()
        return 7

    timeouts = http.HttpTimeouts(idle_timeout_s=0.5)
    assert await run_app(tiny_app(), "127.0.0.1", port, "test", main, timeouts=timeouts) == 7


async def test_the_aiohttp_hooks_relied_on_are_in_place(serve):
    """A canary with a clear message for an aiohttp upgrade; the tests above check the behaviour."""
    assert list(inspect.signature(RequestHandler.handle_error).parameters) == [
        "self", "request", "status", "exc", "message"]
    assert "_waiter" in RequestHandler.__slots__ and callable(web.AppRunner._make_server)
    runner = http.app_runner(tiny_app(), http.HttpTimeouts(idle_timeout_s=42), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        reader, writer = await connect(runner.addresses[0][1])
        writer.write(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await read_response(reader))[0] == 200
        (connection,) = runner.server.connections
        assert type(connection) is http._RequestHandler and connection.keepalive_timeout == 42
        writer.close()
    finally:
        await runner.cleanup()


# --- configuration -----------------------------------------------------------------------------------

@pytest.mark.parametrize("field", ["header_timeout_s", "idle_timeout_s", "body_timeout_s"])
@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), True, "10"])
def test_timeouts_must_be_positive_finite_seconds(field, value):
    with pytest.raises(ConfigError, match=f"^{field}: "):
        http.HttpTimeouts(**{field: value})


def test_timeout_options_default_to_the_dataclass_and_refuse_bad_values():
    parser = argparse.ArgumentParser()
    http.add_http_arguments(parser)
    assert http.http_timeouts_from_args(parser.parse_args([])) == http.HttpTimeouts()
    args = parser.parse_args(["--header-timeout-s", "2", "--idle-timeout-s", "90", "--body-timeout-s", "0.5"])
    assert http.http_timeouts_from_args(args) == http.HttpTimeouts(2, 90, 0.5)
    for bad in ("0", "-3", "nan", "inf", "soon"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--idle-timeout-s", bad])
    help_text = " ".join(parser.format_help().split())
    assert all(f"(default: {seconds})" in help_text for seconds in (10.0, 75.0, 60.0))


async def test_a_streaming_client_that_reads_nothing_is_dropped_after_the_send_timeout(serve):
    ended: asyncio.Future = asyncio.get_running_loop().create_future()

    async def flood(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            while True:  # an endless stream: only the send timeout can end it
                await http.send(request, response, b"data: " + b"x" * 65536 + b"\n\n")
        except ConnectionResetError as exc:
            ended.set_result(str(exc))
            raise

    app = tiny_app()
    app.router.add_get("/flood", flood)
    port = await serve(app, send_timeout_s=0.5)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"GET /flood HTTP/1.1\r\nHost: x\r\n\r\n")  # and never read
    try:
        reason = await asyncio.wait_for(ended, timeout=BOUND_S * 2)
        assert "read nothing" in reason
        reader, writer = await connect(port)  # the server serves others meanwhile
        writer.write(b"GET /ping HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert (await asyncio.wait_for(reader.read(), BOUND_S)).startswith(b"HTTP/1.1 200")
        writer.close()
    finally:
        sock.close()
