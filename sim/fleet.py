"""Many simulated replicas behind the gateway's own routing, on one virtual clock.

Each request goes where the gateway would send it: its traffic class names a role
(``ROLE_OF_CLASS``), and :meth:`cadenza.node.gateway.upstreams.Upstreams.pick` chooses the least
outstanding replica of that role that is not full; a replica's 429 backs it off for its
``Retry-After`` and the request is retried once elsewhere (the gateway's ``MAX_ATTEMPTS``); a
request no replica takes is dropped, as a 429 to the client. Replicas step independently: an event
heap holds arrivals and step ends, so a replica's next step starts when its last one ends.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cadenza.node.core.admission import AdmissionError
from cadenza.node.core.config import SchedulerConfig
from cadenza.node.gateway.upstreams import ROLE_OF_CLASS, Upstream, Upstreams
from cadenza.node.replay.trace import TraceRequest
from cadenza.sim.replica import SimReplica, VirtualClock
from cadenza.sim.roofline import Roofline
from cadenza.sim.run import LatencySummary, summarize

MAX_ATTEMPTS = 2  # as the gateway: the first try and at most one retry
_ARRIVAL, _STEP_END = 1, 0  # at equal times a step ends (and frees its slot) before an arrival


@dataclass(frozen=True, slots=True)
class FleetResult:
    """A fleet run: the latency report per traffic class, and the counts.

    Attributes:
        by_class: class -> :class:`LatencySummary` of its requests (``rejected``: dropped ones).
        dropped: requests no replica took (the gateway's or every tried replica's 429).
        steps: steps run per replica.
    """

    by_class: dict[str, LatencySummary]
    dropped: int
    steps: dict[str, int]


def simulate_fleet(trace: Sequence[TraceRequest], roles: Mapping[str, Sequence[str]],
                   configs: Mapping[str, SchedulerConfig], roofline: Roofline,
                   classes: Sequence[str] | None = None, max_outstanding: int = 256,
                   block_size: int = 16) -> FleetResult:
    """Replay ``trace`` against replicas named in ``roles`` (``interactive`` / ``batch`` -> names;
    colocated: both list every replica), each with its scheduler knobs in ``configs``.

    Args:
        classes: each request's traffic class (default: all ``interactive``).
        max_outstanding: requests in flight that make a replica full at the gateway.

    Raises:
        ValueError: a replica named in ``roles`` without a config, or ``classes`` of the wrong length.
    """
    names = list(dict.fromkeys(n for group in roles.values() for n in group))
    missing = [n for n in names if n not in configs]
    if missing:
        raise ValueError(f"replicas without a config: {missing}")
    classes = list(classes) if classes is not None else ["interactive"] * len(trace)
    if len(classes) != len(trace):
        raise ValueError(f"classes: {len(classes)} for {len(trace)} requests")
    clock = VirtualClock()
    replicas = {n: SimReplica(configs[n], roofline, clock, block_size) for n in names}
    upstreams = Upstreams({role: list(group) for role, group in roles.items()}, clock=clock)
    served_by: dict[str, Upstream] = {}
    events: list[tuple[float, int, int, object]] = []
    seq = 0

    def push(t: float, kind: int, what: object) -> None:
        nonlocal seq
        heapq.heappush(events, (t, kind, seq, what))
        seq += 1

    def kick(name: str) -> None:
        replica = replicas[name]
        if not replica.in_flight and replica.has_work:
            end = replica.begin_step()
            if end is not None:
                push(end, _STEP_END, name)

    for i, req in enumerate(trace):
        push(req.arrival_s, _ARRIVAL, i)
    dropped: dict[str, int] = dict.fromkeys(classes, 0)
    while events:
        t, kind, _, what = heapq.heappop(events)
        clock.now = t
        if kind == _STEP_END:
            for req in replicas[what].end_step():
                served_by.pop(req.request_id).outstanding -= 1
            kick(what)
            continue
        i, cls = what, classes[what]
        candidates, tried = upstreams.of_role(ROLE_OF_CLASS[cls]), []
        for _ in range(MAX_ATTEMPTS):
            upstream = upstreams.pick(candidates, max_outstanding, exclude=tried)
            if upstream is None:
                break
            tried.append(upstream)
            try:
                replicas[upstream.url].add_request(f"r{i}", i, trace[i].input_len, trace[i].output_len, t,
                                                   traffic_class=cls)
            except AdmissionError as exc:
                if exc.retry_after:
                    upstreams.back_off(upstream, exc.retry_after)
                continue
            upstream.outstanding += 1
            served_by[f"r{i}"] = upstream
            kick(upstream.url)
            break
        else:
            dropped[cls] += 1
            continue
        if f"r{i}" not in served_by:
            dropped[cls] += 1
    by_class = {}
    for cls in dict.fromkeys(classes):
        times = [r.times[f"r{i}"] for r in replicas.values() for i in range(len(trace))
                 if classes[i] == cls and f"r{i}" in r.times]
        by_class[cls] = summarize(times, dropped[cls])
    return FleetResult(by_class, sum(dropped.values()), {n: r.steps for n, r in replicas.items()})
