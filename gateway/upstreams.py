"""The gateway's table of upstreams: replicas by role, and what the gateway knows of each.

A pool's replicas serve in one of two **roles**, ``interactive`` and ``batch``. In colocated mode
both roles list the same replicas; in dedicated mode they are disjoint. A disaggregated pool adds
``prefill`` replicas, which only prefill prompts for the others (:mod:`.disagg`). A replica that appears in
both roles is one :class:`Upstream` (one outstanding count), however many roles list it.

An upstream is **full** when it has ``max_outstanding`` requests in flight through this gateway,
or when it answered 429 and the ``Retry-After`` it gave has not passed yet.

An upstream is **down** from the moment it could not be reached — a request's connection failed,
or the gateway's health check (:mod:`.health`: ``GET /health`` every couple of seconds, with a
timeout, so a hung replica is caught too) failed — until it answers again. A request still waiting
for the answer of a replica that goes down gives up on it (and may be retried elsewhere): a hung
replica does not hold it forever. Which upstream a request goes to is the router's to decide
(:mod:`.router`), which keeps its counts and back-off here.

The table is changed in place (:meth:`Upstreams.replace`) by an upstream source — the config file
watcher or the Kubernetes EndpointSlice poller — while requests run. It is used from one event
loop only and takes no locks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from cadenza.node.kv_transfer.threshold import Rule

SERVING_ROLES = ("interactive", "batch")  # the roles traffic classes are routed to
ROLES = (*SERVING_ROLES, "prefill")  # prefill: replicas that only prefill prompts for others (optional)


@dataclass(slots=True, eq=False)
class Upstream:
    """One replica, as the gateway sees it.

    Attributes:
        url: base URL, e.g. ``http://10.0.0.7:8000`` (no trailing slash).
        outstanding: requests in flight through this gateway (sent, response not yet finished).
        blocked_until: monotonic time (seconds) before which the replica asked not to be sent more
            (its last 429's ``Retry-After``); 0 when it has not.
        failures: consecutive requests or health checks that could not reach it; it is down
            while this is above 0.
        went_down: set when it goes from up to down (requests still waiting for its answer give
            up on it then), cleared when it is up again.
        unready_until: monotonic time before which it said it cannot serve (a 503 with
            ``Retry-After``: loading or draining); long prompts are not prefilled for it meanwhile.
        disagg_rule: the selective disaggregation rule it last reported (a decode replica's
            ``x-cadenza-disagg-rule``), None before it has.
        queued_tokens, queued_pairs: as a prefill replica, the prompts this gateway has sent it
            that it is still computing: their tokens, and the sum of ``n^2 / 2`` over them (the
            terms of their predicted prefill time, :meth:`Rule.queue_s`).
    """

    url: str
    outstanding: int = 0
    blocked_until: float = 0.0
    failures: int = 0
    went_down: asyncio.Event = field(default_factory=asyncio.Event)
    unready_until: float = 0.0
    disagg_rule: Rule | None = None
    queued_tokens: int = 0
    queued_pairs: float = 0.0

    @property
    def is_down(self) -> bool:
        return self.failures > 0

    def is_full(self, max_outstanding: int, now: float) -> bool:
        return self.outstanding >= max_outstanding or now < self.blocked_until

    def queue_prompt(self, tokens: int) -> None:
        """As a prefill replica: a prompt of ``tokens`` tokens sent to it (:meth:`unqueue_prompt` at its end)."""
        self.queued_tokens += tokens
        self.queued_pairs += tokens * tokens / 2

    def unqueue_prompt(self, tokens: int) -> None:
        self.queued_tokens -= tokens
        self.queued_pairs = max(0.0, self.queued_pairs - tokens * tokens / 2)

    def wait_s(self, max_outstanding: int, now: float) -> float:
        """Seconds until this upstream may be tried again: its 429 back-off, or 1 s when only busy."""
        if now < self.blocked_until:
            return self.blocked_until - now
        return 1.0 if self.outstanding >= max_outstanding else 0.0


class Upstreams:
    """The replicas of each role, shared by every request of one gateway.

    Args:
        roles: role name -> upstream base URLs. Unknown roles are refused; a missing role has none.
        clock: monotonic clock in seconds (tests pass a fake one).

    Raises:
        ValueError: for a role that is not ``interactive`` or ``batch``.
    """

    def __init__(self, roles: Mapping[str, Iterable[str]] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._by_url: dict[str, Upstream] = {}
        self._roles: dict[str, list[Upstream]] = {role: [] for role in ROLES}
        self.replace(roles or {})

    def replace(self, roles: Mapping[str, Iterable[str]]) -> bool:
        """Set the replicas of every role; replicas kept keep their counts and back-off.

        Requests in flight to a dropped replica finish normally (they hold their :class:`Upstream`).
        Returns whether anything changed.

        Raises:
            ValueError: for an unknown role (nothing is changed then).
        """
        unknown = set(roles) - set(ROLES)
        if unknown:
            raise ValueError(f"roles: unknown role(s) {sorted(unknown)}; roles are {', '.join(ROLES)}")
        new_urls = {role: list(dict.fromkeys(u.rstrip("/") for u in roles.get(role, ()))) for role in ROLES}
        if new_urls == {role: [u.url for u in ups] for role, ups in self._roles.items()}:
            return False
        by_url = {url: self._by_url.get(url) or Upstream(url) for urls in new_urls.values() for url in urls}
        self._by_url = by_url
        self._roles = {role: [by_url[u] for u in urls] for role, urls in new_urls.items()}
        return True

    def urls(self) -> dict[str, list[str]]:
        """Role -> base URLs, in configuration order (``prefill`` only when it has replicas)."""
        return {role: [u.url for u in ups] for role, ups in self._roles.items() if role != "prefill" or ups}

    def of_role(self, role: str) -> list[Upstream]:
        return list(self._roles.get(role, ()))

    def all(self) -> list[Upstream]:
        """Every known upstream once, whatever its roles."""
        return list(self._by_url.values())

    @staticmethod
    def unreachable(upstream: Upstream) -> None:
        """``upstream`` could not be reached: it is down until it answers."""
        upstream.failures += 1
        upstream.went_down.set()

    @staticmethod
    def answered(upstream: Upstream) -> None:
        """``upstream`` answered: it is up."""
        upstream.failures = 0
        upstream.went_down.clear()

    def reachable(self, role: str) -> list[Upstream]:
        """The role's upstreams that are not down."""
        return [u for u in self._roles.get(role, ()) if not u.is_down]

    def snapshot(self, max_outstanding: int) -> dict[str, list[dict]]:
        """Role -> ``[{url, outstanding, full, retry_after_s, down}]`` for ``GET /gateway/upstreams``."""
        now = self.clock()
        return {
            role: [
                {"url": u.url, "outstanding": u.outstanding, "full": u.is_full(max_outstanding, now),
                 "retry_after_s": round(max(0.0, u.blocked_until - now), 3), "down": u.is_down}
                for u in ups
            ]
            for role, ups in self._roles.items()
        }
