"""The gateway application: its own probes and debug view, the proxied ``/v1`` routes, lifecycle.

Routes:

- ``GET /health``: liveness, always 200 while the process serves.
- ``GET /ready``: 200 while some serving role has a replica that is known and not down (its last
  request or health check reached it), with the replicas known and up per role (``prefill`` too,
  in a disaggregated pool), naming the roles that cannot serve; 503 (OpenAI format) only when no
  serving role can. It asks no replica: a cheap probe.
- ``GET /gateway/stats``: the pool's engine counters, the replicas' ``/ready`` counters summed
  (:mod:`.engine_stats`; what ``cadenza bench`` samples through a gateway).
- ``GET /gateway/upstreams``: per role, every replica with its requests in flight and whether it
  is full (for debugging).
- ``GET /v1/models``: proxied to any replica.
- any other ``/v1/...``: proxied by traffic class (:mod:`.proxy`).
- ``GET /metrics``: the gateway's own client-side TTFT / ITL histograms per class, Prometheus
  text (:mod:`.metrics`; each replica's engine metrics are scraped from the replica).
- ``/admin/...``: 404 saying that each replica serves its own admin API (an admin change is per
  replica), at the same path on its own address inside the pool; the replicas' addresses are not
  given to whoever asks.
- anything else: 404 in OpenAI format.

The app owns one :class:`aiohttp.ClientSession` (no total timeout, so streams last as long as
their generation; a connect timeout, so a dead replica is noticed) and, when given one, an
upstream source that keeps the table current, both opened and closed in ``cleanup_ctx``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Protocol

import aiohttp
from aiohttp import web

from cadenza.gateway import engine_stats
from cadenza.gateway import health as health_checks
from cadenza.gateway import proxy
from cadenza.gateway.metrics import GatewayMetrics
from cadenza.gateway.state import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_HEALTH_INTERVAL_S,
    DEFAULT_MAX_OUTSTANDING,
    ENGINE_STATS,
    METRICS,
    PREFILL_CALLS,
    ROUTER,
    SESSION,
    SETTINGS,
    UPSTREAMS,
    GatewaySettings,
)
from cadenza.gateway.router import Router
from cadenza.gateway.upstreams import SERVING_ROLES, Upstreams
from cadenza.node.http.errors import error_middleware, error_response
from cadenza.node.wire import MAX_BODY_BYTES

logger = logging.getLogger(__name__)


class UpstreamSource(Protocol):
    """Something that keeps an :class:`Upstreams` table current (config file, Kubernetes)."""

    async def watch(self, upstreams: Upstreams) -> None:
        """Update ``upstreams`` until cancelled; never raise for a failed refresh."""


def create_gateway_app(
    upstreams: Upstreams,
    default_class: str = "interactive",
    max_outstanding: int = DEFAULT_MAX_OUTSTANDING,
    *,
    source: UpstreamSource | None = None,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    health_interval_s: float = DEFAULT_HEALTH_INTERVAL_S,
    slo_targets_s: tuple[float, ...] = (),
    disagg_min_prompt_tokens: int | str | None = None,
) -> web.Application:
    """Build a gateway in front of the replicas in ``upstreams``.

    Args:
        upstreams: the replicas by role; the caller (or ``source``) may change it while serving.
        default_class: class of requests without ``x-cadenza-class``.
        max_outstanding: requests in flight through this gateway that make a replica full.
        source: keeps ``upstreams`` current while the app runs (started and cancelled with it).
        connect_timeout_s: seconds to connect to a replica before it counts as unreachable.
        health_interval_s: seconds between health checks of every replica (:mod:`.health`); 0: none.
        slo_targets_s: the pool's SLO targets (seconds); the latency histograms are dense around them.
        disagg_min_prompt_tokens: prompts at least this long are prefilled on a ``prefill``
            replica when there is one (:mod:`.disagg`); ``"auto"``: the decode replicas' threshold; None: never.

    Serve it with ``web.AppRunner(app, handler_cancellation=True)`` (as :mod:`.cli` does), so a
    client that disconnects while its replica is still silent cancels the upstream request at once;
    without it the disconnect is noticed at the next chunk written.

    Raises:
        ValueError: an invalid class or limit.
    """
    app = web.Application(middlewares=[error_middleware], client_max_size=MAX_BODY_BYTES)
    settings = app[SETTINGS] = GatewaySettings(default_class, max_outstanding, connect_timeout_s, health_interval_s,
                                               disagg_min_prompt_tokens)
    app[UPSTREAMS] = upstreams
    app[ROUTER] = Router(upstreams, settings.max_outstanding, settings.disagg_min_prompt_tokens)
    app[METRICS] = GatewayMetrics(slo_targets_s)
    app[METRICS].disagg_threshold = app[ROUTER].threshold
    app[PREFILL_CALLS] = set()
    app[ENGINE_STATS] = engine_stats.EngineStats()
    app.on_cleanup.append(_stop_metrics)
    app.on_shutdown.append(_stop_prefill_calls)
    app.cleanup_ctx.append(_client_session)
    if source is not None:
        app.cleanup_ctx.append(_run_source(source))
    if health_interval_s:
        app.cleanup_ctx.append(_health_checks)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/gateway/upstreams", upstreams_view)
    app.router.add_get(engine_stats.PATH, pool_engine_stats)
    app.router.add_get("/v1/models", proxy.proxy_to_any)
    app.router.add_route("*", "/v1/{tail:.*}", proxy.proxy_by_class)
    app.router.add_route("*", "/admin/{tail:.*}", per_replica)
    app.router.add_get("/metrics", metrics)
    return app


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS].prometheus_text(), content_type="text/plain", charset="utf-8")


async def _stop_prefill_calls(app: web.Application) -> None:
    """Cancel prefill calls still being read (their decode calls are being cut too)."""
    for task in list(app[PREFILL_CALLS]):
        task.cancel()
    await asyncio.gather(*app[PREFILL_CALLS], return_exceptions=True)


async def _stop_metrics(app: web.Application) -> None:
    app[METRICS].shutdown()


ADMIN_ELSEWHERE = (
    "the gateway has no {path}: the admin API is per replica. Each replica serves it at {path} on its own "
    "address, inside the pool, with the pool's admin token: in a cluster, each engine pod's port 8000 "
    "(kubectl port-forward pod/POD 8000); under `cadenza up`, the replica addresses it logs at start")


async def per_replica(request: web.Request) -> web.Response:
    """What each replica serves itself: say where it lives instead of a bare 404.

    The answer names no replica address: the gateway is the pool's public entry point, and the
    replicas' addresses are internal (a caller inside the pool already has them).
    """
    return error_response(404, ADMIN_ELSEWHERE.format(path=request.path), code="per_replica")


async def _client_session(app: web.Application) -> AsyncIterator[None]:
    timeout = aiohttp.ClientTimeout(total=None, connect=app[SETTINGS].connect_timeout_s,
                                    sock_connect=app[SETTINGS].connect_timeout_s)
    # No pool cap: the gateway's own limit is max_outstanding per replica. Bodies pass unchanged
    # (no decompression), and no cookies are kept between clients.
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                     cookie_jar=aiohttp.DummyCookieJar()) as session:
        app[SESSION] = session
        yield


async def _health_checks(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    task = asyncio.create_task(health_checks.run_checks(app[SESSION], app[UPSTREAMS], settings.health_interval_s,
                                                        timeout_s=min(settings.health_interval_s, 2.0)),
                               name="gateway-health-checks")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def _run_source(source: UpstreamSource):
    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(source.watch(app[UPSTREAMS]), name="gateway-upstream-source")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    return lifecycle


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """200 while some serving role has a replica up, with the replicas known and up per role
    (``prefill`` included when the pool has one) and the roles that cannot serve now
    (``unavailable``); 503 only when no serving role can.

    A role without a replica (an ``auto`` pool whose replicas are all colocated has no interactive
    one... or a dedicated pool mid-rollout) must not take the gateway out of its Service: the
    classes that can be served still are, and a request of the others gets its own 503. A
    disaggregated pool whose prefill replicas are all down still serves: the decode replicas
    prefill every prompt themselves.
    """
    upstreams = request.app[UPSTREAMS]
    counts = {role: len(urls) for role, urls in upstreams.urls().items()}
    up = {role: len(upstreams.reachable(role)) for role in counts}
    unavailable = {role: ("no replica known" if not counts[role] else "every replica down")
                   for role in counts if not up[role]}
    if "prefill" in unavailable:
        unavailable["prefill"] += ": the decode replicas prefill every prompt"
    if all(role in unavailable for role in SERVING_ROLES):
        detail = "; ".join(f"{role}: {unavailable[role]}" for role in SERVING_ROLES)
        code = "no_upstream" if all(not counts[r] for r in SERVING_ROLES) else "upstreams_unreachable"
        return error_response(503, f"no role can serve ({detail})", code=code, headers={"Retry-After": "1"})
    return web.json_response({"status": "ready", "replicas": counts, "up": up, "unavailable": unavailable,
                              "engine_stats": engine_stats.PATH})


async def pool_engine_stats(request: web.Request) -> web.Response:
    """The replicas' engine counters summed (:mod:`.engine_stats`)."""
    result = await request.app[ENGINE_STATS].collect(request.app[SESSION], request.app[UPSTREAMS].all())
    return web.json_response({"status": "ok", **result})


async def upstreams_view(request: web.Request) -> web.Response:
    settings = request.app[SETTINGS]
    return web.json_response({
        "default_class": settings.default_class,
        "max_outstanding": settings.max_outstanding,
        "roles": request.app[UPSTREAMS].snapshot(settings.max_outstanding),
    })
