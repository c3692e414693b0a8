"""Many simulated replicas behind the gateway's own routing, on one virtual clock.

Each request goes where the gateway would send it: the gateway's router
(:class:`cadenza.gateway.router.Router`), over a table whose upstreams stand for the simulated
replicas, chooses it a replica of its class's role, and a prefill replica first when its prompt
is worth moving. A replica's refusal (:class:`AdmissionError`) is its HTTP answer: a 429 backs it
off for its ``Retry-After``, and the router retries the request once elsewhere; a request no
replica takes is dropped, as the client's 429 (or the replica's 400). Replicas step
independently: an event heap holds step ends, KV loads that completed, timed callbacks (the
controller, its actuations) and arrivals, in that order at equal times, so a replica's next step
starts when its last one ends.

With a ``prefill`` role and a KV link, a long prompt is prefilled on a prefill replica and its
KV moved to the decode replica, as the gateway and engines of a disaggregated pool do
(:mod:`cadenza.sim.disagg`); each decode replica reports its selective rule as its answers'
headers would, the one its step-time model gives at the moment.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence

from cadenza.node.core.admission import AdmissionError
from cadenza.node.core.config import SchedulerConfig
from cadenza.node.core.knobs import reconfigured
from cadenza.node.core.request import RemoteKV
from cadenza.node.core.scheduler import Scheduler
from cadenza.gateway.router import NoReplica, Route, Router
from cadenza.gateway.upstreams import SERVING_ROLES, Upstreams
from cadenza.loadgen.trace import TraceRequest
from cadenza.sim.client import ConcurrencyLimit
from cadenza.sim.disagg import KVLinkModel, Move, SimConnector, ready_at, rule
from cadenza.sim.replica import RequestTimes, SimReplica, VirtualClock
from cadenza.sim.roofline import Roofline
from cadenza.sim.report import FleetResult, LatencySummary, Observations, meets_slo, summarize

_STEP_END, _LOADED, _CALLBACK, _ARRIVAL = 0, 1, 2, 3  # at equal times: free slots, loads, act, admit
PREFILL_SUFFIX = "/prefill"  # a moved prompt's request on its prefill replica


class Fleet:
    """Replicas named in ``roles`` (``interactive`` / ``batch`` -> names; colocated: both list
    every replica), each with its scheduler knobs in ``configs``, behind one gateway.

    Args:
        max_outstanding: requests in flight that make a replica full at the gateway.
        scheduler_cls: every replica's scheduler (cadenza's, or a baseline).
        num_blocks: KV blocks per replica (None: what fits the device, see :class:`SimReplica`).
        slo: class -> ``{"ttftP99Ms", "itlP99Ms"}`` (a ServingPool's ``spec.slo``), for SLO
            attainment and goodput in the result.
        link: the KV link between ``prefill`` replicas and the rest (default: 10 Gb/s TCP).
        min_prompt_tokens: a pinned threshold (None: the one the decode replicas' rules give, the
            gateway's ``auto``).

    Raises:
        ValueError: a replica named in ``roles`` without a config.
    """

    def __init__(self, roles: Mapping[str, Sequence[str]], configs: Mapping[str, SchedulerConfig],
                 roofline: Roofline, max_outstanding: int = 256, block_size: int = 16,
                 scheduler_cls: type[Scheduler] = Scheduler, num_blocks: int | None = None,
                 slo: Mapping[str, Mapping[str, float]] | None = None, link: KVLinkModel | None = None,
                 min_prompt_tokens: int | None = None) -> None:
        self.slo = {cls: dict(v) for cls, v in (slo or {}).items()}
        names = list(dict.fromkeys(n for group in roles.values() for n in group))
        missing = [n for n in names if n not in configs]
        if missing:
            raise ValueError(f"replicas without a config: {missing}")
        self.clock = VirtualClock()
        self.replicas = {n: SimReplica(configs[n], roofline, self.clock, block_size, scheduler_cls=scheduler_cls,
                                       num_blocks=num_blocks, connector=SimConnector(self._load_started))
                         for n in names}
        self.link = link or KVLinkModel()
        self.bytes_per_token = roofline.kv_bytes_per_token()
        self._moves: dict[str, Move] = {}
        self.kv_transfer: dict[str, float | None] = {"moved": 0, "bytes": 0, "fallbacks": 0, "kept_queued": 0,
                                                     "min_prompt_tokens": min_prompt_tokens}
        self.upstreams = Upstreams({role: list(group) for role, group in roles.items()}, clock=self.clock)
        self._had_prefill = bool(self.upstreams.of_role("prefill"))  # at any time: the result reports kv_transfer
        self.router = Router(self.upstreams, max_outstanding, "auto" if min_prompt_tokens is None else min_prompt_tokens)
        self.classes: dict[str, str] = {}  # request id -> traffic class it was sent as
        self.labels: dict[str, str] = {}  # request id -> the class it is reported under (the trace's)
        self.dropped: dict[str, int] = {}
        self.drop_times: dict[str, list[float]] = {}  # class -> when its requests were dropped
        self._routes: dict[str, Route] = {}  # request id (a prefill half's too) -> its route, until it ends
        self._events: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self._work = 0  # arrivals not yet handled + steps in flight: the run ends at zero
        self.observations: dict[str, Observations] = {}  # class -> latency observations
        self.prompts_t: list[float] = []  # when each request a replica took came, in time order
        self.prompts_n: list[int] = []  # ... and its prompt's tokens

    # -- the event heap ---------------------------------------------------------------------

    def _push(self, t: float, kind: int, what: object) -> None:
        heapq.heappush(self._events, (t, kind, self._seq, what))
        self._seq += 1
        if kind != _CALLBACK:
            self._work += 1

    def at(self, t: float, callback: Callable[[Fleet], None]) -> None:
        """Call ``callback(fleet)`` at virtual time ``t`` (callbacks alone do not keep the run going)."""
        self._push(t, _CALLBACK, callback)

    def _kick(self, name: str) -> None:
        replica = self.replicas[name]
        if not replica.in_flight and replica.has_work:
            end = replica.begin_step()
            if end is not None:
                self._push(end, _STEP_END, name)

    # -- what a controller may change ----------------------------------------------------------

    def roles(self) -> dict[str, list[str]]:
        return self.upstreams.urls()

    def set_roles(self, roles: Mapping[str, Sequence[str]]) -> None:
        """Route by these roles from now on; requests in flight finish where they are."""
        self.upstreams.replace({role: list(group) for role, group in roles.items()})
        self._had_prefill = self._had_prefill or bool(self.upstreams.of_role("prefill"))

    def reconfigure(self, names: Sequence[str], changes: Mapping[str, object]) -> None:
        """Apply live knobs (``chunk_size``, ``token_budget``, ``step_time_target_ms``, ...) to
        these replicas from their next step, as ``PUT /admin/config`` does.

        Raises:
            ConfigError: an unknown or non-live knob, or a bad value (nothing changes).
        """
        for name in names:
            sched = self.replicas[name].scheduler
            sched.reconfigure(reconfigured(sched.config, changes))

    # -- the run ------------------------------------------------------------------------------

    def _arrive(self, i: int, req: TraceRequest, cls: str) -> bool:
        """Route an arrival as the gateway would; False when it is dropped."""
        rid, t = f"r{i}", self.clock.now
        self.classes[rid] = cls
        label = self.labels[rid] = req.traffic_class or cls
        if self.router.min_prompt_tokens == "auto" and self.upstreams.of_role("prefill"):
            self._report_rules()
        try:
            route = self.router.choose(cls, req.input_len, t)
        except NoReplica:
            return self._drop(label, t)
        remote = self._prefill_first(route, rid, i, req, cls)
        while True:
            decode = route.decode
            try:
                self.replicas[decode.url].add_request(rid, i, req.input_len, req.output_len, t, traffic_class=cls,
                                                      tenant=req.tenant or "default", remote_kv=remote)
                break
            except AdmissionError as exc:
                if exc.retry_after:
                    self.router.back_off(decode, exc.retry_after, t)
                if not self.router.should_retry(route, exc.status) or self.router.retry(route, t) is None:
                    self.router.finish(route)
                    if remote is not None:
                        self._cancel_prefill(route, remote.request_id)
                    return self._drop(label, t)
        self._routes[rid] = route
        self.prompts_t.append(t)
        self.prompts_n.append(req.input_len)
        if remote is not None:
            self._moves[rid] = Move(decode.url, req.input_len, t)
            self._routes[remote.request_id] = route
            self.kv_transfer["moved"] += 1
            self.kv_transfer["bytes"] += req.input_len * self.bytes_per_token
            self._kick(route.prefill.url)
        self._kick(decode.url)
        return True

    def _drop(self, label: str, t: float) -> bool:
        self.dropped[label] = self.dropped.get(label, 0) + 1
        self.drop_times.setdefault(label, []).append(t)
        return False

    def run(self, trace: Sequence[TraceRequest], classes: Sequence[str] | None = None,
            on_done: Callable[[int], None] | None = None, client: ConcurrencyLimit | None = None) -> FleetResult:
        """Replay ``trace`` (arrivals in seconds, lengths in tokens) to its end; ``on_done(n)``
        is told of every ``n`` requests that finished or were dropped (a progress bar's update).
        Each request is sent as class ``classes[i]``, else the trace's, else ``interactive``, and
        reported under the trace's class (else the one it was sent as); its tenant is the trace's,
        else ``default``. With a ``client``, a request of a class it limits reaches the gateway
        when the client sends it (its arrival for every latency), and one it never sends is in
        no count but its :meth:`~cadenza.sim.client.ConcurrencyLimit.unsent`.

        Raises:
            ValueError: ``classes`` of the wrong length.
            RuntimeError: a replica stopped making progress with requests left.
        """
        classes = list(classes) if classes is not None else [r.traffic_class or "interactive" for r in trace]
        if len(classes) != len(trace):
            raise ValueError(f"classes: {len(classes)} for {len(trace)} requests")
        for i, req in enumerate(trace):
            self._push(req.arrival_s, _ARRIVAL, i)
        while self._work:
            t, kind, _, what = heapq.heappop(self._events)
            self.clock.now = t
            if kind == _STEP_END:
                self._work -= 1
                replica = self.replicas[what]
                done = 0
                for req in replica.end_step():
                    if req.request_id.endswith(PREFILL_SUFFIX):  # the prefill half of a moved prompt
                        if req.is_finished:
                            self.router.prefill_done(self._routes.pop(req.request_id))
                            self._prefilled(req.request_id.removesuffix(PREFILL_SUFFIX), replica.scheduler.config)
                        continue
                    self._observe(req, replica.times[req.request_id])
                    if req.is_finished:
                        self.router.finish(self._routes.pop(req.request_id))
                        done += 1
                        if client is not None:
                            self._send_next(client, self.classes[req.request_id], t)
                if done and on_done is not None:
                    on_done(done)
                self._kick(what)
            elif kind == _LOADED:
                self._work -= 1
                move = self._moves.pop(what)
                self.replicas[move.decode].scheduler.remote_kv_loaded(what, move.blocks)
                self._kick(move.decode)
            elif kind == _CALLBACK:
                what(self)
                for name in self.replicas:  # an actuation may have made room or work
                    self._kick(name)
            else:
                self._work -= 1
                if client is not None and not client.offer(what, classes[what], t):
                    continue  # it waits at the client
                if not self._arrive(what, trace[what], classes[what]):
                    if client is not None:
                        self._send_next(client, classes[what], t)
                    if on_done is not None:
                        on_done(1)
        stuck = [n for n, r in self.replicas.items() if r.has_work]
        if stuck:
            raise RuntimeError(f"replicas {stuck} stopped making progress with requests left (a scheduler bug)")
        return self.result(dict.fromkeys(r.traffic_class or c for r, c in zip(trace, classes)))

    def _send_next(self, client: ConcurrencyLimit, cls: str, t: float) -> None:
        """A request of ``cls`` ended: the one the client sends in its place arrives now."""
        index = client.ended(cls, t)
        if index is not None:
            self._push(t, _ARRIVAL, index)

    # -- disaggregated prefill ------------------------------------------------------------------

    def threshold(self) -> int | None:
        """The selective rule's threshold now, as the gateway takes it for an idle prefill
        replica (pinned, or the largest the serving replicas' rules give), whether or not the
        pool has prefill replicas; None: nothing is worth moving, or no replica has calibrated."""
        self._report_rules()
        return self.router.threshold()

    def _report_rules(self) -> None:
        """Each serving replica's selective rule as its answers would report it now (one whose
        step-time model is not calibrated yet reports none, and the last one stands)."""
        serving = {id(u): u for role in SERVING_ROLES for u in self.upstreams.of_role(role)}
        for upstream in serving.values():
            found = rule(self.replicas[upstream.url].scheduler.cost_model, self.link, self.bytes_per_token)
            if found is not None:
                upstream.disagg_rule = found

    def _prefill_first(self, route: Route, rid: str, i: int, req: TraceRequest, cls: str) -> RemoteKV | None:
        """Queue the prefill half of a prompt the router moves on its prefill replica (the next
        one it chooses while they refuse, as 429s); the decode replica's remote source, or None:
        prefilled where it decodes."""
        if route.min_prompt_tokens is not None:
            self.kv_transfer["min_prompt_tokens"] = route.min_prompt_tokens
        while (prefill := route.prefill) is not None:
            try:
                self.replicas[prefill.url].add_request(rid + PREFILL_SUFFIX, i, req.input_len, 1, self.clock.now,
                                                       traffic_class=cls, tenant=req.tenant or "default")
            except AdmissionError as exc:
                if exc.status != 429:  # the request's own fault: the decode replica answers it alike
                    self.router.prefill_done(route)
                    return None
                self.router.refused(route, self.clock.now, exc.retry_after or 0)
                continue
            return RemoteKV("sim", 0, rid + PREFILL_SUFFIX, "sim", req.input_len)
        if route.kept is not None:  # "kept_queued", or "fallback_busy": no prefill replica took it
            self.kv_transfer["kept_queued" if route.kept == "kept_queued" else "fallbacks"] += 1
        return None

    def _cancel_prefill(self, route: Route, prefill_id: str) -> None:
        """The request was dropped after its prefill half was queued: abort that, as the gateway
        closes the prefill call when the decode call ends."""
        replica = self.replicas[route.prefill.url]
        replica.scheduler.abort_request(prefill_id)
        del replica.times[prefill_id]
        self.router.prefill_done(route)

    def _prefilled(self, rid: str, config: SchedulerConfig) -> None:
        """A moved prompt's prefill half finished: when its last KV reaches the decode replica."""
        move = self._moves[rid]
        move.ready_s = ready_at(self.link, move.arrival_s, self.clock.now, move.prompt_tokens,
                                config.chunk_size or move.prompt_tokens, self.bytes_per_token)
        if move.blocks is not None:
            self._push(move.ready_s, _LOADED, rid)

    def _load_started(self, rid: str, blocks: int) -> None:
        """A decode replica admitted a moved prompt and allocated its blocks (inside its schedule())."""
        move = self._moves[rid]
        move.blocks = blocks
        if move.ready_s is not None:
            self._push(max(self.clock.now, move.ready_s), _LOADED, rid)

    def _observe(self, req, times: RequestTimes) -> None:
        """What the gateway's histograms would record for this token: a TTFT for the first, the
        gap since the previous one otherwise (by class, in time order)."""
        obs = self.observations.setdefault(req.traffic_class, Observations())
        t = times.token_s[-1]
        if len(times.token_s) == 1:
            obs.ttft_t.append(t)
            obs.ttft_s.append(t - times.arrival_s)
        else:
            obs.itl_t.append(t)
            obs.itl_s.append(t - times.token_s[-2])

    def timelines(self, cls: str) -> list[RequestTimes]:
        """The timelines of the requests reported under class ``cls``, over every replica (a moved
        prompt's prefill half is not reported: its request is the decode replica's)."""
        return [t for r in self.replicas.values() for rid, t in r.times.items() if self.labels.get(rid) == cls]

    def attainment_over_time(self, window_s: float) -> dict[str, list[tuple[float, float]]]:
        """Per reported class, ``(window end, share of its requests that met the SLO)`` over
        consecutive windows of ``window_s``: a request counts in the window it finished in (a
        dropped one, missed, in the one it arrived in); windows with none are left out."""
        out: dict[str, list[tuple[float, float]]] = {}
        for cls in dict.fromkeys(self.labels.values()):
            slo = self.slo.get(cls, {})
            events = [(t.finished_s, meets_slo(t, slo)) for t in self.timelines(cls) if t.finished_s is not None]
            events += [(t, False) for t in self.drop_times.get(cls, ())]
            bins: dict[int, list[bool]] = {}
            for t, ok in events:
                bins.setdefault(int(t // window_s), []).append(ok)
            out[cls] = [((k + 1) * window_s, sum(v) / len(v)) for k, v in sorted(bins.items())]
        return out

    def result(self, classes: Mapping[str, object] | Sequence[str]) -> FleetResult:
        times = [t for r in self.replicas.values() for rid, t in r.times.items() if not rid.endswith(PREFILL_SUFFIX)]
        finished = [t.finished_s for t in times if t.finished_s is not None]
        span = max(finished) - min(t.arrival_s for t in times) if finished else 0.0
        by_class = {cls: summarize(self.timelines(cls), self.dropped.get(cls, 0), self.slo.get(cls), span)
                    for cls in classes}
        replicas = self.replicas.values()
        kv = {"mean": sum(r.kv_usage_s for r in replicas) / (len(self.replicas) * span) if span else 0.0,
              "peak": max((r.kv_peak for r in replicas), default=0.0)}
        preemptions: dict[str, int] = {}
        for r in replicas:
            for cls, n in r.scheduler.stats.preemptions_by_class.items():
                preemptions[cls] = preemptions.get(cls, 0) + n
        kv_transfer = dict(self.kv_transfer) if self._had_prefill else {}
        return FleetResult(by_class, sum(self.dropped.values()), {n: r.steps for n, r in self.replicas.items()},
                           span, kv, preemptions, kv_transfer)


def simulate_fleet(trace: Sequence[TraceRequest], roles: Mapping[str, Sequence[str]],
                   configs: Mapping[str, SchedulerConfig], roofline: Roofline,
                   classes: Sequence[str] | None = None, max_outstanding: int = 256,
                   block_size: int = 16, scheduler_cls: type[Scheduler] = Scheduler,
                   slo: Mapping[str, Mapping[str, float]] | None = None) -> FleetResult:
    """:class:`Fleet` ``(roles, configs, roofline, ...)`` replaying ``trace`` (see there).

    Raises:
        ValueError: a replica without a config, or ``classes`` of the wrong length.
    """
    return Fleet(roles, configs, roofline, max_outstanding, block_size, scheduler_cls, slo=slo).run(trace, classes)


def simulate_replica(trace: Sequence[TraceRequest], config: SchedulerConfig, roofline: Roofline,
                     block_size: int = 16, scheduler_cls: type[Scheduler] = Scheduler,
                     num_blocks: int | None = None) -> tuple[SimReplica, LatencySummary]:
    """Replay ``trace`` against one simulated replica alone (no gateway limit), whose scheduler is
    ``scheduler_cls`` (cadenza's, or a baseline); every request ``interactive``.

    Raises:
        RuntimeError: the replica stopped making progress with requests left.
    """
    fleet = Fleet({"interactive": ["replica"], "batch": ["replica"]}, {"replica": config}, roofline,
                  max_outstanding=len(trace) + 1, block_size=block_size, scheduler_cls=scheduler_cls,
                  num_blocks=num_blocks)
    result = fleet.run(trace)
    return fleet.replicas["replica"], result.by_class["interactive"]
