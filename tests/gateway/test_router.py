"""The routing policy alone (no HTTP, a fake clock): least outstanding, round robin, full and
backed-off replicas, the retry plan, and which prompts go through a prefill replica."""

from __future__ import annotations

import pytest

from cadenza.gateway.router import MAX_ATTEMPTS, NoReplica, Router
from cadenza.gateway.upstreams import Upstreams
from cadenza.node.kv_transfer.threshold import Rule

A, B, C = "http://a:1", "http://b:1", "http://c:1"
P, Q = "http://p:1", "http://q:1"
NOW = 100.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _rule(fixed_s: float) -> Rule:  # 1 ms a prompt token, a free link, the last 16 tokens local: 16 + fixed_s / 1 ms
    return Rule(1e-3, 0.0, 0.0, local_tokens=16, fixed_s=fixed_s)


def disaggregated(min_prompt_tokens: int | str | None = 64, max_outstanding: int = 64) -> Router:
    """Decode replicas a and b (both classes), prefill replicas p and q."""
    table = Upstreams({"interactive": [A, B], "batch": [A, B], "prefill": [P, Q]})
    return Router(table, max_outstanding, min_prompt_tokens)


# -- least outstanding (moved from test_upstreams: the pick is the router's) ---------------------


def test_pick_takes_the_upstream_with_fewest_requests_in_flight():
    table = Upstreams({"interactive": [A, B, C]})
    a, b, c = table.of_role("interactive")
    a.outstanding, b.outstanding, c.outstanding = 3, 1, 2
    assert Router(table, 64).pick(table.of_role("interactive"), NOW) is b


def test_ties_go_round_robin():
    table = Upstreams({"batch": [A, B, C]})
    ups = table.of_role("batch")
    router = Router(table, 64)
    picked = [router.pick(ups, NOW).url for _ in range(6)]
    assert picked == [A, B, C, A, B, C]


def test_an_upstream_at_max_outstanding_is_full_and_skipped():
    table = Upstreams({"batch": [A, B]})
    a, b = table.of_role("batch")
    router = Router(table, max_outstanding=2)
    a.outstanding, b.outstanding = 1, 2
    assert router.pick([a, b], NOW) is a
    a.outstanding = 2
    assert router.pick([a, b], NOW) is None
    assert router.retry_after_s([a, b], NOW) == 1


def test_back_off_makes_an_upstream_full_until_its_retry_after_passes():
    clock = Clock()
    table = Upstreams({"batch": [A, B]}, clock=clock)
    a, b = table.of_role("batch")
    router = Router(table, 64)
    router.back_off(a, 7, clock())
    router.back_off(b, 2.5, clock())
    assert router.pick([a, b], clock()) is None
    assert router.retry_after_s([a, b], clock()) == 3  # the smallest wait, rounded up
    clock.now += 2.6
    assert router.pick([a, b], clock()) is b
    assert table.snapshot(64)["batch"][0] == {"url": A, "outstanding": 0, "full": True, "retry_after_s": 4.4,
                                                  "down": False}


def test_an_unreachable_upstream_is_down_until_it_answers():
    table = Upstreams({"interactive": [A, B]})
    a, b = table.of_role("interactive")
    router = Router(table, 64)
    table.unreachable(a)
    table.unreachable(a)
    assert [router.pick([a, b], NOW) for _ in range(3)] == [b, b, b]  # avoided while down
    assert table.reachable("interactive") == [b]
    assert table.snapshot(64)["interactive"][0]["down"] is True
    table.answered(a)
    assert a.failures == 0 and table.reachable("interactive") == [a, b]
    assert a in {router.pick([a, b], NOW) for _ in range(2)}


def test_when_every_free_upstream_is_down_one_is_still_tried():
    table = Upstreams({"batch": [A, B]})
    a, b = table.of_role("batch")
    router = Router(table, 64)
    table.unreachable(a)
    table.unreachable(b)
    assert router.pick([a, b], NOW) in (a, b) and table.reachable("batch") == []
    table.unreachable(a)
    assert router.pick([a, b], NOW) is b  # panic picks the one that failed least (most likely back)
    b.outstanding = 64  # full beats down: a full upstream is never picked
    assert router.pick([a, b], NOW) is a


# -- choose, finish, retry -------------------------------------------------------------------------


def test_a_class_goes_to_its_roles_least_busy_replica_counted_until_it_finishes():
    table = Upstreams({"interactive": [A], "batch": [B, C]})
    a, b, c = table.all()
    b.outstanding = 1
    router = Router(table, 64)
    route = router.choose("background", 0, NOW)  # background is served by the batch role
    assert (route.decode, route.prefill, route.tried, route.candidates) == (c, None, [c], [b, c])
    assert c.outstanding == 1
    router.finish(route)
    router.finish(route)  # once only
    assert c.outstanding == 0 and route.decode is None
    assert router.choose("interactive", 0, NOW).decode is a and a.outstanding == 1
    assert router.choose(None, 0, NOW).decode in (b, c)  # no class: any replica


def test_a_role_without_replicas_or_with_every_one_full_routes_nowhere_and_counts_nothing():
    table = Upstreams({"interactive": [A], "batch": [B]})
    a, b = table.all()
    router = Router(table, max_outstanding=1)
    with pytest.raises(NoReplica) as none:
        Router(Upstreams({"batch": [B]}), 1).choose("interactive", 0, NOW)
    assert (none.value.busy, none.value.retry_after_s) == (False, 1)
    a.outstanding = 1
    router.back_off(b, 4.2, NOW)
    for cls, wait in (("interactive", 1), ("batch", 5)):  # busy: 1 s; backed off: its Retry-After, rounded up
        with pytest.raises(NoReplica) as full:
            router.choose(cls, 0, NOW)
        assert (full.value.busy, full.value.retry_after_s) == (True, wait)
    assert (a.outstanding, b.outstanding) == (1, 0)


def test_a_failed_try_is_retried_once_on_another_replica_that_is_not_full():
    table = Upstreams({"batch": [A, B, C]})
    a, b, c = table.of_role("batch")
    b.outstanding = 2  # full: never the retry's target
    router = Router(table, max_outstanding=2)
    route = router.choose("batch", 0, NOW)
    assert route.decode is a and MAX_ATTEMPTS == 2
    assert router.should_retry(route, 503) and router.should_retry(route, 429) and not router.should_retry(route, 400)
    assert router.retry(route, NOW) is c and route.tried == [a, c]
    assert (a.outstanding, c.outstanding) == (0, 1)  # the count moved with the request
    assert not router.should_retry(route, 503)  # the retry's answer is the client's
    assert router.retry(route, NOW) is None and c.outstanding == 0  # tries spent: released


def test_a_retry_with_no_other_replica_free_releases_the_first():
    table = Upstreams({"interactive": [A, B]})
    a, b = table.of_role("interactive")
    router = Router(table, 64)
    route = router.choose("interactive", 0, NOW)
    router.back_off(b if route.decode is a else a, 30, NOW)  # the other answered 429 before
    assert router.retry(route, NOW) is None
    assert route.decode is None and a.outstanding == b.outstanding == 0


# -- which prompts go through a prefill replica ------------------------------------------------


def test_a_pinned_threshold_moves_long_prompts_to_the_least_queued_prefill_replica():
    router = disaggregated(64)
    p, q = router.upstreams.of_role("prefill")
    p.queue_prompt(10)
    short = router.choose("interactive", 63, NOW)
    assert short.prefill is None and short.kept is None and short.min_prompt_tokens == 64
    long = router.choose("interactive", 64, NOW)
    assert long.prefill is q and (q.outstanding, q.queued_tokens, q.queued_pairs) == (1, 64, 64 * 64 / 2)
    router.prefill_done(long)
    router.prefill_done(long)  # once only
    assert (q.outstanding, q.queued_tokens, q.queued_pairs, long.prefill) == (0, 0, 0.0, None)
    assert long.decode is not None  # the decode replica stays counted until it finishes
    assert router.choose("interactive", 0, NOW).prefill is None  # 0: not a prompt a prefill replica takes


def test_without_prefill_replicas_or_a_threshold_nothing_moves():
    assert Router(Upstreams({"interactive": [A]}), 64, 1).choose("interactive", 10**6, NOW).prefill is None
    route = disaggregated(None).choose("interactive", 10**6, NOW)
    assert route.prefill is None and route.kept is None and route.min_prompt_tokens is None


def test_with_auto_nothing_moves_before_a_rule_then_the_largest_threshold_of_the_reachable_replicas():
    router = disaggregated("auto")
    a, b = router.upstreams.of_role("interactive")
    assert router.threshold() is None and router.choose("interactive", 10**6, NOW).prefill is None
    a.disagg_rule = _rule(0.048)  # 16 + 48
    assert router.threshold() == 64
    b.disagg_rule = _rule(0.084)  # 16 + 84: it pays on both only from 100
    assert router.threshold() == 100
    assert router.choose("interactive", 99, NOW).prefill is None
    router.upstreams.unreachable(b)  # a down replica's rule is not counted
    assert router.threshold() == 64
    route = router.choose("interactive", 99, NOW)
    assert route.prefill is not None and route.min_prompt_tokens == 64


def test_with_auto_a_prefill_replica_with_a_queue_is_sent_only_prompts_that_pay_after_it():
    router = disaggregated("auto")
    for upstream in router.upstreams.of_role("interactive"):
        upstream.disagg_rule = _rule(0.048)
    p, q = router.upstreams.of_role("prefill")
    p.queue_prompt(40)  # 40 ms of prefill before the next prompt: 64 + 40
    q.queue_prompt(50)  # 50 ms
    assert router.threshold(p) == 104 and router.threshold(q) == 114
    kept = router.choose("interactive", 100, NOW)  # long enough for an idle one, not after p's queue
    assert kept.prefill is None and kept.kept == "kept_queued" and kept.min_prompt_tokens == 64
    moved = router.choose("interactive", 104, NOW)
    assert moved.prefill is p and moved.kept is None


def test_a_prefill_replica_that_refuses_is_backed_off_from_and_the_next_one_tried():
    router = disaggregated(64)
    p, q = router.upstreams.of_role("prefill")
    route = router.choose("interactive", 100, NOW)
    first = route.prefill
    other = q if first is p else p
    assert router.refused(route, NOW, 30) is other and route.refused == [first]
    assert (first.outstanding, first.queued_tokens) == (0, 0) and other.queued_tokens == 100
    assert first.is_full(64, NOW + 29) and not first.is_full(64, NOW + 30)  # its Retry-After
    assert router.refused(route, NOW, 1) is None and route.kept == "fallback_busy"
    assert other.queued_tokens == 0
    # backed off, both are skipped by the next prompt, which is prefilled where it decodes
    later = router.choose("interactive", 100, NOW + 0.5)
    assert later.prefill is None and later.kept == "fallback_busy"


def test_full_or_down_prefill_replicas_are_skipped():
    router = disaggregated(64, max_outstanding=1)
    p, q = router.upstreams.of_role("prefill")
    p.outstanding = 1  # full
    assert router.choose("interactive", 100, NOW).prefill is q
    router.upstreams.unreachable(p)
    p.outstanding = 0
    route = router.choose("batch", 100, NOW)  # q is full now, p is down
    assert route.prefill is None and route.kept == "fallback_busy"


def test_no_prompt_is_moved_while_none_of_the_requests_replicas_could_take_it():
    router = disaggregated(64)
    a, b = router.upstreams.of_role("interactive")
    router.upstreams.unreachable(a)
    router.unready(b, 60, NOW)  # a 503 with Retry-After: 60 (loading or draining)
    route = router.choose("interactive", 10**6, NOW)
    assert route.prefill is None and route.kept is None and route.decode in (a, b)  # it is still sent
    assert all(u.outstanding == 0 for u in router.upstreams.of_role("prefill"))
    assert router.choose("interactive", 10**6, NOW + 60).prefill is not None  # b is ready again
