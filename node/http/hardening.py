"""HTTP connection hardening: JSON answers to malformed requests, and header, idle and body timeouts.

Used by :func:`cadenza.node.http.runner.run_app` for both ``cadenza serve`` and ``cadenza gateway``.

**Malformed requests.** What aiohttp's parser refuses before any handler runs (a request line or
header line over 8190 bytes, more than 128 headers, a bad request line or header) is answered in
the OpenAI error format with a fixed message that never echoes the input — aiohttp's own answer
is ``text/plain`` and quotes up to 100 bytes of the offending line, which may be part of an
``Authorization`` token — and the connection is closed: 431 ``request_header_fields_too_large``
for an over-long line or too many headers, 400 ``malformed_http_request`` otherwise. The
offending bytes are not logged either.

**Timeouts** (:class:`HttpTimeouts`, seconds):

- *header*: the request line and headers must arrive within ``header_timeout_s`` of the
  connection opening or of the first byte of a later request on it; else a 408 (when part of a
  request came) or a plain close (when nothing came). This stops slowloris clients.
- *idle*: a keep-alive connection with no request in progress is closed ``idle_timeout_s`` after
  its last response.
- *body*: a handler reads the request body inside ``async with body_timeout(request):``; a body
  that has not fully arrived after ``body_timeout_s`` is a 408 and the connection is closed. A
  body whose ``Content-Length`` is over the app's ``client_max_size`` (32 MiB, ``MAX_BODY_BYTES``
  of :mod:`cadenza.node.wire`) is a 413 at once, before any of it is waited for.
- *send*: a streamed response is written with :func:`send`; a client that reads nothing for
  ``send_timeout_s`` (its socket buffers stay full) loses the connection, so the handler ends and
  the generation is aborted instead of holding its KV blocks for as long as the client likes.

Defaults, compared with other servers:

====================  ===========  ===============================  ==========================
timeout               cadenza      nginx                            uvicorn
====================  ===========  ===============================  ==========================
header                10 s         ``client_header_timeout`` 60 s   none (h11: size cap only)
idle (keep-alive)     75 s         ``keepalive_timeout`` 75 s       ``--timeout-keep-alive`` 5 s
body                  60 s total   ``client_body_timeout`` 60 s     none
                                   (between two reads)
send                  60 s         ``send_timeout`` 60 s            none
====================  ===========  ===============================  ==========================

Headers are one small packet from any real client (a few ms even on a poor mobile link), so
10 s is generous and still cuts a slowloris connection six times sooner than nginx would. The
idle timeout must be *longer* than the idle timeout of whatever proxy pools connections to us
— the proxy may otherwise send a request on a connection we are closing, and a POST is not
retried: ingress-nginx and AWS load balancers keep idle upstream connections for 60 s, the
cadenza gateway's client pool for 15 s. So 75 s (nginx's own client default), not uvicorn's 5 s
and not aiohttp's 3630 s; behind a proxy with a longer idle timeout, raise it above that one's.
The body timeout is total rather than between reads (nginx's), which also stops a client
trickling one byte at a time; 60 s at the 32 MiB body limit is ~0.5 MiB/s, and a 128k-token
prompt (~0.5 MiB) needs only ~9 KiB/s.

**aiohttp internals this relies on** (the same in aiohttp 3.9.5 and 3.14.5, though 3.9 does not
limit the number of headers; every one is exercised by ``tests/node/server/test_http_hardening.py``,
which fails if an upgrade breaks it):

- ``web.AppRunner._make_server()`` builds the ``web.Server`` (after the app's start-up) that
  ``web.TCPSite`` uses as its protocol factory (``Server.__call__`` makes one
  ``web_protocol.RequestHandler`` per connection); our runner replaces it by a ``web.Server``
  subclass built from the same ``request_handler``, ``request_factory``,
  ``handler_cancellation`` and ``Server._kwargs`` (the keyword arguments for each handler).
- ``RequestHandler.handle_error(request, status, exc, message)`` makes the response for a
  parse error (``status`` 400, ``exc`` an ``aiohttp.http_exceptions.HttpProcessingError``:
  ``LineTooLong``, or ``BadHttpMessage("Too many headers received")``), a handler crash (500)
  or a handler's ``TimeoutError`` (504).
- ``RequestHandler._waiter`` is a pending future exactly while the connection waits for the
  next request (aiohttp's own keep-alive check reads it the same way); ``data_received`` resolves
  it once a request's headers are parsed.
- ``RequestHandler.keep_alive(True)`` cancels the pending keep-alive timer (the idle timeout
  comes from the handler's ``keepalive_timeout``, which aiohttp also starts when a connection
  opens), and ``force_close()`` closes the connection at once.
- After a response, a request whose body is at EOF is not lingered on, and ``close()`` ends the
  connection instead of waiting for the next request.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.web_protocol import RequestHandler

from cadenza.node.core.config import ConfigError
from cadenza.node.http.errors import APIError, error_body

logger = logging.getLogger(__name__)

TOO_LARGE_CODE = "request_header_fields_too_large"
MALFORMED_CODE = "malformed_http_request"


@dataclass(frozen=True, slots=True)
class HttpTimeouts:
    """How long a client may take over each part of an HTTP exchange (seconds; see module doc).

    Attributes:
        header_timeout_s: from the connection opening, or the first byte of a request, to the end
            of its headers.
        idle_timeout_s: from a response to the next request on a keep-alive connection.
        body_timeout_s: for reading a whole request body (:func:`body_timeout`).
        send_timeout_s: for one write of a streamed response to make progress (:func:`send`).
        shutdown_timeout_s: on SIGTERM, how long requests in flight (streams included) may take to
            finish after the server stops listening; then they are cancelled.

    Raises:
        ConfigError: a value that is not a positive finite number; the message names the field.
    """

    header_timeout_s: float = 10.0
    idle_timeout_s: float = 75.0
    body_timeout_s: float = 60.0
    send_timeout_s: float = 60.0
    shutdown_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "idle_timeout_s", "body_timeout_s", "send_timeout_s", "shutdown_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool)
                    and math.isfinite(value) and value > 0):
                raise ConfigError(name, f"must be a positive number of seconds, got {value!r}")


_DEFAULTS = HttpTimeouts()
HTTP_TIMEOUTS = web.AppKey("http_timeouts", HttpTimeouts)


# --- the body timeout, for handlers ---------------------------------------------------------------

@contextlib.asynccontextmanager
async def body_timeout(request: web.Request) -> AsyncIterator[None]:
    """Bound the reading of ``request``'s body: ``async with body_timeout(request): await request.read()``.

    The limit is the app's ``HTTP_TIMEOUTS`` (set by ``run_app``), else the default 60 s. When it
    passes, the connection is closed after the answer (the rest of the body is not waited for).
    A ``Content-Length`` over the app's ``client_max_size`` is refused before anything is read:
    waiting for a body that would be refused anyway only holds the connection.

    Raises:
        APIError: 413 ``body_too_large`` when the declared length is over the limit; 408
            ``body_timeout`` when the body has not arrived in time.
    """
    declared, most = request.content_length, request.client_max_size
    if declared is not None and most and declared > most:
        _close_after_answer(request)
        raise APIError(413, f"the request body ({declared} bytes) is over the {most}-byte limit",
                       code="body_too_large", headers={"Connection": "close"})
    limit = request.config_dict.get(HTTP_TIMEOUTS, _DEFAULTS).body_timeout_s
    try:
        async with asyncio.timeout(limit) as deadline:
            yield
    except TimeoutError:
        if not deadline.expired():
            raise
        _close_after_answer(request)
        raise APIError(408, f"the request body did not arrive within {limit:g} s", code="body_timeout",
                       headers={"Connection": "close"}) from None


def _close_after_answer(request: web.Request) -> None:
    """Close the connection after the answer without reading the rest of the body (EOF keeps
    aiohttp from lingering, up to 10 s, for it)."""
    if request.protocol is not None:
        request.protocol.close()
    request.content.feed_eof()


# aiohttp waits for the client (drains) only once its write buffer passes 64 KiB; below a quarter of
# that a write returns at once, so it is sent without arming a timer.
_UNTIMED_WRITE_BYTES = 2**14


async def send(request: web.Request, response: web.StreamResponse, data: bytes) -> None:
    """Write ``data`` to a prepared streaming ``response`` within the app's ``send_timeout_s``.

    Raises:
        ConnectionResetError: the client read nothing for that long; the connection is aborted
            (aiohttp then treats the handler's end as a client disconnect).
    """
    transport = request.transport
    if transport is not None and transport.get_write_buffer_size() + len(data) < _UNTIMED_WRITE_BYTES:
        await response.write(data)  # fits the buffer: cannot wait on the client, needs no timer (hot path)
        return
    limit = request.config_dict.get(HTTP_TIMEOUTS, _DEFAULTS).send_timeout_s
    try:
        async with asyncio.timeout(limit) as deadline:
            await response.write(data)
    except TimeoutError:
        if not deadline.expired():
            raise
        if request.transport is not None:
            request.transport.abort()
        raise ConnectionResetError(f"the client read nothing for {limit:g} s") from None


# --- command-line options ---------------------------------------------------------------------------

def _seconds(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not (math.isfinite(number) and number > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {value!r}")
    return number


def add_http_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--header-timeout-s``, ``--idle-timeout-s``, ``--body-timeout-s``, ``--send-timeout-s``
    and ``--shutdown-timeout-s``."""
    group = parser.add_argument_group("HTTP connection timeouts")
    group.add_argument("--header-timeout-s", type=_seconds, default=_DEFAULTS.header_timeout_s, metavar="SECONDS",
                       help="a request's line and headers must arrive within this many seconds of its first byte "
                            "(or of the connection opening), else the connection is closed (default: %(default)s)")
    group.add_argument("--idle-timeout-s", type=_seconds, default=_DEFAULTS.idle_timeout_s, metavar="SECONDS",
                       help="close a keep-alive connection idle this long; keep it above the idle timeout of any "
                            "proxy in front (default: %(default)s)")
    group.add_argument("--body-timeout-s", type=_seconds, default=_DEFAULTS.body_timeout_s, metavar="SECONDS",
                       help="a request body must arrive within this many seconds, else 408 (default: %(default)s)")
    group.add_argument("--send-timeout-s", type=_seconds, default=_DEFAULTS.send_timeout_s, metavar="SECONDS",
                       help="drop a streaming client that reads nothing for this many seconds (default: %(default)s)")
    group.add_argument("--shutdown-timeout-s", type=_seconds, default=_DEFAULTS.shutdown_timeout_s, metavar="SECONDS",
                       help="on SIGTERM, stop listening and let requests in flight finish for up to this many "
                            "seconds; keep it above the longest generation (default: %(default)s)")


def http_timeouts_from_args(args: argparse.Namespace) -> HttpTimeouts:
    """The :class:`HttpTimeouts` of options added by :func:`add_http_arguments`.

    Raises:
        ConfigError: a value that is not a positive finite number.
    """
    return HttpTimeouts(args.header_timeout_s, args.idle_timeout_s, args.body_timeout_s, args.send_timeout_s,
                        args.shutdown_timeout_s)


# --- the runner, server and per-connection protocol -------------------------------------------------

def app_runner(app: web.Application, timeouts: HttpTimeouts, **kwargs: Any) -> web.AppRunner:
    """A ``web.AppRunner`` for ``app`` whose connections are hardened (see the module doc).

    ``timeouts`` is also stored as ``app[HTTP_TIMEOUTS]`` for :func:`body_timeout`; ``kwargs`` go
    to ``web.AppRunner`` (``keepalive_timeout`` is ``timeouts.idle_timeout_s``).
    """
    app[HTTP_TIMEOUTS] = timeouts
    return _AppRunner(app, timeouts, **kwargs)


class _AppRunner(web.AppRunner):
    __slots__ = ("_timeouts",)

    def __init__(self, app: web.Application, timeouts: HttpTimeouts, **kwargs: Any) -> None:
        super().__init__(app, keepalive_timeout=timeouts.idle_timeout_s, shutdown_timeout=timeouts.shutdown_timeout_s,
                         **kwargs)
        self._timeouts = timeouts

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()  # runs the app's start-up
        return _Server(plain.request_handler, request_factory=plain.request_factory,
                       handler_cancellation=plain.handler_cancellation,
                       header_timeout_s=self._timeouts.header_timeout_s, **plain._kwargs)


class _Server(web.Server):
    """aiohttp's low-level server whose protocol objects are :class:`_RequestHandler`."""

    def __init__(self, handler: Any, *, header_timeout_s: float, request_factory: Any = None,
                 handler_cancellation: bool = False, loop: asyncio.AbstractEventLoop | None = None,
                 **kwargs: Any) -> None:
        super().__init__(handler, request_factory=request_factory, handler_cancellation=handler_cancellation,
                         loop=loop, **kwargs)
        self._handler_loop = loop or asyncio.get_running_loop()
        self._handler_kwargs = kwargs
        self._header_timeout_s = header_timeout_s

    def __call__(self) -> RequestHandler:
        return _RequestHandler(self, loop=self._handler_loop, header_timeout_s=self._header_timeout_s,
                               **self._handler_kwargs)


class _RequestHandler(RequestHandler):
    """One connection: JSON answers to parse errors, and the header timeout.

    The header timer runs from the connection opening, or from the first bytes of a request that
    arrive while the connection is idle, until that request's headers are parsed. While it runs,
    aiohttp's keep-alive (idle) timer is stopped once any byte came, and started again by aiohttp
    after the response. A request pipelined behind one being handled is bounded by the idle
    timeout instead (it is closed without a 408).
    """

    __slots__ = ("_header_timeout_s", "_header_timer", "_request_started")

    def __init__(self, manager: web.Server, *, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._header_timeout_s = header_timeout_s
        self._header_timer: asyncio.TimerHandle | None = None
        self._request_started = False  # some bytes of the awaited request have come

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._start_header_timer()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        waiter = self._waiter  # pending only while waiting for the next request
        super().data_received(data)
        if waiter is None or not data:
            return  # a request is being handled: these are body bytes or pipelined requests
        if waiter.done():  # a whole request (or a parse error) is queued
            self._stop_header_timer()
        elif not self._request_started:
            self._request_started = True
            self.keep_alive(True)  # stops the idle timer: the header timer governs now
            if self._header_timer is None:
                self._start_header_timer()

    def _start_header_timer(self) -> None:
        self._header_timer = asyncio.get_running_loop().call_later(self._header_timeout_s, self._header_timed_out)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        self._request_started = False

    def _header_timed_out(self) -> None:
        self._header_timer = None
        waiter = self._waiter
        if waiter is None or waiter.done() or self.transport is None:
            return  # the headers came; a request is being handled
        logger.debug("closing a connection from %s: no complete request headers within %g s",
                     self.transport.get_extra_info("peername"), self._header_timeout_s)
        if self._request_started:
            self.transport.write(_HEADER_TIMEOUT_RESPONSE)
        self.force_close()

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """The response to a request aiohttp could not parse (400) or whose handler failed (500, 504).

        The body is OpenAI JSON with a fixed message; ``message`` and ``exc`` (which quote the
        client's input) are neither sent nor logged. The connection is closed.

        Raises:
            ConnectionError: part of a response was sent already (as aiohttp's own).
        """
        if request.writer.output_size > 0:
            raise ConnectionError("Response is sent already, cannot send another response with the error message")
        status, text, code = _describe(status, exc)
        if status >= 500:
            logger.error("error handling %s %s from %s", request.method, request.path, request.remote, exc_info=exc)
        else:
            logger.debug("refused a malformed request from %s: %s %s", request.remote, status, type(exc).__name__)
        resp = web.json_response(error_body(status, text, code=code), status=status, headers={"Connection": "close"})
        resp.force_close()
        return resp


def _describe(status: int, exc: BaseException | None) -> tuple[int, str, str | None]:
    """(status, message, code) for an error aiohttp hands to ``handle_error``."""
    if status == 400:
        if isinstance(exc, LineTooLong):
            return 431, "request line or header field too large", TOO_LARGE_CODE
        if isinstance(exc, BadHttpMessage) and exc.message.startswith("Too many headers"):
            return 431, "too many request header fields", TOO_LARGE_CODE
        return 400, "malformed HTTP request", MALFORMED_CODE
    if status == 504:
        return 504, "the request timed out in the server", None
    if status >= 500:
        return status, "internal server error; the request was not completed", None
    return status, HTTPStatus(status).phrase.lower(), None


def _raw_json_response(status: int, message: str, code: str) -> bytes:
    body = json.dumps(error_body(status, message, code=code)).encode()
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: application/json; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode() + body


_HEADER_TIMEOUT_RESPONSE = _raw_json_response(408, "the request headers did not arrive in time", "header_timeout")
