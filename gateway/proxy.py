"""Forwarding one request to a replica: route it, retry once before the first byte, relay.

1. **Route**: the ``x-cadenza-class`` header (case-insensitive; the gateway default when absent)
   names the request's class; an invalid class is a 400 from the gateway itself. The router
   (:mod:`.router`) chooses the replica: of the class's role, the one with the fewest requests in
   flight through this gateway, avoiding replicas that are down. If every one is full the gateway
   answers 429 with ``Retry-After`` and calls nobody; if the role has no replica known yet, 503.
   A long completion prompt in a pool with ``prefill`` replicas is prefilled on the prefill
   replica the router chooses first (:mod:`.disagg`).
2. **Send**: the method, path, query, body and end-to-end headers unchanged (``traceparent`` and
   ``tracestate`` included, so the replica's span is a child of the caller's).
3. **Retry** at most once, to the other replica of the role the router chooses, and only while
   nothing has reached the client: after a connection error (which also marks that replica down
   until it answers a request or a health check), or an upstream 502, 503, 504 or 429 (a 429 also
   backs that replica off for its ``Retry-After``). Re-sending a POST is safe then because the
   client has seen nothing of the first try; the abandoned upstream request is closed, so the
   replica aborts it. If the retry fails too, the client gets the last upstream answer, or a 502
   when no replica answered at all.
4. **Relay**: status and end-to-end headers, then the body chunk by chunk as it arrives (SSE
   included), never buffered. When the client goes away the upstream connection is closed (the
   replica cancels the request and frees its KV blocks). When the replica dies mid-stream there is
   no retry: an SSE client gets an OpenAI-format ``error`` event, and the connection is closed
   without the final chunk, so every client sees a truncated body rather than a clean end.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import NamedTuple

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from cadenza.gateway import disagg
from cadenza.gateway.headers import disagg_rule, request_headers, response_headers, retry_after_s
from cadenza.gateway.router import ROLE_OF_CLASS, NoReplica, Route
from cadenza.gateway.state import METRICS, ROUTER, SESSION, SETTINGS, UPSTREAMS
from cadenza.gateway.upstreams import Upstream
from cadenza.node.core.policy import PolicyError, check_class
from cadenza.node.http.errors import APIError, error_body
from cadenza.node.http.hardening import body_timeout, send
from cadenza.node.wire import CLASS_HEADER

logger = logging.getLogger(__name__)

# the class and arrival of a proxied request, for the latency histograms
TIMED: web.RequestKey[tuple] = web.RequestKey("cadenza_timed", tuple)


class _Failed(NamedTuple):
    """An upstream's error answer, kept (it is small) in case the retry fails too."""

    status: int
    reason: str | None
    headers: CIMultiDict[str]
    body: bytes


def request_class(request: web.Request) -> str:
    """The traffic class of ``request``: its ``x-cadenza-class`` header, else the gateway default.

    Raises:
        APIError: 400 for a value that is not ``interactive``, ``batch`` or ``background``.
    """
    value = request.headers.get(CLASS_HEADER)
    if value is None:
        return request.app[SETTINGS].default_class
    try:
        return check_class(value)
    except PolicyError as exc:
        raise APIError(400, f"{CLASS_HEADER}: {exc.reason}", param=CLASS_HEADER) from None


async def proxy_by_class(request: web.Request) -> web.StreamResponse:
    """Any ``/v1/...`` request: forwarded to the replicas of its class's role."""
    started = time.monotonic()
    cls = request_class(request)
    request[TIMED] = (cls, started)  # the class and arrival, for the latency histograms
    body = await _read(request)
    parsed, tokens = disagg.prompt_of(request, body)
    route = _choose(request, cls, tokens)
    try:
        extra = await disagg.prefill_first(request, route, parsed)  # a long prompt is prefilled elsewhere first
        return await forward(request, route, body, extra)
    finally:
        request.app[ROUTER].finish(route)
        disagg.cancel_prefill(request)


async def proxy_to_any(request: web.Request) -> web.StreamResponse:
    """``GET /v1/models``: every replica serves the same model, so any one of them answers."""
    body = await _read(request)
    route = _choose(request, None, 0)
    try:
        return await forward(request, route, body)
    finally:
        request.app[ROUTER].finish(route)


async def _read(request: web.Request) -> bytes:
    async with body_timeout(request):  # a 408 for a client that trickles its body
        return await request.read()  # before routing: from a choice to its count, nothing may await


def _replicas(traffic_class: str | None) -> str:
    return "replica" if traffic_class is None else f"{ROLE_OF_CLASS[traffic_class]} replica"


def _choose(request: web.Request, traffic_class: str | None, prompt_tokens: int) -> Route:
    """The router's route for the request (counted: the caller finishes it).

    Raises:
        APIError: 503 when there is no replica to choose from, 429 when all are full.
    """
    try:
        return request.app[ROUTER].choose(traffic_class, prompt_tokens, request.app[UPSTREAMS].clock())
    except NoReplica as exc:
        what = _replicas(traffic_class)
        if not exc.busy:
            raise APIError(503, f"no {what} is known yet", code="no_upstream", headers={"Retry-After": "1"}) from None
        raise APIError(429, f"every {what} is busy; retry in {exc.retry_after_s} s", code="upstreams_full",
                       headers={"Retry-After": str(exc.retry_after_s)}) from None


async def forward(request: web.Request, route: Route, body: bytes,
                  extra_headers: CIMultiDict[str] | None = None) -> web.StreamResponse:
    """Send ``request`` (its ``body``, with ``extra_headers``) to ``route.decode``, retrying once
    before the first byte where the router says.

    Raises:
        APIError: 502 when no replica answered.
    """
    app = request.app
    headers = request_headers(request.headers, request.remote)
    if extra_headers:
        headers.update(extra_headers)
    failed: _Failed | None = None
    while True:
        answer = await _attempt(request, route, headers, body)
        if isinstance(answer, web.StreamResponse):
            return answer
        failed = answer or failed
        upstream = app[ROUTER].retry(route, app[UPSTREAMS].clock())
        if upstream is None:
            break
        logger.info("retrying %s %s on %s", request.method, request.path, upstream.url)
    if failed is not None:
        return web.Response(status=failed.status, reason=failed.reason, headers=failed.headers, body=failed.body)
    raise APIError(502, f"no {_replicas(route.traffic_class)} could be reached", code="upstream_unreachable")


async def _attempt(request: web.Request, route: Route, headers: CIMultiDict[str],
                   body: bytes) -> web.StreamResponse | _Failed | None:
    """One try on ``route.decode``: the relayed response, or the upstream's retryable error
    answer (while the router would retry it), or None when the upstream could not be reached
    (or broke before its answer was read)."""
    app, upstream = request.app, route.decode
    upstreams, router = app[UPSTREAMS], app[ROUTER]
    url = URL(upstream.url + request.raw_path, encoded=True)
    try:
        resp = await _send_unless_down(app[SESSION].request(request.method, url, headers=headers,
                                                            data=body or None, allow_redirects=False), upstream)
    except _WentDown:
        logger.warning("%s went down before answering %s %s", upstream.url, request.method, request.path)
        return None
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:  # ValueError: a malformed upstream URL
        logger.warning("%s did not answer %s %s: %r", upstream.url, request.method, request.path, exc)
        upstreams.unreachable(upstream)
        return None
    upstreams.answered(upstream)
    try:
        if resp.status == 429:
            router.back_off(upstream, retry_after_s(resp.headers.get("Retry-After")), upstreams.clock())
        elif resp.status == 503 and "Retry-After" in resp.headers:  # loading or draining: no prefilling for it
            router.unready(upstream, retry_after_s(resp.headers["Retry-After"]), upstreams.clock())
        if router.should_retry(route, resp.status):
            logger.warning("%s answered %s %s with %d", upstream.url, request.method, request.path, resp.status)
            try:
                return _Failed(resp.status, resp.reason, response_headers(resp.headers), await resp.read())
            except (aiohttp.ClientError, TimeoutError):
                return None
        return await _relay(request, resp, upstream)
    finally:
        resp.close()  # a no-op once the body was read; else the replica sees the request aborted


class _WentDown(Exception):
    """The upstream was marked down (a failed health check) while this request waited for it."""


async def _send_unless_down(send, upstream: Upstream) -> aiohttp.ClientResponse:
    """Await ``send`` (the request, up to its response headers), giving up if ``upstream`` goes down
    meanwhile — a hung replica fails its health check, and the request is freed to be retried.
    A replica already down when picked (every candidate was) is waited for as usual.

    Raises:
        _WentDown: it went down first (the request is cancelled, which closes its connection).
    """
    task = asyncio.ensure_future(send)
    if upstream.is_down:
        return await task
    down = asyncio.ensure_future(upstream.went_down.wait())
    try:
        done, _ = await asyncio.wait({task, down}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        down.cancel()
        if not task.done():
            task.cancel()
    if task not in done:
        raise _WentDown
    return task.result()


async def _relay(request: web.Request, resp: aiohttp.ClientResponse, upstream: Upstream) -> web.StreamResponse:
    """Pass ``resp`` to the client: status, headers, then each chunk as soon as it arrives."""
    if (rule := disagg_rule(resp.headers)) is not None:
        upstream.disagg_rule = rule
    out = web.StreamResponse(status=resp.status, reason=resp.reason, headers=response_headers(resp.headers))
    await out.prepare(request)
    timed = request.get(TIMED)
    timer = (request.app[METRICS].stream(*timed)
             if timed and resp.status == 200 and resp.content_type == "text/event-stream" else None)
    while True:
        try:
            chunk = await resp.content.readany()
        except (aiohttp.ClientError, TimeoutError) as exc:
            logger.warning("%s broke off %s %s mid-response: %r", upstream.url, request.method, request.path, exc)
            await _end_broken(request, out, resp)
            return out
        if not chunk:
            break
        if timer is not None:
            timer.chunk(chunk)
        try:
            await send(request, out, chunk)
        except ConnectionError:  # the client went away or stopped reading: closing resp aborts upstream
            logger.info("client left %s %s; closing the upstream request", request.method, request.path)
            return out
    await out.write_eof()
    return out


async def _end_broken(request: web.Request, out: web.StreamResponse, resp: aiohttp.ClientResponse) -> None:
    """End a response whose upstream died: an SSE ``error`` event, then a close without the final
    chunk, so no client mistakes the truncated body for a complete one."""
    if resp.content_type == "text/event-stream":
        event = error_body(502, "the replica broke off the stream", code="upstream_stream_interrupted")
        try:
            await out.write(f"data: {json.dumps(event)}\n\n".encode())
        except ConnectionError:
            pass
    if request.transport is not None:
        request.transport.close()
