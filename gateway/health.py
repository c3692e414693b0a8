"""Active health checks: the gateway asks every upstream ``GET /health`` on a fixed interval.

Request failures alone cannot tell the gateway that a replica is back (a down replica is sent
nothing while others are free), nor that one is hung (it accepts connections and never answers,
so no connection error is ever seen). A check that gets any answer below 500 within the timeout
marks the upstream up; a connection error, a timeout or a 5xx (``cadenza serve`` answers 503 when
its engine died) marks it down (:meth:`Upstreams.unreachable`). Follows the active health
checking of Envoy and NGINX Plus: interval, timeout, a path, no request body.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from cadenza.gateway.upstreams import Upstream, Upstreams

logger = logging.getLogger(__name__)

HEALTH_PATH = "/health"


async def check(session: aiohttp.ClientSession, upstreams: Upstreams, upstream: Upstream, timeout_s: float) -> bool:
    """One check of ``upstream``; records the outcome in ``upstreams`` and returns whether it is up."""
    was_down = upstream.is_down
    try:
        async with session.get(upstream.url + HEALTH_PATH, timeout=aiohttp.ClientTimeout(total=timeout_s),
                               allow_redirects=False) as resp:
            up = resp.status < 500
    except (aiohttp.ClientError, TimeoutError, ValueError):
        up = False
    if up:
        upstreams.answered(upstream)
        if was_down:
            logger.info("%s is up again", upstream.url)
    else:
        upstreams.unreachable(upstream)
        if not was_down:
            logger.warning("%s failed its health check; sending it nothing while others can serve", upstream.url)
    return up


async def run_checks(session: aiohttp.ClientSession, upstreams: Upstreams, interval_s: float,
                     timeout_s: float) -> None:
    """Check every upstream, concurrently, every ``interval_s`` seconds, until cancelled."""
    while True:
        await asyncio.gather(*(check(session, upstreams, u, timeout_s) for u in upstreams.all()))
        await asyncio.sleep(interval_s)
