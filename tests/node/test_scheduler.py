"""Specification of the chunked-prefill scheduler, driven without a model (a fake executor)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cadenza.node.core.config import SchedulerConfig
from cadenza.node.core.request import Request, RequestStatus
from cadenza.node.core.scheduler import Scheduler
from cadenza.node.core.step import SchedulerOutput
from fake_engine import make_request, make_scheduler


def run_step(sched: Scheduler, token: int = 5) -> SchedulerOutput:
    """Schedule one step and feed back a fake token for every sampling row."""
    out = sched.schedule()
    sched.update_from_output(out, [token] * out.num_sampled)
    return out


def used_blocks_match_tables(sched: Scheduler) -> bool:
    """Used blocks are exactly those in some table, each ref-counted once per table holding it,
    and the reservation adds up (the block manager's written-down invariants)."""
    return sched.block_manager.consistent()


# -- behaviour ------------------------------------------------------------------------------------


def test_long_prompt_is_ingested_in_chunks_of_chunk_size():
    sched = make_scheduler(token_budget=256, chunk_size=128, max_model_len=1024)
    req = make_request(1000)
    sched.add_request(req)
    sizes = []
    while req.num_output_tokens == 0:
        out = run_step(sched)
        sizes.append(out.rows[0].num_tokens)
    assert sizes == [128] * 7 + [104]
    assert req.num_computed_tokens == 1000 and req.num_tokens == 1001


def test_prompt_longer_than_budget_is_served_by_chunking():
    sched = make_scheduler(token_budget=16, chunk_size=None)
    req = make_request(100, max_tokens=2)
    sched.add_request(req)
    steps = 0
    while sched.has_unfinished_requests():
        out = run_step(sched)
        assert out.num_tokens <= 16
        steps += 1
    assert req.status == RequestStatus.FINISHED_LENGTH and steps == 7 + 1


def test_decode_rows_come_first_then_prefill_fills_the_leftover_budget():
    sched = make_scheduler(token_budget=20, chunk_size=64)
    streams = [make_request(3, max_tokens=50) for _ in range(4)]
    for r in streams:
        sched.add_request(r)
    run_step(sched)  # all four prompts fit: 12 tokens
    long = make_request(300)
    sched.add_request(long)
    out = run_step(sched)
    assert [row.num_tokens for row in out.rows] == [1, 1, 1, 1, 16]
    assert [row.request for row in out.rows[:4]] == streams
    assert out.num_decode_tokens == 4 and out.num_prefill_tokens == 16


def test_every_running_decode_advances_every_step_while_a_long_prompt_is_ingested():
    sched = make_scheduler(token_budget=32, chunk_size=8, max_model_len=1024)
    streams = [make_request(2, max_tokens=200) for _ in range(3)]
    for r in streams:
        sched.add_request(r)
    run_step(sched)
    sched.add_request(make_request(400))
    for _ in range(40):
        before = [r.num_output_tokens for r in streams]
        out = run_step(sched)
        assert [r.num_output_tokens for r in streams] == [b + 1 for b in before]
        assert out.num_prefill_tokens == 8


def test_partial_prefills_resume_before_new_requests_are_admitted():
    sched = make_scheduler(token_budget=10, chunk_size=10)
    first, second = make_request(25), make_request(25)
    sched.add_request(first)
    run_step(sched)
    sched.add_request(second)
    out = run_step(sched)
    assert [(row.request, row.num_tokens) for row in out.rows] == [(first, 10)]


def test_waiting_requests_are_admitted_first_come_first_served():
    sched = make_scheduler(token_budget=8, chunk_size=8, max_num_seqs=8)
    reqs = [make_request(8, max_tokens=1) for _ in range(3)]
    for r in reqs:
        sched.add_request(r)
    order = [run_step(sched).rows[0].request for _ in range(3)]
    assert order == reqs


def test_max_num_seqs_caps_running_requests():
    sched = make_scheduler(token_budget=64, chunk_size=4, max_num_seqs=2, queue_depth=5)
    for _ in range(5):
        sched.add_request(make_request(4, max_tokens=10))
    run_step(sched)
    assert sched.num_running == 2 and sched.num_waiting == 3


def test_running_requests_never_exceed_the_token_budget_so_decodes_fit():
    sched = make_scheduler(token_budget=3, chunk_size=3, max_num_seqs=8)
    for _ in range(6):
        sched.add_request(make_request(1, max_tokens=10))
    for _ in range(5):
        out = run_step(sched)
        assert sched.num_running <= 3 and out.num_tokens <= 3


def test_only_rows_that_reach_the_end_of_the_tokens_sample():
    sched = make_scheduler(token_budget=16, chunk_size=10)
    req = make_request(25)
    sched.add_request(req)
    samples = [run_step(sched).rows[0].sample for _ in range(4)]
    assert samples == [False, False, True, True]


def test_a_step_given_the_wrong_number_of_tokens_is_refused_and_changes_nothing():
    sched = make_scheduler(token_budget=16)
    reqs = [make_request(4) for _ in range(2)]
    for req in reqs:
        sched.add_request(req)
    run_step(sched)  # both prompts: now two decodes
    out = sched.schedule()
    assert len(out.decodes) == 2
    with pytest.raises(ValueError, match="1 sampled tokens for a step of 2"):
        sched.update_from_output(out, [9])
    assert [r.num_output_tokens for r in reqs] == [1, 1] and all(r.num_computed_tokens == 4 for r in reqs)
    assert sched.update_from_output(out, [5, 6]) == reqs and [r.token_ids[-1] for r in reqs] == [5, 6]


def two_requests_in_a_tight_pool() -> tuple[Scheduler, Request, Request]:
    """6 blocks of 4 tokens = 24 slots; two requests of 10 prompt + 10 output tokens."""
    sched = make_scheduler(token_budget=64, chunk_size=64, num_blocks=6, block_size=4, max_model_len=24)
    sched.watermark_blocks = 0
    old, new = make_request(10, max_tokens=10, arrival=1.0), make_request(10, max_tokens=10, arrival=2.0)
    sched.add_request(old)
    sched.add_request(new)
    return sched, old, new


def test_kv_shortage_preempts_the_newest_request_by_recompute():
    sched, old, new = two_requests_in_a_tight_pool()
    preempted = []
    while sched.has_unfinished_requests():
        out = run_step(sched)
        preempted += out.preempted
        assert used_blocks_match_tables(sched)
    assert preempted and all(r is new for r in preempted)
    assert sched.stats.num_preemptions == len(preempted)
    assert sched.stats.num_recomputed_tokens > 0
    assert old.num_output_tokens == new.num_output_tokens == 10
    assert sched.block_manager.num_used_blocks == 0


def test_preempted_request_keeps_its_generated_tokens_and_recomputes_them():
    sched, _old, new = two_requests_in_a_tight_pool()
    while not new.num_preemptions:
        run_step(sched)
    assert new.num_computed_tokens == 0 and new.num_output_tokens > 0
    assert sched.queues["interactive"].resume == [new]


def test_abort_frees_kv_blocks_immediately():
    sched = make_scheduler()
    a, b = make_request(30, max_tokens=20), make_request(30, max_tokens=20)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)
    used = sched.block_manager.num_used_blocks
    sched.abort_request(a.request_id)
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert sched.block_manager.num_used_blocks < used and not sched.block_manager.holds(a.request_id)
    sched.abort_request(b.request_id)
    assert sched.block_manager.num_used_blocks == 0 and not sched.has_unfinished_requests()


def test_a_pool_of_exactly_max_model_len_serves_one_request_at_a_time():
    # One block of 16 tokens: the admission watermark must not block the only request.
    sched = make_scheduler(token_budget=64, chunk_size=64, num_blocks=1, block_size=16, max_model_len=16)
    a, b = make_request(2, max_tokens=14), make_request(2, max_tokens=14)
    sched.add_request(a)
    sched.add_request(b)
    steps = 0
    while sched.has_unfinished_requests():
        run_step(sched)
        steps += 1
        assert steps < 100
    assert a.num_output_tokens == b.num_output_tokens == 14


def test_request_over_max_model_len_is_refused():
    sched = make_scheduler(max_model_len=32)
    try:
        sched.add_request(make_request(30, max_tokens=5))
    except ValueError as exc:
        assert "max_model_len" in str(exc)
    else:
        raise AssertionError("expected ValueError")


# -- properties (hypothesis) ----------------------------------------------------------------------


@dataclass
class Trace:
    config: SchedulerConfig
    steps: list[SchedulerOutput] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    aborted: set[str] = field(default_factory=set)
    blocks_consistent: bool = True
    decodes_before: list[set[str]] = field(default_factory=list)
    finished: bool = False
    final_used_blocks: int = -1


workloads = st.fixed_dictionaries(
    {
        "token_budget": st.integers(1, 96),
        "chunk_size": st.one_of(st.none(), st.integers(1, 64)),
        "max_num_seqs": st.integers(1, 12),
        "block_size": st.sampled_from([1, 2, 4, 16]),
        "spare_blocks": st.integers(0, 40),
        "requests": st.lists(
            st.tuples(st.integers(1, 120), st.integers(1, 12), st.integers(0, 30), st.booleans()),
            min_size=1,
            max_size=12,
        ),
        "shared_prefixes": st.booleans(),  # prompts cut from 2 token streams: the prefix cache hits
        "classes": st.lists(st.sampled_from(["interactive", "batch", "background"]), min_size=12, max_size=12),
    }
)


def simulate(w: dict) -> Trace:
    """Run a workload (prompt len, max tokens, arrival step, aborted?) to completion."""
    max_model_len = 140
    bs = w["block_size"]
    num_blocks = -(-max_model_len // bs) + w["spare_blocks"]
    sched = make_scheduler(w["token_budget"], w["chunk_size"], w["max_num_seqs"], max_model_len, num_blocks, bs,
                           queue_depth=len(w["requests"]))
    trace = Trace(sched.config)
    streams = [[(7 * j + k * 13) % 97 + 3 for j in range(120)] for k in range(2)]

    def request(i: int, prompt_len: int, max_tokens: int):
        tokens = streams[i % 2][:prompt_len] if w["shared_prefixes"] else None
        return make_request(prompt_len, max_tokens, arrival=float(i), tokens=tokens, traffic_class=w["classes"][i])

    pending = sorted(
        ((arrival, i, request(i, p, m), abort) for i, (p, m, arrival, abort) in enumerate(w["requests"])),
        key=lambda x: (x[0], x[1]),
    )
    for step in range(5000):
        while pending and pending[0][0] <= step:
            _, _, req, abort = pending.pop(0)
            sched.add_request(req)
            trace.requests.append(req)
            if abort and step % 2:
                trace.aborted.add(req.request_id)
        for rid in list(trace.aborted):
            if rid in sched.requests and sched.stats.num_steps % 3 == 2:
                sched.abort_request(rid)
        trace.decodes_before.append(
            {r.request_id for r in sched.running if r.num_computed_tokens == r.num_tokens - 1}
        )
        out = run_step(sched)
        trace.steps.append(out)
        trace.blocks_consistent &= used_blocks_match_tables(sched)
        if not pending and not sched.has_unfinished_requests():
            trace.finished = True
            break
    trace.final_used_blocks = sched.block_manager.num_used_blocks
    return trace


property_settings = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@property_settings
@given(workloads)
def test_tokens_per_step_never_exceed_the_budget(w):
    trace = simulate(w)
    assert all(out.num_tokens <= trace.config.token_budget for out in trace.steps)


@property_settings
@given(workloads)
def test_no_chunk_is_larger_than_chunk_size(w):
    trace = simulate(w)
    cap = trace.config.effective_chunk_size
    assert all(row.num_tokens <= cap for out in trace.steps for row in out.rows)


@property_settings
@given(workloads)
def test_every_running_decode_advances_each_step_unless_preempted(w):
    trace = simulate(w)
    for decoding, out in zip(trace.decodes_before, trace.steps):
        advanced = {row.request.request_id for row in out.rows if row.num_tokens == 1}
        preempted = {r.request_id for r in out.preempted}
        assert decoding <= advanced | preempted


@property_settings
@given(workloads)
def test_every_request_finishes_with_all_its_tokens(w):
    trace = simulate(w)
    assert trace.finished
    for req in trace.requests:
        assert req.is_finished
        if req.status != RequestStatus.FINISHED_ABORTED:
            assert req.status == RequestStatus.FINISHED_LENGTH
            assert req.num_output_tokens == req.sampling.max_tokens


@property_settings
@given(workloads)
def test_used_blocks_are_exact_and_return_to_zero(w):
    trace = simulate(w)
    assert trace.blocks_consistent
    assert trace.final_used_blocks == 0
