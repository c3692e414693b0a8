"""A client that keeps at most so many requests of a class in flight: the rest wait at the client,
nothing is refused for the backlog, and what is left at its end is counted, not failed."""

from __future__ import annotations

import pytest

from cadenza.loadgen.trace import TraceRequest
from cadenza.node.core.config import SchedulerConfig
from cadenza.sim.client import ConcurrencyLimit
from cadenza.sim.fleet import Fleet
from cadenza.sim.hardware import PROFILES
from cadenza.sim.model_dims import load_model_dims
from cadenza.sim.roofline import Roofline

CONFIG = SchedulerConfig(token_budget=512, chunk_size=256, max_num_seqs=32, max_model_len=8192)
MODEL = Roofline(load_model_dims("llama-3.1-8b"), PROFILES["h100-sxm"])


def _batch_backlog(n: int) -> list[TraceRequest]:
    """``n`` batch prompts at once, and a chat stream every 0.05 s beside them."""
    return sorted([TraceRequest(0.0, 3000, 20, "batch") for _ in range(n)]
                  + [TraceRequest(0.05 * i, 200, 50, "interactive") for i in range(40)], key=lambda r: r.arrival_s)


def _in_flight_at_most(fleet: Fleet, cls: str) -> int:
    """The most requests of ``cls`` between reaching a replica and finishing, at once."""
    events = sorted(e for t in fleet.timelines(cls) for e in ((t.arrival_s, 1), (t.finished_s, -1)))
    most = now = 0
    for _t, step in events:
        now += step
        most = max(most, now)
    return most


def test_a_limited_class_never_has_more_in_flight_and_every_request_is_sent_in_order():
    fleet = Fleet({"interactive": ["a", "b"], "batch": ["a", "b"]}, {"a": CONFIG, "b": CONFIG}, MODEL,
                  max_outstanding=8)
    client = ConcurrencyLimit({"batch": 3})
    result = fleet.run(_batch_backlog(30), client=client)
    # 30 at once into a gateway that takes 8 a replica drops some; the client holds them
    assert result.dropped == 0 and result.by_class["batch"].requests == 30
    unheld = Fleet({"interactive": ["a", "b"], "batch": ["a", "b"]}, {"a": CONFIG, "b": CONFIG}, MODEL,
                   max_outstanding=8).run(_batch_backlog(30))
    assert unheld.dropped > 0
    assert _in_flight_at_most(fleet, "batch") == 3 and client.in_flight == {"batch": 0}
    assert client.unsent() == {"batch": 0} and len(client.waited_s) == 27
    batch = sorted(fleet.timelines("batch"), key=lambda t: t.arrival_s)
    # each waited at the client until one ended: its latency counts from when it was sent
    assert all(t.ttft_s < 5.0 for t in batch) and batch[-1].arrival_s > 1.0
    assert result.by_class["interactive"].requests == 40  # not limited


def test_after_its_end_the_client_sends_nothing_and_counts_what_is_left():
    fleet = Fleet({"interactive": ["a"], "batch": ["a"]}, {"a": CONFIG}, MODEL)
    client = ConcurrencyLimit({"batch": 2}, until_s=0.5)
    result = fleet.run(_batch_backlog(20) + [TraceRequest(0.6, 3000, 20, "batch")], client=client)
    sent = result.by_class["batch"].requests
    assert result.dropped == 0 and sent + client.unsent()["batch"] == 21 and 2 <= sent < 21
    assert all(t.arrival_s < 0.5 for t in fleet.timelines("batch"))


def test_a_refused_request_frees_its_place_for_the_next():
    fleet = Fleet({"interactive": ["a"], "batch": ["a"]}, {"a": CONFIG}, MODEL)
    client = ConcurrencyLimit({"batch": 1})
    too_long = TraceRequest(0.0, 9000, 10, "batch")  # over max_model_len: the replica's 400
    result = fleet.run([too_long, TraceRequest(0.0, 500, 10, "batch")], client=client)
    assert result.dropped == 1 and result.by_class["batch"].requests == 1 and client.in_flight == {"batch": 0}


def test_limits_below_one_are_refused():
    with pytest.raises(ValueError, match="at least 1"):
        ConcurrencyLimit({"batch": 0})
