"""The pool's engine counters at the gateway: ``GET /gateway/stats``, its replicas' ``/ready`` summed.

A replica's ``GET /ready`` holds its engine's counters (``num_steps``, ``prefill_tokens_admitted``,
``decode_tokens``, ``kv_blocks_used``, ``prefix_cache_hit_tokens``, ...; see
:class:`cadenza.node.core.stats.EngineStats`). A client of the gateway — ``cadenza bench``
pointed at a pool — cannot reach the replicas, so the gateway answers for the pool: every integer
counter or gauge at the top level of the replicas' answers, summed over the replicas it knows
(every role, each replica once). Per-replica values that do not add up (a threshold, means,
percentiles, ratios: :data:`NOT_ADDITIVE` and every float) are left out. The answer says how many
replicas it covers (``replicas``: ``known``, ``answered`` now, ``stale``: those that did not answer
this time and count with their last answer, so the sums of cumulative counters do not drop while
a replica is slow) and never lists their addresses.

The gateway's own ``/ready`` stays a cheap probe that asks no replica; it names this path
(``engine_stats``), which is how ``cadenza bench`` finds it. Asking every replica costs a request
each, so one collection runs at a time: calls that arrive while it runs share its result, and a
flood of concurrent calls costs each replica one ``/ready`` per collection (each bounded by
:data:`TIMEOUT_S`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from typing import Any

import aiohttp

from cadenza.gateway.upstreams import Upstream

PATH = "/gateway/stats"
READY_PATH = "/ready"
NOT_ADDITIVE = frozenset({"kv_transfer_min_prompt_tokens"})  # integer, but a threshold: sums mean nothing
TIMEOUT_S = 2.0  # one replica's answer


def additive(body: Any) -> dict[str, int]:
    """The integer counters and gauges at the top level of a replica's ``/ready`` JSON object
    (booleans, floats, nested objects and :data:`NOT_ADDITIVE` keys left out); ``{}`` for
    anything else."""
    if not isinstance(body, dict):
        return {}
    return {k: v for k, v in body.items()
            if isinstance(v, int) and not isinstance(v, bool) and k not in NOT_ADDITIVE}


def pool_sums(samples: Iterable[dict[str, int]]) -> dict[str, int]:
    """Key-wise sums of the replicas' counters (a key some replica lacks counts 0 for it)."""
    total: dict[str, int] = {}
    for sample in samples:
        for key, value in sample.items():
            total[key] = total.get(key, 0) + value
    return total


class EngineStats:
    """Collects and sums the replicas' ``/ready`` counters; one instance per gateway app.

    It is used from one event loop only.
    """

    def __init__(self) -> None:
        self._last: dict[str, dict[str, int]] = {}  # replica URL -> its last counters
        self._running: asyncio.Future | None = None

    async def collect(self, session: aiohttp.ClientSession, upstreams: list[Upstream]) -> dict[str, Any]:
        """The pool's sums now (those of the collection in progress, when one is): see the module
        docstring."""
        if self._running is None or self._running.done():
            self._running = asyncio.ensure_future(self._collect(session, upstreams))
        return await asyncio.shield(self._running)  # a caller that goes away leaves it to the others

    async def _collect(self, session: aiohttp.ClientSession, upstreams: list[Upstream]) -> dict[str, Any]:
        answers = await asyncio.gather(*(self._ask(session, u.url) for u in upstreams))
        urls = {u.url for u in upstreams}
        self._last = {url: counters for url, counters in self._last.items() if url in urls}
        for upstream, counters in zip(upstreams, answers):
            if counters is not None:
                self._last[upstream.url] = counters
        answered = sum(a is not None for a in answers)
        stale = sum(a is None and u.url in self._last for u, a in zip(upstreams, answers))
        return {**pool_sums(self._last[u.url] for u in upstreams if u.url in self._last),
                "replicas": {"known": len(upstreams), "answered": answered, "stale": stale}}

    @staticmethod
    async def _ask(session: aiohttp.ClientSession, url: str) -> dict[str, int] | None:
        try:
            async with session.get(url + READY_PATH, timeout=aiohttp.ClientTimeout(total=TIMEOUT_S),
                                   allow_redirects=False) as resp:
                if resp.status != 200:
                    return None
                return additive(json.loads(await resp.read()))
        except (aiohttp.ClientError, TimeoutError, ValueError):  # ValueError: not JSON
            return None
