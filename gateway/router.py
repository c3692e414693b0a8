"""The gateway's routing policy: which replica serves a request, which one prefills its prompt
first, and where a failed try goes next.

One object, :class:`Router`, decides for the aiohttp gateway (:mod:`.proxy` and :mod:`.disagg`,
which do the HTTP) and for ``cadenza sim`` (:mod:`cadenza.sim.fleet`, whose simulated replicas
stand for the upstreams), so the simulator routes as the gateway does. It does no I/O and reads no
clock: every decision takes ``now`` (monotonic seconds).

1. **Role.** A request's traffic class names the role whose replicas serve it
   (:data:`ROLE_OF_CLASS`): ``interactive`` to the interactive replicas, ``batch`` and
   ``background`` to the batch replicas. A request of no class (``GET /v1/models``: every replica
   serves the same model) may go to any replica.
2. **Pick.** Of those, the replica with the fewest requests in flight through this gateway that
   is not **full** (``max_outstanding`` in flight, or backed off: it answered 429 and the
   ``Retry-After`` it gave has not passed), preferring those not down; ties go round robin, as
   Envoy's and NGINX's ``least_request``/``least_conn`` balancers do. When every free one is down
   it picks among them anyway, those with the fewest consecutive failures first (Envoy's "panic"
   routing: a replica that may be back beats a certain error). With no replica known the request
   cannot be routed (the gateway's 503); with every one full neither (its 429, with the seconds
   until the first frees up).
3. **Prefill elsewhere.** In a pool with ``prefill`` replicas, a prompt goes through one of them
   when it is at least the threshold long (:mod:`cadenza.node.kv_transfer.threshold`). Pinned,
   that is a number. With ``auto`` it is solved from the rules the decode replicas reported
   (:attr:`Upstream.disagg_rule`) for the prefill replica the prompt would use, whose queue is
   the prompts routed to it that it is still computing (their predicted prefill seconds); the
   largest over the reachable serving replicas, so a prompt moves only when it pays on each of
   them, and none before one has calibrated. The prefill replica is the one up and not full with
   the fewest queued prompt tokens (ties: the pick); one that refused the prompt (429) is backed
   off from and the next one tried; with none left the prompt is prefilled where it decodes. No
   prompt is moved while none of the request's replicas could take it (all down, full, or
   loading: a 503 with ``Retry-After``): its prefill would be thrown away.
4. **Retry.** A try that failed before the first byte (the replica could not be reached, or
   answered 429, 502, 503 or 504: :data:`RETRY_STATUSES`) is retried once
   (:data:`MAX_ATTEMPTS`), on another of the request's replicas that is not full.

The router counts what it routes: a route's decode replica is in flight from :meth:`Router.choose`
to :meth:`Router.finish` (a retry moves the count), its prefill replica in flight with the prompt
queued until :meth:`Router.prefill_done`. Only this gateway's own requests are counted; the
replicas' queues are theirs to report.

Sources: Envoy's least-request load balancer and panic threshold; SGLang's router, whose policies
are objects; DistServe (Zhong et al., OSDI 2024) and Splitwise (Patel et al., ISCA 2024) for
splitting the phases; llm-d's selective P/D threshold and Dynamo's prefill-length rule for moving
only long prompts.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from cadenza.gateway.upstreams import SERVING_ROLES, Upstream, Upstreams
from cadenza.node.kv_transfer.threshold import Rule

# Traffic class (x-cadenza-class) -> the role whose replicas serve it.
ROLE_OF_CLASS = {"interactive": "interactive", "batch": "batch", "background": "batch"}
MAX_ATTEMPTS = 2  # the first try and at most one retry
RETRY_STATUSES = frozenset({429, 502, 503, 504})  # answers a try may be retried after


class NoReplica(Exception):
    """No replica can take the request now.

    Attributes:
        busy: False when none is known (the gateway's 503), True when every one is full (its 429).
        retry_after_s: whole seconds (at least 1) until one may take it.
    """

    def __init__(self, busy: bool, retry_after_s: int) -> None:
        super().__init__(f"every replica is busy; retry in {retry_after_s} s" if busy else "no replica is known")
        self.busy, self.retry_after_s = busy, retry_after_s


@dataclass(slots=True, eq=False)
class Route:
    """Where one request goes, as :class:`Router` decides it call by call.

    Attributes:
        traffic_class: the request's class; None: any replica will do.
        prompt_tokens: its prompt's length (tokens); 0 for a request no prefill replica could take.
        candidates: the replicas that may serve it (its class's role), as they were when it came.
        decode: the replica serving it, counted in flight; None once released.
        prefill: the prefill replica computing its prompt first, counted in flight with the prompt
            queued; None when the prompt is prefilled where it decodes, or once released.
        tried: the replicas it was sent to, in order (``decode`` last).
        refused: the prefill replicas that refused its prompt.
        kept: why a prompt long enough for an idle prefill replica is prefilled where it decodes:
            ``"kept_queued"`` (not after the queue of the prefill replica it would use) or
            ``"fallback_busy"`` (no prefill replica took it); None otherwise.
        min_prompt_tokens: the threshold with an idle prefill replica when its prompt was weighed
            (None: it was not, or nothing is worth moving).
    """

    traffic_class: str | None
    prompt_tokens: int
    candidates: list[Upstream]
    decode: Upstream | None = None
    prefill: Upstream | None = None
    tried: list[Upstream] = field(default_factory=list)
    refused: list[Upstream] = field(default_factory=list)
    kept: str | None = None
    min_prompt_tokens: int | None = None


class Router:
    """The routing policy over one table of upstreams (see the module's docstring).

    Args:
        upstreams: the replicas by role; the router reads it at every decision (a source may
            change it meanwhile) and keeps its counts and back-off on its :class:`Upstream`\\ s.
        max_outstanding: requests in flight through this gateway that make an upstream full.
        min_prompt_tokens: prompts at least this long go through a ``prefill`` replica when the
            pool has one; ``"auto"``: the threshold the decode replicas' rules give; None: never.
    """

    def __init__(self, upstreams: Upstreams, max_outstanding: int, min_prompt_tokens: int | str | None = None) -> None:
        self.upstreams, self.max_outstanding, self.min_prompt_tokens = upstreams, max_outstanding, min_prompt_tokens
        self._turn = itertools.count()

    def candidates(self, traffic_class: str | None) -> list[Upstream]:
        """The replicas that serve ``traffic_class`` (its role's), or every replica for None."""
        return self.upstreams.all() if traffic_class is None else self.upstreams.of_role(ROLE_OF_CLASS[traffic_class])

    # -- the decisions -----------------------------------------------------------------------------

    def choose(self, traffic_class: str | None, prompt_tokens: int, now: float) -> Route:
        """Route a request of ``traffic_class`` (one of ``ROLE_OF_CLASS``, or None: any replica)
        whose prompt has ``prompt_tokens`` tokens (0: not one a prefill replica could take): its
        prefill replica when its prompt is moved, then its replica, both counted.

        Raises:
            NoReplica: none is known, or every one is full (nothing is counted then).
        """
        candidates = self.candidates(traffic_class)
        if not candidates:
            raise NoReplica(False, 1)
        route = Route(traffic_class, prompt_tokens, candidates)
        if prompt_tokens > 0 and self._worth_moving(route, now):
            route.prefill = self._next_prefill(route, now)
        decode = self.pick(candidates, now)
        if decode is None:  # then none could take it, so no prefill replica was chosen either
            self.prefill_done(route)
            raise NoReplica(True, self.retry_after_s(candidates, now))
        self._send(route, decode)
        return route

    def should_retry(self, route: Route, status: int) -> bool:
        """Whether a try that ``route.decode`` answered with ``status`` is worth another: a
        status of :data:`RETRY_STATUSES` with tries left (else its answer is the request's)."""
        return status in RETRY_STATUSES and len(route.tried) < MAX_ATTEMPTS

    def retry(self, route: Route, now: float) -> Upstream | None:
        """``route.decode`` failed before the first byte: release it, and send the request to
        another of its replicas not full (counted); None when its tries are spent or none is free."""
        self.finish(route)
        if len(route.tried) >= MAX_ATTEMPTS:
            return None
        decode = self.pick(route.candidates, now, exclude=route.tried)
        if decode is not None:
            self._send(route, decode)
        return decode

    def refused(self, route: Route, now: float, retry_after_s: float) -> Upstream | None:
        """``route.prefill`` refused the prompt (a 429 with this ``Retry-After``): back off from
        it, release it, and choose the next prefill replica (counted); None: prefill it where it
        decodes (``route.kept`` says why).

        Raises:
            ValueError: ``route`` has no prefill replica.
        """
        refused = route.prefill
        if refused is None:
            raise ValueError("the route has no prefill replica")
        self.back_off(refused, retry_after_s, now)
        self.prefill_done(route)
        route.refused.append(refused)
        route.prefill = self._next_prefill(route, now)
        return route.prefill

    def finish(self, route: Route) -> None:
        """The request's call to ``route.decode`` has ended: it is no longer in flight there."""
        if route.decode is not None:
            route.decode.outstanding -= 1
            route.decode = None

    def prefill_done(self, route: Route) -> None:
        """The prefill call on ``route.prefill`` has ended (however it ended): release it."""
        if route.prefill is not None:
            route.prefill.outstanding -= 1
            route.prefill.unqueue_prompt(route.prompt_tokens)
            route.prefill = None

    @staticmethod
    def back_off(upstream: Upstream, seconds: float, now: float) -> None:
        """Send ``upstream`` nothing for ``seconds`` (it answered 429 with this ``Retry-After``)."""
        upstream.blocked_until = max(upstream.blocked_until, now + seconds)

    @staticmethod
    def unready(upstream: Upstream, seconds: float, now: float) -> None:
        """``upstream`` cannot serve for ``seconds`` (a 503 with this ``Retry-After``: loading or
        draining): no prompt is prefilled elsewhere for it meanwhile."""
        upstream.unready_until = now + seconds

    # -- least outstanding -----------------------------------------------------------------------

    def pick(self, candidates: list[Upstream], now: float, exclude: Iterable[Upstream] = ()) -> Upstream | None:
        """The candidate with the fewest requests in flight that is not full nor excluded,
        preferring those not down (ties round robin); None when every one is full or excluded."""
        skip = set(map(id, exclude))
        free = [u for u in candidates if id(u) not in skip and not u.is_full(self.max_outstanding, now)]
        if not free:
            return None
        up = [u for u in free if not u.is_down]
        if not up:  # panic: every free candidate is down; try those that failed least
            fewest = min(u.failures for u in free)
            up = [u for u in free if u.failures == fewest]
        least = min(u.outstanding for u in up)
        tied = [u for u in up if u.outstanding == least]
        return tied[next(self._turn) % len(tied)]

    def least_queued(self, candidates: list[Upstream], now: float, exclude: Iterable[Upstream] = ()) -> Upstream | None:
        """The prefill replica for the next prompt: of ``candidates`` up, not full nor excluded,
        one with the fewest queued prompt tokens (ties: :meth:`pick`). None when there is none."""
        skip = set(map(id, exclude))
        free = [u for u in candidates
                if id(u) not in skip and not u.is_down and not u.is_full(self.max_outstanding, now)]
        if not free:
            return None
        least = min(u.queued_tokens for u in free)
        return self.pick([u for u in free if u.queued_tokens == least], now)

    def retry_after_s(self, candidates: list[Upstream], now: float) -> int:
        """Whole seconds (at least 1) until the first of ``candidates`` frees up, for ``Retry-After``."""
        waits = [u.wait_s(self.max_outstanding, now) for u in candidates]
        return max(1, math.ceil(min(waits, default=1.0)))

    # -- the selective rule --------------------------------------------------------------------------

    def threshold(self, prefill: Upstream | None = None) -> int | None:
        """The shortest prompt sent through ``prefill`` now (tokens; None: an idle prefill
        replica): pinned, or with ``auto`` the largest the reachable serving replicas' rules give
        with ``prefill``'s queue. None: never, or no rule reported yet."""
        if self.min_prompt_tokens != "auto":
            return self.min_prompt_tokens
        queued = (0, 0.0) if prefill is None else (prefill.queued_tokens, prefill.queued_pairs)
        found = [rule.min_prompt_tokens(rule.queue_s(*queued)) for rule in self._rules()]
        return None if not found or None in found else max(found)

    def _rules(self) -> list[Rule]:
        reachable = {id(u): u for role in SERVING_ROLES for u in self.upstreams.reachable(role)}
        return [u.disagg_rule for u in reachable.values() if u.disagg_rule is not None]

    def _worth_moving(self, route: Route, now: float) -> bool:
        """Whether ``route``'s prompt is long enough for an idle prefill replica, one of its
        replicas could take it, and the pool has prefill replicas."""
        if not self.upstreams.of_role("prefill"):
            return False
        limit = self.max_outstanding
        if not any(not u.is_down and not u.is_full(limit, now) and now >= u.unready_until for u in route.candidates):
            return False  # the request fails or waits: a prefill now would be thrown away
        route.min_prompt_tokens = idle = self.threshold()
        return idle is not None and route.prompt_tokens >= idle

    def _next_prefill(self, route: Route, now: float) -> Upstream | None:
        """The least queued prefill replica that has not refused ``route``'s prompt, when the
        prompt still pays after its queue (counted); else None, with ``route.kept`` set."""
        prefill = self.least_queued(self.upstreams.of_role("prefill"), now, exclude=route.refused)
        if prefill is None:
            route.kept = "fallback_busy"
            return None
        least = self.threshold(prefill)  # a queue only raises the threshold
        if least is None or route.prompt_tokens < least:
            route.kept = "kept_queued"
            return None
        prefill.outstanding += 1
        prefill.queue_prompt(route.prompt_tokens)
        return prefill

    def _send(self, route: Route, decode: Upstream) -> None:
        decode.outstanding += 1
        route.decode = decode
        route.tried.append(decode)
