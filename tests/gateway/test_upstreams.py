"""The upstream table (roles, one upstream per replica, kept state) and the header rules."""

from __future__ import annotations

import email.utils

import pytest
from multidict import CIMultiDict

from cadenza.gateway.headers import request_headers, response_headers, retry_after_s
from cadenza.gateway.upstreams import Upstreams

A, B, C = "http://a:1", "http://b:1", "http://c:1"


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
