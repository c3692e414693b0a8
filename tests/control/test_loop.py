"""The control loop acting in place over a fake backend and fake replicas: settings before routing,
drains, records, the state a restart continues from."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from cadenza.gateway.metrics import GatewayMetrics
from cadenza.control.decide import Shape
from cadenza.control.in_place import DRAIN_SETTLE_S, in_place_loop
from cadenza.control.roles import COLOCATED, INTERACTIVE
from cadenza.control.replicas import Replica, State
from cadenza.control.loop import ControlLoop
from cadenza.control.signals import ClassWindow
from cadenza.control.spec import ControllerSpec
from cadenza.pool.spec import Pool

SPEC = {"model": {"name": "m"}, "replicas": 2, "mode": "auto", "engine": {"tokenBudget": 256, "chunkSize": 64},
        "dedicated": {"engine": {"chunkSize": 32}},
        "slo": {"interactive": {"itlP99Ms": 50}},
        "controller": {"fastWindowSeconds": 5, "windowSeconds": 10, "minSamples": 5, "cooldownSeconds": 0,
                       "dwellSeconds": 10, "drainTimeoutSeconds": 30, "bounds": {"chunkSize": {"min": 32, "max": 64}}}}


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class FakeAdmin:
    """Each replica's config and batch load, keyed by URL; every call recorded."""

    def __init__(self, urls) -> None:
        self.config = {u: {"token_budget": 256, "chunk_size": 64, "step_time_target_ms": None} for u in urls}
        self.batch = {u: 0 for u in urls}
        self.calls: list[tuple[str, str]] = []

    def get_config(self, url):
        return dict(self.config[url])

    def put_config(self, url, doc):
        self.calls.append(("put", url))
        self.config[url].update(doc)
        return self.config[url]

    def ready(self, url):
        zero = {"running": 0, "waiting": 0}
        return {"classes": {"batch": {"running": self.batch[url], "waiting": 0}, "background": zero}}


class FakeBackend:
    def __init__(self, admin: FakeAdmin, metrics: GatewayMetrics) -> None:
        self.admin, self.metrics = admin, metrics
        self.pods = {"a": Replica("a", "http://a"), "b": Replica("b", "http://b")}
        self.labels: dict[str, tuple[str, bool, bool]] = {}
        self.events: list[tuple] = []

    def replicas(self):
        return list(self.pods.values())

    def scrape(self):
        return {"gateway-0": self.metrics.prometheus_text().decode()}

    def route(self, replica, role, routes):
        # Routing always comes after the replica runs its role's settings.
        want = 32 if role == INTERACTIVE else None
        if want is not None:
            assert self.admin.config[replica.url]["chunk_size"] == want
        interactive, batch = "interactive" in routes, "batch" in routes
        self.events.append(("route", replica.name, role, interactive, batch))
        self.labels[replica.name] = (role, interactive, batch)
        replica.routes = routes


def setup(stored=None):
    clock, metrics = Clock(), GatewayMetrics([0.05])
    admin = FakeAdmin(["http://a", "http://b"])
    backend = FakeBackend(admin, metrics)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    loop = in_place_loop(Pool("p", "ns", SPEC), backend, admin, stored, clock=clock, tracer=provider.get_tracer("t"))
    return loop, backend, admin, metrics, clock, exporter


def run(loop, metrics, clock, seconds, itl_s, step=1.0):
    end = clock.now + seconds
    while clock.now < end:
        for _ in range(10):
            metrics.ttft.record(0.1, {"cadenza.traffic_class": "interactive"})
            metrics.itl.record(itl_s, {"cadenza.traffic_class": "interactive"})
        loop.tick()
        clock.now += step


def test_new_replicas_are_routed_only_after_their_settings():
    loop, backend, admin, metrics, clock, _ = setup()
    loop.tick()
    assert backend.labels == {"a": (COLOCATED, True, True), "b": (COLOCATED, True, True)}
    assert not admin.calls  # they already ran the colocated settings: nothing to put


def test_a_breach_retunes_then_dedicates_after_a_drain_and_records_why():
    loop, backend, admin, metrics, clock, exporter = setup()
    admin.batch["http://b"] = 2  # b still has batch work when it is picked
    run(loop, metrics, clock, 40, itl_s=0.2)
    assert admin.config["http://a"]["chunk_size"] == 32  # rung 1 reached its bound first
    assert loop.actuation.state.draining and loop.actuation.state.draining[0] == "b"
    assert backend.labels["b"] == (COLOCATED, True, False)  # out of the batch routing, still colocated
    admin.batch["http://b"] = 0
    run(loop, metrics, clock, 2, itl_s=0.2)
    assert loop.actuation.state.roles == {"a": COLOCATED, "b": INTERACTIVE}
    assert backend.labels["b"] == (INTERACTIVE, True, False)
    shift = loop.actuation.state.last_shift
    assert shift["move"] == "dedicate" and shift["from"] == {"colocated": 2, "interactive": 0, "prefill": 0}
    assert shift["to"] == {"colocated": 1, "interactive": 1, "prefill": 0} and shift["signals"]["interactive.itl_p99_ms"] > 50
    retune = loop.actuation.state.last_retune
    assert retune["from"] == {"chunk_size": 64} and retune["to"] == {"chunk_size": 32}
    spans = [s for s in exporter.get_finished_spans() if s.name == "cadenza.controller.act"]
    assert [s.attributes["cadenza.controller.action"] for s in spans] == ["retune", "reshape"]


def test_a_drain_trusts_no_batch_work_only_once_the_published_counts_can_show_it():
    """Counts read right after the routing change may predate a batch request already sent."""
    loop, backend, admin, metrics, clock, _ = setup()
    admin.batch["http://b"] = 0  # looks idle from the first read
    for _ in range(400):
        if loop.actuation.state.draining:
            break
        run(loop, metrics, clock, 0.25, itl_s=0.2, step=0.25)
    assert loop.actuation.state.draining, "the breach never led to a drain"
    since = loop.actuation.state.draining[1]
    ended = None
    while ended is None:
        clock.now += 0.25
        loop.tick()
        if loop.actuation.state.draining is None:
            ended = clock.now
    assert ended - since > 1.0  # not the next tick: the counts could not show a request in flight yet
    assert DRAIN_SETTLE_S <= ended - since < DRAIN_SETTLE_S + 0.5
    assert loop.actuation.state.roles["b"] == INTERACTIVE


def test_a_drain_that_times_out_leaves_the_replica_colocated_and_routed():
    loop, backend, admin, metrics, clock, _ = setup()
    admin.batch["http://b"] = 1  # a long batch stream that never ends within the drain timeout
    run(loop, metrics, clock, 80, itl_s=0.2)
    assert loop.actuation.state.roles["b"] == COLOCATED
    assert ("route", "b", COLOCATED, True, False) in backend.events
    assert backend.events[backend.events.index(("route", "b", COLOCATED, True, False)) + 1] == (
        "route", "b", COLOCATED, True, True)


def test_state_survives_a_restart_and_a_lost_interactive_pod_is_replaced_in_its_role():
    loop, backend, admin, metrics, clock, _ = setup()
    run(loop, metrics, clock, 40, itl_s=0.2)
    assert loop.actuation.state.roles["b"] == INTERACTIVE
    stored = loop.status()
    again, backend2, admin2, metrics2, clock2, _ = setup(stored)
    clock2.now = clock.now
    del backend2.pods["b"]  # the interactive pod is gone; a new one comes
    backend2.pods["c"] = Replica("c", "http://b")  # (reuses b's fake admin)
    again.tick()
    assert again.actuation.state.roles == {"a": COLOCATED, "c": INTERACTIVE}
    assert again.actuation.state.knobs["chunk_size"] == 32  # the colocated knobs carried over
    assert backend2.labels["c"] == (INTERACTIVE, True, False)


def test_state_from_junk_keeps_the_spec_knobs_and_drops_what_cannot_be_used():
    knobs = {"chunk_size": 256, "token_budget": 512, "step_time_target_ms": None}
    state = State.from_status({"roles": ["a"], "knobs": {"chunk_size": "abc", "token_budget": float("inf"),
                                                         "step_time_target_ms": 300},
                               "draining": {"replica": "a", "since": float("nan")}}, knobs)
    assert state.roles == {} and state.draining is None
    assert state.knobs == {"chunk_size": 256, "token_budget": 512, "step_time_target_ms": 300}
    assert State.from_status("junk", knobs).knobs == knobs


def test_a_replica_answering_garbage_http_is_a_missed_scrape_not_a_crash():
    import socket
    import threading

    from cadenza.local.actuation import _get

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def answer():
        for reply in (b"garbage\r\n\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nabc"):
            conn, _ = server.accept()
            conn.recv(4096)
            conn.sendall(reply)
            conn.close()

    threading.Thread(target=answer, daemon=True).start()
    url = f"http://127.0.0.1:{server.getsockname()[1]}/metrics"
    assert _get(url) is None  # BadStatusLine
    assert _get(url) is None  # IncompleteRead
    server.close()


def test_a_state_file_that_cannot_be_written_does_not_stop_the_pool(tmp_path, caplog):
    from types import SimpleNamespace

    from cadenza.local.up import _write_state

    state = tmp_path / "s.json"
    (tmp_path / "s.json.tmp").mkdir()  # the write fails with IsADirectoryError
    gateway = SimpleNamespace(url="http://g", proc=None)
    _write_state(state, [], gateway)
    assert not state.exists() and "could not write the state file" in caplog.text


def test_a_local_replica_that_exits_is_unrouted_until_the_controller_routes_it_again():
    from cadenza.local.actuation import LocalBackend

    written = []
    backend = LocalBackend({"auto-0": "http://a", "auto-1": "http://b"}, "http://g", written.append)
    backend.unroute("auto-1")
    assert written[-1] == {"interactive": ["http://a"], "batch": ["http://a"], "prefill": []}
    b = next(r for r in backend.replicas() if r.name == "auto-1")
    assert not b.routes  # so the next tick applies settings, then routes
    backend.unroute("auto-1")
    assert len(written) == 1  # nothing to rewrite
    backend.route(b, COLOCATED, frozenset({"interactive", "batch"}))
    assert written[-1] == {"interactive": ["http://a", "http://b"], "batch": ["http://a", "http://b"], "prefill": []}


def test_the_loop_keeps_its_own_schedule_on_its_clock():
    class Source:
        def __init__(self) -> None:
            self.records: list[float] = []

        def record(self, now):
            self.records.append(now)

        def window(self, cls, window_s, now, slo, *, min_samples, stale_s):
            return ClassWindow(False, "no data")

    class Fixed:
        def prepare(self, now):
            return Shape(2), {"chunk_size": 64, "token_budget": 256, "step_time_target_ms": None}

        def act(self, evaluation):
            pass

        def status(self):
            return {}

    clock = [100.0]
    spec = ControllerSpec.from_pool_spec({"slo": {"interactive": {"itlP99Ms": 50}},
                                          "controller": {"fastWindowSeconds": 20, "windowSeconds": 60}})
    loop = ControlLoop(Source(), spec, Fixed(), clock=lambda: clock[0])
    assert loop.interval_s == 5.0 and loop.due() and loop.signals is None  # a few ticks per fast window
    assert loop.tick().action == "hold" and loop.source.records == [100.0]
    assert not loop.due() and not loop.due(104.9) and loop.due(105.0)
    clock[0] = 105.0
    assert loop.due()
    assert ControlLoop(Source(), spec, Fixed(), interval_s=15.0).interval_s == 15.0
    long = ControllerSpec.from_pool_spec({"controller": {"fastWindowSeconds": 300, "windowSeconds": 900}})
    short = ControllerSpec.from_pool_spec({"controller": {"fastWindowSeconds": 2, "windowSeconds": 10}})
    assert ControlLoop(Source(), long, Fixed()).interval_s == 15.0  # never slower than the operator's resync
    assert ControlLoop(Source(), short, Fixed()).interval_s == 1.0
