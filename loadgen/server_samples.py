"""Server-side samples taken during a replay: cadenza's ``GET /ready`` counters over time.

A cadenza server answers ``GET <origin>/ready`` with HTTP 200 and a JSON object holding, among
others, the keys in :data:`SAMPLE_KEYS`: ``num_steps`` (engine steps so far),
``prefill_tokens_admitted`` and ``decode_tokens`` (tokens scheduled so far, cumulative),
``kv_blocks_used`` / ``kv_blocks_cached`` / ``kv_blocks_total`` (KV cache blocks) and
``num_running`` / ``num_waiting`` (requests). The prefix-cache counters in
:data:`OPTIONAL_KEYS` (``prefix_cache_queried_tokens``: prompt tokens looked up at admission,
``prefix_cache_hit_tokens``: those found cached, both cumulative) are kept when the server has
them; :func:`prefix_cache_hits` turns them into the run's hit rate. The origin is the base URL
without its path: ``http://127.0.0.1:8000/v1`` is polled at ``http://127.0.0.1:8000/ready``.

A cadenza gateway (in front of a pool: ``cadenza up``, or a cluster's ``<pool>-gateway``) answers
``/ready`` with its own state and names the path where it sums its replicas' counters
(``"engine_stats": "/gateway/stats"``, :mod:`cadenza.gateway.engine_stats`): the sampler
follows it on the first poll and samples the whole pool there, with the same keys.

A :class:`ServerSampler` polls every ``interval_s`` while the replay runs, plus once more at the
end, and keeps ``{"t": seconds since the replay started, **those keys}`` per answer. Another kind
of server (a 4xx such as 404, HTML, JSON without the keys) is detected on the first poll:
sampling stops, no samples are kept and :attr:`ServerSampler.note` says why. A poll that times
out, cannot connect or gets a 5xx (a busy or loading server) is skipped and noted, and polling
goes on. Nothing here ever fails the replay.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Sequence
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import aiohttp

SAMPLE_KEYS = ("num_steps", "prefill_tokens_admitted", "decode_tokens", "kv_blocks_used",
               "kv_blocks_cached", "kv_blocks_total", "num_running", "num_waiting")
OPTIONAL_KEYS = ("prefix_cache_queried_tokens", "prefix_cache_hit_tokens")
DEFAULT_INTERVAL_S = 0.5


def ready_url(base_url: str) -> str:
    """``<scheme>://<host>[:port]/ready`` of an API base URL such as ``http://h:8000/v1``."""
    parts = urlsplit(base_url)
    return f"{parts.scheme}://{parts.netloc}/ready"


def pool_stats_path(body: str) -> str | None:
    """The path a gateway's ``/ready`` body names for its pool's counters (``engine_stats``), else None."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    path = obj.get("engine_stats") if isinstance(obj, dict) else None
    return path if isinstance(path, str) and path.startswith("/") and not path.startswith("//") else None


def parse_sample(body: str, t: float) -> dict[str, Any]:
    """One sample from a ``/ready`` body: ``t`` (seconds), the :data:`SAMPLE_KEYS` values and
    those of the :data:`OPTIONAL_KEYS` the body has as numbers.

    Raises:
        ValueError: the body is not a JSON object, or lacks a key, or a value is not a number.
    """
    try:
        obj = json.loads(body)
    except ValueError:
        raise ValueError("the answer is not JSON") from None
    if not isinstance(obj, dict):
        raise ValueError("the answer is not a JSON object")
    missing = [k for k in SAMPLE_KEYS if k not in obj]
    if missing:
        raise ValueError(f"the answer lacks {', '.join(missing)}")
    bad = [k for k in SAMPLE_KEYS if isinstance(obj[k], bool) or not isinstance(obj[k], (int, float))]
    if bad:
        raise ValueError(f"non-numeric {', '.join(bad)}")
    optional = {k: obj[k] for k in OPTIONAL_KEYS
                if isinstance(obj.get(k), (int, float)) and not isinstance(obj[k], bool)}
    return {"t": t, **{k: obj[k] for k in SAMPLE_KEYS}, **optional}


class PrefixCacheHits(NamedTuple):
    """Prompt tokens found in the prefix cache over a run (between two samples)."""

    hit_tokens: int
    queried_tokens: int

    @property
    def rate(self) -> float:
        """``hit_tokens / queried_tokens``, a fraction in [0, 1]."""
        return self.hit_tokens / self.queried_tokens


def prefix_cache_hits(samples: Sequence[dict[str, Any]]) -> PrefixCacheHits | None:
    """The growth of the prefix-cache counters from the first to the last sample that has them.

    Returns:
        The hit and queried token deltas; None (n/a) when fewer than two samples have the
        counters (another server, or one without them), when no prompt token was looked up in
        between, or when a counter went down (the server restarted).
    """
    have = [s for s in samples if all(k in s for k in OPTIONAL_KEYS)]
    if len(have) < 2:
        return None
    first, last = have[0], have[-1]
    hit = last["prefix_cache_hit_tokens"] - first["prefix_cache_hit_tokens"]
    queried = last["prefix_cache_queried_tokens"] - first["prefix_cache_queried_tokens"]
    if queried <= 0 or not 0 <= hit <= queried:
        return None
    return PrefixCacheHits(int(hit), int(queried))


class ServerSampler:
    """Polls ``/ready`` in the background of a replay; see the module docstring.

    Args:
        base_url: the API base URL (its origin is polled).
        interval_s: seconds between polls (measured from the replay's start, not drifting).
        timeout_s: limit for one poll, in seconds.
        headers: sent with every poll (e.g. ``Authorization``).

    Attributes:
        url: the polled URL (a gateway's ``/gateway/stats`` once its ``/ready`` named it).
        samples: the samples so far, in time order.
        note: why samples are missing (none at all, or some polls failed), else None.
    """

    def __init__(self, base_url: str, interval_s: float = DEFAULT_INTERVAL_S,
                 timeout_s: float = 5.0, headers: dict[str, str] | None = None) -> None:
        if interval_s <= 0:
            raise ValueError(f"sampling interval must be > 0 seconds, got {interval_s}")
        self.url = self._ready_url = ready_url(base_url)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.headers = dict(headers or {})
        self.samples: list[dict[str, Any]] = []
        self.note: str | None = None
        self._polls = 0
        self._failures = 0
        self._first_failure: str | None = None
        self._gave_up = False
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._clock_zero = 0.0

    async def poll(self, session: aiohttp.ClientSession, clock_zero: float) -> bool:
        """Take one sample; ``clock_zero`` is the replay start on ``time.perf_counter``'s clock.

        Returns:
            True when a sample was kept. An answer that is not cadenza's before any sample was
            kept stops all sampling; timeouts, connection errors and 5xx answers do not.
        """
        if self._gave_up:
            return False
        self._polls += 1
        try:
            async with session.get(self.url, headers=self.headers,
                                   timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as resp:
                body = await resp.text()
                if resp.status >= 500:
                    return self._failed(f"HTTP {resp.status}", final=False)
                if resp.status != 200:
                    raise ValueError(f"HTTP {resp.status}")
                try:
                    sample = parse_sample(body, time.perf_counter() - clock_zero)
                except ValueError:
                    path = pool_stats_path(body) if self.url == self._ready_url else None
                    if path is None:
                        raise
                    self.url = self._ready_url.removesuffix("/ready") + path  # a gateway: its pool's sums
                    self._polls -= 1  # the same poll, asked where the counters are
                    return await self.poll(session, clock_zero)
        except asyncio.TimeoutError:
            return self._failed(f"no answer within {self.timeout_s:g} s", final=False)
        except (aiohttp.ClientError, OSError) as exc:
            return self._failed(f"{type(exc).__name__}: {exc}", final=False)
        except ValueError as exc:  # UnicodeDecodeError included
            return self._failed(str(exc) or type(exc).__name__, final=True)
        self.samples.append(sample)
        self._update_note()
        return True

    def _failed(self, reason: str, final: bool) -> bool:
        """Count a failed poll; ``final``: the answer shows the server is not cadenza."""
        self._failures += 1
        self._first_failure = self._first_failure or reason
        if final and not self.samples:
            self._gave_up = True
        self._update_note()
        return False

    def _update_note(self) -> None:
        if not self._failures:
            self.note = None
        elif not self.samples:
            why = ("not a cadenza server" if self._gave_up
                   else f"{self._failures} of {self._polls} polls failed")
            self.note = (f"no server samples: GET {self.url} gave {self._first_failure} ({why}); "
                         "only client-side numbers are reported")
        else:
            self.note = (f"{self._failures} of {self._polls} polls of {self.url} failed "
                         f"(first: {self._first_failure}); their samples are missing")

    async def _loop(self) -> None:
        """Poll at ticks 0, 1, 2, ... x ``interval_s``; ticks missed by a slow answer are skipped."""
        tick = 0
        while not self._gave_up:
            await self.poll(self._session, self._clock_zero)
            elapsed = time.perf_counter() - self._clock_zero
            tick = max(tick + 1, int(elapsed / self.interval_s) + 1)
            await asyncio.sleep(max(self._clock_zero + tick * self.interval_s - time.perf_counter(), 0.0))

    def start(self, session: aiohttp.ClientSession, clock_zero: float) -> None:
        """Start polling now, on the running loop, until :meth:`stop`."""
        self._session, self._clock_zero = session, clock_zero
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        """Stop polling, then take a last sample (so the replay's end is covered)."""
        if self._task is None:
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
        await self.poll(self._session, self._clock_zero)
