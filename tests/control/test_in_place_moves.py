"""The third rung carried out in place (issue 31): a replica moved into the prefill role and back
over a fake backend and fake admin API — drains of every class, the timeout, settings before
routing, the shape recorded, a lost prefill replica replaced in its role."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from cadenza.control.decide import Decision, Shape
from cadenza.control.history import AGGREGATE, DEDICATE, DISAGGREGATE, MERGE, History
from cadenza.control.in_place import DRAIN_SETTLE_S, InPlace, prefill_settings
from cadenza.control.loop import Evaluation
from cadenza.control.roles import COLOCATED, INTERACTIVE, PREFILL, Drain, shape_after
from cadenza.control.replicas import Replica, State
from cadenza.control.signals import Signals
from cadenza.control.spec import ControllerSpec
from cadenza.pool.spec import Pool

SPEC = {"model": {"name": "m"}, "replicas": 3, "mode": "auto",
        "engine": {"tokenBudget": 256, "chunkSize": 64, "stepTimeTargetMs": 40},
        "dedicated": {"engine": {"chunkSize": 32}},
        "slo": {"interactive": {"itlP99Ms": 50}},
        "controller": {"drainTimeoutSeconds": 30, "bounds": {"chunkSize": {"min": 16, "max": 128},
                                                             "tokenBudget": {"min": 128, "max": 512}}}}
ZERO = {"running": 0, "waiting": 0}


class FakeAdmin:
    """Each replica's config and per-class load, keyed by URL; every PUT recorded."""

    def __init__(self, urls) -> None:
        self.config = {u: {"token_budget": 256, "chunk_size": 64, "step_time_target_ms": 40} for u in urls}
        self.load = {u: {"interactive": dict(ZERO), "batch": dict(ZERO), "background": dict(ZERO)} for u in urls}
        self.puts: list[tuple[str, dict]] = []

    def get_config(self, url):
        return dict(self.config[url])

    def put_config(self, url, doc):
        self.puts.append((url, dict(doc)))
        self.config[url].update(doc)
        return self.config[url]

    def ready(self, url):
        return {"classes": {c: dict(v) for c, v in self.load[url].items()}}


class FakeBackend:
    """Replicas a, b, c; routing recorded, and checked to come after the role's settings."""

    def __init__(self, admin: FakeAdmin, names=("a", "b", "c")) -> None:
        self.admin = admin
        self.pods = {n: Replica(n, f"http://{n}") for n in names}
        self.routes: list[tuple[str, str, frozenset]] = []

    def replicas(self):
        return list(self.pods.values())

    def scrape(self):
        return None

    def route(self, replica, role, routes):
        if "prefill" in routes:  # a prefill replica is routed only once it runs the prefill settings
            assert self.admin.config[replica.url]["chunk_size"] == 128
        self.routes.append((replica.name, role, frozenset(routes)))
        replica.routes = frozenset(routes)


def setup(spec=SPEC, state=None, names=("a", "b", "c")):
    admin = FakeAdmin([f"http://{n}" for n in names])
    backend = FakeBackend(admin, names)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    pool = Pool("p", "ns", spec)
    actuation = InPlace(pool, backend, admin, state, provider.get_tracer("t"))
    return actuation, backend, admin, exporter


def decide_to(actuation: InPlace, now: float, move: str) -> None:
    """Hand ``actuation`` a reshape decision, as the loop does after :meth:`InPlace.prepare`."""
    prepared = actuation.prepare(now)
    assert prepared is not None, "a move is still in progress"
    shape, knobs = prepared
    spec = ControllerSpec.from_pool_spec(SPEC)
    decision = Decision("reshape", f"scripted {move}", True, History(), move=move)
    actuation.act(Evaluation(now, Signals({}, {}), shape, knobs, History(), spec, decision))


def test_disaggregate_drains_every_class_then_gives_the_prefill_settings_then_the_prefill_route():
    actuation, backend, admin, exporter = setup()
    now = 1000.0
    actuation.prepare(now)
    assert {name: routes for name, _role, routes in backend.routes} == {
        n: frozenset({"interactive", "batch"}) for n in "abc"}
    admin.load["http://c"]["interactive"]["running"] = 1  # a stream still decoding on c
    decide_to(actuation, now, DISAGGREGATE)
    assert actuation.state.draining == Drain("c", now, DISAGGREGATE)
    assert backend.routes[-1] == ("c", COLOCATED, frozenset())  # out of every route, still colocated
    for t in (1, 3, 10):  # interactive work left: it waits, routed nowhere
        assert actuation.prepare(now + t) is None
        assert actuation.state.roles["c"] == COLOCATED and backend.pods["c"].routes == frozenset()
    admin.load["http://c"]["interactive"]["running"] = 0
    admin.load["http://c"]["background"]["waiting"] = 1  # a background request waiting counts too
    assert actuation.prepare(now + 11) is None
    admin.load["http://c"]["background"]["waiting"] = 0
    assert actuation.prepare(now + 12) is None  # drained: it takes the role this tick
    assert actuation.state.roles["c"] == PREFILL and actuation.state.draining is None
    assert backend.routes[-1] == ("c", PREFILL, frozenset({"prefill"}))
    assert admin.config["http://c"] == {"token_budget": 512, "chunk_size": 128, "step_time_target_ms": None}
    assert actuation.shape(backend.replicas()) == Shape(2, 0, 1)
    shift = actuation.state.last_shift
    assert shift["move"] == DISAGGREGATE and shift["from"] == {"colocated": 3, "interactive": 0, "prefill": 0}
    assert shift["to"] == {"colocated": 2, "interactive": 0, "prefill": 1}
    [span] = [s for s in exporter.get_finished_spans() if s.name == "cadenza.controller.act"]
    assert span.attributes["cadenza.controller.move"] == DISAGGREGATE
    assert span.attributes["cadenza.controller.shape.before"] == "colocated: 3, interactive: 0, prefill: 0"
    assert span.attributes["cadenza.controller.shape.after"] == "colocated: 2, interactive: 0, prefill: 1"
    # The next ticks leave it alone: its settings hold and it stays in the prefill route only.
    routed, puts = len(backend.routes), len(admin.puts)
    assert actuation.prepare(now + 13) == (Shape(2, 0, 1), actuation.state.knobs)
    assert len(backend.routes) == routed and len(admin.puts) == puts


def test_a_disaggregate_waits_for_the_counts_to_settle_before_trusting_an_idle_replica():
    actuation, backend, admin, _ = setup()
    actuation.prepare(1000.0)
    decide_to(actuation, 1000.0, DISAGGREGATE)
    assert actuation.state.roles["c"] == COLOCATED  # idle at once, but the counts may predate a request
    assert actuation.prepare(1000.0 + DRAIN_SETTLE_S / 2) is None and actuation.state.roles["c"] == COLOCATED
    actuation.prepare(1000.0 + DRAIN_SETTLE_S)
    assert actuation.state.roles["c"] == PREFILL


def test_a_disaggregate_that_times_out_routes_the_replica_back_as_it_was():
    actuation, backend, admin, _ = setup()
    actuation.prepare(1000.0)
    admin.load["http://c"]["batch"]["running"] = 1  # a long batch stream that outlasts the drain timeout
    decide_to(actuation, 1000.0, DISAGGREGATE)
    for t in range(1, 32):
        actuation.prepare(1000.0 + t)
    assert actuation.state.draining is None and actuation.state.roles["c"] == COLOCATED
    assert backend.routes[-2:] == [("c", COLOCATED, frozenset()), ("c", COLOCATED, frozenset({"interactive", "batch"}))]
    assert admin.config["http://c"]["chunk_size"] == 64  # never took the prefill settings
    assert actuation.prepare(1033.0) == (Shape(3, 0, 0), actuation.state.knobs)  # free to decide again


def test_aggregate_gives_the_colocated_settings_then_both_class_routes():
    actuation, backend, admin, _ = setup()
    actuation.prepare(1000.0)
    decide_to(actuation, 1000.0, DISAGGREGATE)
    actuation.prepare(1000.0 + DRAIN_SETTLE_S)
    assert actuation.state.roles["c"] == PREFILL
    actuation.state.knobs["chunk_size"] = 32  # a retune meanwhile: the colocated knobs it comes back to
    decide_to(actuation, 1010.0, AGGREGATE)  # no drain: it only takes more traffic
    assert actuation.state.roles["c"] == COLOCATED and actuation.state.draining is None
    assert admin.config["http://c"] == {"token_budget": 256, "chunk_size": 32, "step_time_target_ms": 40}
    assert backend.routes[-1] == ("c", COLOCATED, frozenset({"interactive", "batch"}))
    assert actuation.state.last_shift["to"] == {"colocated": 3, "interactive": 0, "prefill": 0}


def test_dedicate_and_disaggregate_pick_different_replicas_and_merge_leaves_the_prefill_one():
    actuation, backend, admin, _ = setup()
    actuation.prepare(1000.0)
    decide_to(actuation, 1000.0, DISAGGREGATE)
    actuation.prepare(1000.0 + DRAIN_SETTLE_S)
    decide_to(actuation, 1010.0, DEDICATE)
    assert actuation.state.draining.replica == "b"  # the last colocated one, not the prefill replica
    assert backend.routes[-1] == ("b", COLOCATED, frozenset({"interactive"}))  # only batch leaves it
    actuation.prepare(1010.0 + DRAIN_SETTLE_S)
    assert actuation.state.roles == {"a": COLOCATED, "b": INTERACTIVE, "c": PREFILL}
    assert actuation.shape(backend.replicas()) == Shape(1, 1, 1)
    decide_to(actuation, 1020.0, MERGE)
    assert actuation.state.roles == {"a": COLOCATED, "b": COLOCATED, "c": PREFILL}


def test_a_lost_prefill_replica_is_replaced_in_its_role_after_a_restart():
    actuation, backend, admin, _ = setup()
    actuation.prepare(1000.0)
    decide_to(actuation, 1000.0, DISAGGREGATE)
    actuation.prepare(1000.0 + DRAIN_SETTLE_S)
    stored = actuation.state.to_status()  # what the operator keeps in status.controller
    again, backend2, admin2, _ = setup(state=State.from_status(stored, {}), names=("a", "b", "d"))
    again.prepare(1100.0)  # c is gone; the new pod d takes its place in the prefill role
    assert again.state.roles == {"a": COLOCATED, "b": COLOCATED, "d": PREFILL}
    assert admin2.config["http://d"]["chunk_size"] == 128  # settings first (FakeBackend checks the order)
    assert backend2.pods["d"].routes == frozenset({"prefill"})


def test_a_drain_in_progress_survives_a_restart_with_its_move():
    actuation, backend, admin, _ = setup()
    actuation.prepare(1000.0)
    admin.load["http://c"]["interactive"]["waiting"] = 2
    decide_to(actuation, 1000.0, DISAGGREGATE)
    stored = actuation.state.to_status()
    assert stored["draining"] == {"replica": "c", "since": 1000.0, "move": DISAGGREGATE}
    state = State.from_status(stored, {})
    again, backend2, admin2, _ = setup(state=state)
    admin2.load["http://c"]["interactive"]["waiting"] = 2
    assert again.prepare(1005.0) is None
    assert backend2.pods["c"].routes == frozenset()  # still out of every route
    assert again.state.roles["c"] == COLOCATED
    admin2.load["http://c"]["interactive"]["waiting"] = 0
    again.prepare(1006.0)
    assert again.state.roles["c"] == PREFILL
    # a drain stored before the prefill role existed has no move: it is a dedicate
    assert State.from_status({"draining": {"replica": "c", "since": 5.0}}, {}).draining == Drain("c", 5.0, DEDICATE)
    assert State.from_status({"draining": {"replica": "c", "since": 5.0, "move": "merge"}}, {}).draining is None


def test_without_spec_controller_disaggregate_a_prefill_replica_goes_back_to_colocated():
    spec = {**SPEC, "controller": {**SPEC["controller"], "disaggregate": False}}
    state = State(knobs={"token_budget": 256, "chunk_size": 64, "step_time_target_ms": 40},
                  roles={"a": COLOCATED, "b": COLOCATED, "c": PREFILL})
    actuation, backend, admin, _ = setup(spec, state)
    assert actuation.prepare(1000.0)[0] == Shape(3, 0, 0)
    assert backend.pods["c"].routes == frozenset({"interactive", "batch"})


def test_the_prefill_settings_are_the_prefill_engines_or_the_top_of_the_bounds():
    assert prefill_settings(Pool("p", "ns", SPEC)) == {"token_budget": 512, "chunk_size": 128,
                                                       "step_time_target_ms": None}
    own = {**SPEC, "disaggregated": {"prefillEngine": {"chunkSize": 256, "stepTimeTargetMs": 500}}}
    assert prefill_settings(Pool("p", "ns", own)) == {"token_budget": 512, "chunk_size": 256,
                                                      "step_time_target_ms": 500}
    # unbounded budget: the spec's; the chunk never exceeds it
    plain = {**SPEC, "controller": {"bounds": {"chunkSize": {"max": 1024}}}}
    assert prefill_settings(Pool("p", "ns", plain))["chunk_size"] == 256


@pytest.mark.parametrize("move, after", [(DEDICATE, Shape(1, 2, 1)), (MERGE, Shape(3, 0, 1)),
                                         (DISAGGREGATE, Shape(1, 1, 2)), (AGGREGATE, Shape(3, 1, 0))])
def test_shape_after_moves_one_replica(move, after):
    assert shape_after(Shape(2, 1, 1), move) == after


def test_the_local_backend_writes_the_prefill_role_of_the_gateway_file():
    from cadenza.local.actuation import LocalBackend

    written = []
    backend = LocalBackend({"auto-0": "http://a", "auto-1": "http://b"}, "http://g", written.append)
    b = next(r for r in backend.replicas() if r.name == "auto-1")
    backend.route(b, COLOCATED, frozenset())
    assert written[-1] == {"interactive": ["http://a"], "batch": ["http://a"], "prefill": []}
    backend.route(b, PREFILL, frozenset({"prefill"}))
    assert written[-1] == {"interactive": ["http://a"], "batch": ["http://a"], "prefill": ["http://b"]}
    assert backend.roles["auto-1"] == PREFILL and b.routes == frozenset({"prefill"})


def test_a_prefill_replica_goes_back_to_colocated_when_no_replica_that_decodes_is_left():
    # Two replicas, a colocated and b prefill; a is deleted (a scale-down, an eviction): b alone
    # prefills for nobody and nothing serves interactive or batch — it must decode again.
    state = State(knobs={"token_budget": 256, "chunk_size": 64, "step_time_target_ms": 40},
                  roles={"a": COLOCATED, "b": PREFILL})
    actuation, backend, admin, _ = setup(state=state, names=("b",))
    backend.pods["b"].routes = frozenset({"prefill"})
    assert actuation.prepare(1000.0)[0] == Shape(1, 0, 0)
    assert actuation.state.roles == {"b": COLOCATED}
    assert backend.pods["b"].routes == frozenset({"interactive", "batch"})
    assert admin.config["http://b"]["chunk_size"] == 64  # the colocated settings, before the routes


def test_a_disaggregate_drain_is_called_off_when_the_other_replicas_that_decode_are_lost():
    # b drains into prefill while a serves; a is deleted: b must not become the pool's only,
    # prefill-only replica — it stays colocated and is routed again.
    state = State(knobs={"token_budget": 256, "chunk_size": 64, "step_time_target_ms": 40},
                  roles={"a": COLOCATED, "b": COLOCATED}, draining=Drain("b", 1000.0, DISAGGREGATE))
    actuation, backend, admin, _ = setup(state=state, names=("b",))
    assert actuation.prepare(1000.0 + DRAIN_SETTLE_S) == (Shape(1, 0, 0), actuation.state.knobs)
    assert actuation.state.draining is None and actuation.state.roles == {"b": COLOCATED}
    assert backend.pods["b"].routes == frozenset({"interactive", "batch"})
    assert admin.config["http://b"]["chunk_size"] == 64


def test_a_stored_disaggregate_drain_is_called_off_once_the_pool_turns_disaggregate_off():
    spec = {**SPEC, "controller": {**SPEC["controller"], "disaggregate": False}}
    state = State(knobs={"token_budget": 256, "chunk_size": 64, "step_time_target_ms": 40},
                  roles={"a": COLOCATED, "b": COLOCATED, "c": COLOCATED}, draining=Drain("c", 1000.0, DISAGGREGATE))
    actuation, backend, admin, _ = setup(spec, state)
    assert actuation.prepare(1000.0 + DRAIN_SETTLE_S) == (Shape(3, 0, 0), actuation.state.knobs)
    assert actuation.state.draining is None and actuation.state.roles["c"] == COLOCATED
    assert backend.pods["c"].routes == frozenset({"interactive", "batch"})
    assert all(name != "c" or "prefill" not in routes for name, _role, routes in backend.routes)


def test_a_dedicate_drain_of_the_last_colocated_replica_leaves_the_prefill_replica_alone():
    # (1, 0, 1) with batch idle: decide() may dedicate a; it still decodes, so b stays prefill.
    state = State(knobs={"token_budget": 256, "chunk_size": 64, "step_time_target_ms": 40},
                  roles={"a": COLOCATED, "b": PREFILL}, draining=Drain("a", 1000.0, DEDICATE))
    actuation, backend, admin, _ = setup(state=state, names=("a", "b"))
    actuation.prepare(1000.0 + DRAIN_SETTLE_S)
    assert actuation.state.roles == {"a": INTERACTIVE, "b": PREFILL}


@pytest.mark.parametrize("move", [DISAGGREGATE, DEDICATE])
def test_a_split_waits_while_the_replica_that_would_stay_colocated_is_not_ready(move):
    # decide() counts every replica in the shape: (2, 0, 0) lets it split one. With a restarting
    # (not ready), moving the ready b would take the pool's only serving replica out of its routes.
    actuation, backend, admin, _ = setup(names=("a", "b"))
    backend.pods["a"].ready = False
    decide_to(actuation, 1000.0, move)
    assert actuation.state.draining is None and actuation.state.roles == {"a": COLOCATED, "b": COLOCATED}
    assert backend.pods["b"].routes == frozenset({"interactive", "batch"})
    backend.pods["a"].ready = True  # back: the next decision may move one
    decide_to(actuation, 1700.0, move)
    assert actuation.state.draining is not None


def test_a_dedicate_that_decide_allowed_of_the_last_colocated_replica_is_carried_out():
    # (1, 1, 0), batch idle: decide() moves the last colocated replica; nothing else was counted on.
    state = State(knobs={"token_budget": 256, "chunk_size": 64, "step_time_target_ms": 40},
                  roles={"a": COLOCATED, "b": INTERACTIVE})
    actuation, backend, admin, _ = setup(state=state, names=("a", "b"))
    decide_to(actuation, 1000.0, DEDICATE)
    assert actuation.state.draining == Drain("a", 1000.0, DEDICATE)


def test_the_prefill_budget_is_never_under_the_chunk_prefill_engine_names():
    # spec.engine's budget of 2048 holds the named chunk (the pool validates); the bounds' top
    # budget of 1024 does not, and the engine would refuse every PUT: the drain could never finish.
    spec = {**SPEC, "engine": {"tokenBudget": 2048, "chunkSize": 512},
            "disaggregated": {"prefillEngine": {"chunkSize": 2048}},
            "controller": {"bounds": {"tokenBudget": {"min": 256, "max": 1024}}}}
    doc = prefill_settings(Pool("p", "ns", spec))
    assert doc["chunk_size"] == 2048 and doc["token_budget"] >= doc["chunk_size"]


def test_a_moves_record_carries_the_figures_rung_3_attributed_it_by():
    from cadenza.control.in_place import figures
    from cadenza.control.signals import ClassWindow

    slow = ClassWindow(True, requests=50, itl_p99_ms=180.0, prefill_share=0.8123, long_prompt_share=0.45,
                       min_prompt_tokens=2048.0)
    out = figures(Signals({}, {"interactive": slow}), ControllerSpec.from_pool_spec(SPEC))
    assert out["prefill_share"] == 0.812 and out["long_prompt_share"] == 0.45 and out["min_prompt_tokens"] == 2048
