"""The upstream table (least outstanding, round robin, full, back-off) and the header rules."""

from __future__ import annotations

import email.utils

import pytest
from multidict import CIMultiDict

from cadenza.gateway.headers import request_headers, response_headers, retry_after_s
from cadenza.gateway.upstreams import Upstreams

A, B, C = "http://a:1", "http://b:1", "http://c:1"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_pick_takes_the_upstream_with_fewest_requests_in_flight():
    table = Upstreams({"interactive": [A, B, C]})
    a, b, c = table.of_role("interactive")
    a.outstanding, b.outstanding, c.outstanding = 3, 1, 2
    assert table.pick(table.of_role("interactive"), 64) is b


def test_ties_go_round_robin():
    table = Upstreams({"batch": [A, B, C]})
    ups = table.of_role("batch")
    picked = [table.pick(ups, 64).url for _ in range(6)]
    assert picked == [A, B, C, A, B, C]


def test_an_upstream_at_max_outstanding_is_full_and_skipped():
    table = Upstreams({"batch": [A, B]})
    a, b = table.of_role("batch")
    a.outstanding, b.outstanding = 1, 2
    assert table.pick([a, b], max_outstanding=2) is a
    a.outstanding = 2
    assert table.pick([a, b], max_outstanding=2) is None
    assert table.retry_after_s([a, b], 2) == 1


def test_back_off_makes_an_upstream_full_until_its_retry_after_passes():
    clock = Clock()
    table = Upstreams({"batch": [A, B]}, clock=clock)
    a, b = table.of_role("batch")
    table.back_off(a, 7)
    table.back_off(b, 2.5)
    assert table.pick([a, b], 64) is None
    assert table.retry_after_s([a, b], 64) == 3  # the smallest wait, rounded up
    clock.now += 2.6
    assert table.pick([a, b], 64) is b
    assert table.snapshot(64)["batch"][0] == {"url": A, "outstanding": 0, "full": True, "retry_after_s": 4.4,
                                                  "down": False}


def test_an_unreachable_upstream_is_down_until_it_answers():
    table = Upstreams({"interactive": [A, B]})
    a, b = table.of_role("interactive")
    table.unreachable(a)
    table.unreachable(a)
    assert [table.pick([a, b], 64) for _ in range(3)] == [b, b, b]  # avoided while down
    assert table.reachable("interactive") == [b]
    assert table.snapshot(64)["interactive"][0]["down"] is True
    table.answered(a)
    assert a.failures == 0 and table.reachable("interactive") == [a, b]
    assert a in {table.pick([a, b], 64) for _ in range(2)}


def test_when_every_free_upstream_is_down_one_is_still_tried():
    table = Upstreams({"batch": [A, B]})
    a, b = table.of_role("batch")
    table.unreachable(a)
    table.unreachable(b)
    assert table.pick([a, b], 64) in (a, b) and table.reachable("batch") == []
    table.unreachable(a)
    assert table.pick([a, b], 64) is b  # panic picks the one that failed least (most likely back)
    b.outstanding = 64  # full beats down: a full upstream is never picked
    assert table.pick([a, b], 64) is a


def test_a_replica_in_both_roles_is_one_upstream_with_one_count():
    table = Upstreams({"interactive": [A], "batch": [A + "/"]})
    assert table.of_role("interactive")[0] is table.of_role("batch")[0]
    assert len(table.all()) == 1


def test_replace_keeps_the_state_of_replicas_that_stay():
    table = Upstreams({"interactive": [A, B]})
    a = table.of_role("interactive")[0]
    a.outstanding = 5
    assert table.replace({"interactive": [A, C], "batch": [B]})
    assert table.of_role("interactive")[0] is a and a.outstanding == 5
    assert table.urls() == {"interactive": [A, C], "batch": [B]}
    assert not table.replace({"interactive": [A, C], "batch": [B]})


def test_unknown_roles_are_refused():
    with pytest.raises(ValueError, match="unknown role"):
        Upstreams({"fast": [A]})


def test_hop_by_hop_headers_are_not_forwarded_and_the_rest_are():
    incoming = CIMultiDict({
        "Authorization": "Bearer t", "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "tracestate": "congo=t61rcWkgMzE", "X-Cadenza-Class": "batch", "x-cadenza-tenant": "acme",
        "Connection": "keep-alive, X-Secret-Hop", "Keep-Alive": "timeout=5", "Transfer-Encoding": "chunked",
        "TE": "trailers", "Upgrade": "h2c", "X-Secret-Hop": "1", "Host": "gateway:8000", "Content-Length": "12",
        "Proxy-Authorization": "Basic x",
    })
    out = request_headers(incoming, "10.0.0.9")
    assert set(map(str.lower, out)) == {"authorization", "traceparent", "tracestate", "x-cadenza-class",
                                        "x-cadenza-tenant", "x-forwarded-for"}
    assert out["traceparent"] == incoming["traceparent"] and out["X-Forwarded-For"] == "10.0.0.9"


def test_response_headers_keep_end_to_end_ones():
    upstream = CIMultiDict({"Content-Type": "text/event-stream", "Retry-After": "3", "X-Request-Id": "r1",
                            "Transfer-Encoding": "chunked", "Connection": "close"})
    assert dict(response_headers(upstream)) == {"Content-Type": "text/event-stream", "Retry-After": "3",
                                                "X-Request-Id": "r1"}


@pytest.mark.parametrize("value, seconds", [("7", 7.0), (" 2 ", 2.0), (None, 1.0), ("soon", 1.0), ("-3", 0.0),
                                            ("nan", 1.0), ("1e9", 3600.0)])
def test_retry_after_reads_delay_seconds(value, seconds):
    assert retry_after_s(value) == seconds


def test_retry_after_reads_an_http_date():
    assert retry_after_s(email.utils.formatdate(1_000_030, usegmt=True), now=1_000_000) == 30
