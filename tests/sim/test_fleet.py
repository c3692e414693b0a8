"""Simulated replicas behind the gateway's routing: where requests go, what one replica does alone."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cadenza.node.core.config import SchedulerConfig
from cadenza.loadgen.trace import TraceRequest
from cadenza.sim.fleet import Fleet, simulate_fleet, simulate_replica
from cadenza.sim.hardware import PROFILES
from cadenza.sim.model_dims import load_model_dims
from cadenza.sim.roofline import Roofline

CONFIG = SchedulerConfig(token_budget=512, chunk_size=256, max_num_seqs=32, max_model_len=8192)
MODEL = Roofline(load_model_dims("llama-3.1-8b"), PROFILES["h100-sxm"])


def trace(n: int, every_s: float) -> list[TraceRequest]:
    return [TraceRequest(every_s * i, 300 + 53 * (i % 7), 30 + 7 * (i % 4)) for i in range(n)]


def test_one_replica_behind_the_gateway_is_the_replica_alone():
    requests = trace(80, 0.04)
    fleet = simulate_fleet(requests, {"interactive": ["a"], "batch": ["a"]}, {"a": CONFIG}, MODEL)
    _, alone = simulate_replica(requests, CONFIG, MODEL)
    assert fleet.dropped == 0 and fleet.by_class["interactive"] == alone


def test_colocated_replicas_share_the_load_and_cut_the_queueing():
    requests = trace(300, 0.01)
    one = simulate_fleet(requests, {"interactive": ["a"], "batch": ["a"]}, {"a": CONFIG}, MODEL)
    four = simulate_fleet(requests, {"interactive": list("abcd"), "batch": list("abcd")},
                          {n: CONFIG for n in "abcd"}, MODEL)
    assert min(four.steps.values()) > 0.5 * max(four.steps.values())  # least-outstanding spreads them
    assert four.by_class["interactive"].ttft_ms["p99"] < one.by_class["interactive"].ttft_ms["p99"] / 2


def test_dedicated_roles_keep_batch_off_the_interactive_replica():
    requests = trace(60, 0.02)
    classes = ["batch" if i % 2 else "interactive" for i in range(60)]
    result = simulate_fleet(requests, {"interactive": ["fast"], "batch": ["bulk"]},
                            {"fast": CONFIG, "bulk": CONFIG}, MODEL, classes=classes)
    assert result.by_class["interactive"].requests == result.by_class["batch"].requests == 30
    solo = simulate_fleet([r for r, c in zip(requests, classes) if c == "interactive"],
                          {"interactive": ["fast"]}, {"fast": CONFIG}, MODEL)
    # the batch half never touched it (goodput alone differs: it is over the whole run's span)
    assert replace(result.by_class["interactive"], goodput_rps=None) == replace(solo.by_class["interactive"],
                                                                                goodput_rps=None)


def test_a_request_no_replica_takes_is_dropped_and_counted():
    requests = [TraceRequest(0.0, 1000, 500) for _ in range(40)]
    told = []
    result = Fleet({"interactive": ["a"]}, {"a": CONFIG}, MODEL, max_outstanding=10).run(requests, on_done=told.append)
    assert result.dropped == 30 and result.by_class["interactive"].requests == 10
    assert result.by_class["interactive"].rejected == 30
    assert sum(told) == 40  # every request, finished or dropped, reached the progress hook


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="without a config"):
        simulate_fleet(trace(2, 1), {"interactive": ["a"]}, {}, MODEL)
    with pytest.raises(ValueError, match="classes"):
        simulate_fleet(trace(2, 1), {"interactive": ["a"]}, {"a": CONFIG}, MODEL, classes=["batch"])


def test_the_result_counts_slo_attainment_goodput_kv_and_preemptions():
    requests = [replace(r, traffic_class="batch" if i % 3 == 2 else "interactive", tenant=f"t{i % 2}")
                for i, r in enumerate(trace(90, 0.01))]
    slo = {"interactive": {"ttftP99Ms": 150, "itlP99Ms": 40}, "batch": {"ttftP99Ms": 60000}}
    # a small KV pool: preemptions happen, and usage nears the top
    fleet = Fleet({"interactive": ["a"], "batch": ["a"]}, {"a": CONFIG}, MODEL, num_blocks=120, slo=slo)
    result = fleet.run(requests)
    inter, batch = result.by_class["interactive"], result.by_class["batch"]
    assert (inter.requests, batch.requests) == (60, 30)  # classes from the trace's column
    assert batch.slo_met == 30 and batch.slo_attainment == 1.0  # only a loose TTFT target
    assert 0 < inter.slo_met < 60 and inter.slo_attainment == inter.slo_met / 60
    assert inter.goodput_rps == pytest.approx(inter.slo_met / result.span_s)
    assert sum(result.preemptions.values()) > 0 and 0.5 < result.kv_usage["peak"] <= 1.0
    assert 0 < result.kv_usage["mean"] < result.kv_usage["peak"]
    over_time = fleet.attainment_over_time(0.5)
    assert set(over_time) == {"interactive", "batch"} and all(0 <= a <= 1 for _t, a in over_time["interactive"])
    assert {r.tenant for r in fleet.replicas["a"].scheduler.requests.values()} <= {"t0", "t1"}


def test_requests_sent_as_one_class_are_reported_under_the_traces():
    requests = [replace(r, traffic_class="batch" if i % 2 else "interactive") for i, r in enumerate(trace(20, 0.05))]
    result = Fleet({"interactive": ["a"]}, {"a": CONFIG}, MODEL).run(requests, classes=["interactive"] * 20)
    assert result.by_class["interactive"].requests == result.by_class["batch"].requests == 10


def _long_prompts_among_streams() -> list[TraceRequest]:
    """Short prompts decoding 200 tokens, with a 6,000-token prompt every 0.25 s among them."""
    streams = [TraceRequest(0.02 * i, 200, 200) for i in range(40)]
    long = [TraceRequest(0.1 + 0.25 * i, 6000, 20) for i in range(4)]
    return sorted(streams + long, key=lambda r: r.arrival_s)


def test_a_disaggregated_fleet_moves_long_prompts_off_the_decode_replica_over_a_fast_link():
    from cadenza.sim.disagg import KVLinkModel

    requests = _long_prompts_among_streams()
    colocated = simulate_fleet(requests, {"interactive": ["a", "b"], "batch": ["a", "b"]},
                               {"a": CONFIG, "b": CONFIG}, MODEL)
    fleet = Fleet({"interactive": ["d"], "batch": ["d"], "prefill": ["p"]}, {"d": CONFIG, "p": CONFIG}, MODEL,
                  link=KVLinkModel(5e10, 10e-6))  # 400 Gb/s RDMA
    moved = fleet.run(requests)
    kv = moved.kv_transfer
    # the decode replica's model calibrates on its first steps: the long prompts after that move
    assert kv["moved"] >= 3 and kv["fallbacks"] == 0 and 0 < kv["min_prompt_tokens"] < 6000
    assert kv["bytes"] == kv["moved"] * 6000 * MODEL.kv_bytes_per_token()
    assert moved.by_class["interactive"].requests == len(requests)
    on_prefill = list(fleet.replicas["p"].times)  # only long prompts, and only their prefill halves
    assert len(on_prefill) == kv["moved"]
    assert all(requests[int(rid[1:].removesuffix("/prefill"))].input_len == 6000 for rid in on_prefill)
    # the streams' worst gaps no longer hold a 6,000-token prefill's chunks
    assert moved.by_class["interactive"].itl_ms["p99"] < colocated.by_class["interactive"].itl_ms["p99"]
    assert colocated.kv_transfer == {}


def test_a_prefill_replica_with_a_queue_is_sent_only_the_long_prompts_that_still_pay():
    from cadenza.sim.disagg import KVLinkModel

    # the streams and a first long prompt calibrate the decode replica, the second long prompt
    # moves, then six more arrive together
    requests = sorted([TraceRequest(0.02 * i, 200, 200) for i in range(40)]
                      + [TraceRequest(0.1, 6000, 20), TraceRequest(0.35, 6000, 20)]
                      + [TraceRequest(1.0 + 0.001 * i, 6000, 20) for i in range(6)], key=lambda r: r.arrival_s)
    fleet = Fleet({"interactive": ["d"], "batch": ["d"], "prefill": ["p"]}, {"d": CONFIG, "p": CONFIG}, MODEL,
                  link=KVLinkModel(5e10, 10e-6))
    kv = fleet.run(requests).kv_transfer
    # one prompt's prefill ahead costs about what moving saves: the first moves, most others stay
    assert kv["moved"] >= 2 and kv["kept_queued"] >= 3 and kv["moved"] + kv["kept_queued"] == 7
    (prefill,) = fleet.upstreams.of_role("prefill")
    assert (prefill.queued_tokens, prefill.queued_pairs, prefill.outstanding) == (0, 0.0, 0)


def test_over_a_slow_link_no_prompt_is_worth_moving_unless_the_threshold_is_pinned():
    from cadenza.sim.disagg import KVLinkModel, ready_at

    requests = _long_prompts_among_streams()
    roles, configs = {"interactive": ["d"], "batch": ["d"], "prefill": ["p"]}, {"d": CONFIG, "p": CONFIG}
    tcp = Fleet(roles, configs, MODEL, link=KVLinkModel(1.25e8, 50e-6)).run(requests)  # 1 Gb/s
    # only a prompt of millions of tokens, whose prefill attention outgrows the link, would pay
    assert tcp.kv_transfer["moved"] == 0 and tcp.kv_transfer["min_prompt_tokens"] > 10**6
    pinned = Fleet(roles, configs, MODEL, link=KVLinkModel(1.25e8, 50e-6), min_prompt_tokens=1000).run(requests)
    assert pinned.kv_transfer["moved"] == 4
    # moving 6,000 tokens of 128 KiB over 1 Gb/s takes ~6.3 s: the long prompts wait for it
    assert pinned.by_class["interactive"].ttft_ms["p99"] > 6000 > tcp.by_class["interactive"].ttft_ms["p99"]
    # the last of the KV lands after the prefill's last chunk, or once every byte could cross
    link = KVLinkModel(1e9, 1e-3)
    assert ready_at(link, 0.0, 2.0, 1000, 256, 1000) == pytest.approx(2.0 + 256e3 / 1e9 + 1e-3)
    assert ready_at(link, 0.0, 0.5, 1000, 256, 10**6) == pytest.approx(1.0 + 1e-3)
    with pytest.raises(ValueError):
        KVLinkModel(0.0)


def _one_at_a_time(max_queue_depth: int = 1) -> SchedulerConfig:
    """A replica that runs one request and lets one more wait: the next is refused with a 429."""
    from cadenza.node.core.policy import Policy

    policy = Policy().updated({"classes": {"interactive": {"max_queue_depth": max_queue_depth}}})
    return replace(CONFIG, max_num_seqs=1, policy=policy)


def test_a_prefill_replica_that_refuses_is_backed_off_from_and_the_decode_replica_prefills_at_once():
    requests = [TraceRequest(0.001 * i, 6000, 20) for i in range(5)]
    fleet = Fleet({"interactive": ["d"], "prefill": ["p"]}, {"d": CONFIG, "p": _one_at_a_time()}, MODEL,
                  min_prompt_tokens=1000)
    result = fleet.run(requests)
    kv, decode = result.kv_transfer, fleet.replicas["d"].scheduler.stats
    assert result.dropped == 0 and result.by_class["interactive"].requests == 5
    assert (kv["moved"], kv["fallbacks"]) == (2, 3) and list(fleet.replicas["p"].times) == ["r0/prefill", "r1/prefill"]
    (prefill,) = fleet.upstreams.of_role("prefill")
    assert prefill.blocked_until > 0.002  # its 429's Retry-After, as the gateway backs off
    # as the gateway's fallback: the others are sent without a source, so no load waits or fails
    assert decode.remote_kv_loads == 2 and decode.remote_kv_failed_loads == 0


def test_a_request_its_decode_replica_refuses_leaves_nothing_on_the_prefill_replica():
    requests = [TraceRequest(0.0, 6000, 20) for _ in range(5)]
    fleet = Fleet({"interactive": ["d"], "prefill": ["p"]}, {"d": _one_at_a_time(), "p": CONFIG}, MODEL,
                  min_prompt_tokens=1000)
    result = fleet.run(requests)
    assert result.dropped == 3 and result.kv_transfer["moved"] == 2
    # the third was queued for prefill, then refused by the decode replica: its prefill half is aborted
    assert fleet.replicas["p"].scheduler.stats.num_aborted == 1 and len(fleet.replicas["p"].times) == 2
    (prefill,) = fleet.upstreams.of_role("prefill")
    assert (prefill.queued_tokens, prefill.queued_pairs, prefill.outstanding) == (0, 0.0, 0)


def test_a_request_a_replica_refuses_as_too_long_is_dropped_not_retried_elsewhere():
    fleet = Fleet({"interactive": ["a", "b"]}, {n: CONFIG for n in "ab"}, MODEL)
    tried = []
    for name, replica in fleet.replicas.items():
        add = replica.add_request
        replica.add_request = lambda *a, _add=add, _name=name, **k: tried.append(_name) or _add(*a, **k)
    result = fleet.run([TraceRequest(0.0, 8000, 500)])  # 8,500 tokens > max_model_len: a 400, as the gateway relays it
    assert result.dropped == 1 and len(tried) == 1
