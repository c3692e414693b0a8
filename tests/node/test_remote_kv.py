"""The scheduler's side of a KV transfer: requests whose prompt KV is pulled from a prefill replica.

Driven without a model or a socket: a fake connector records the loads it is asked for, and the
test reports their outcome as the engine would (``remote_kv_loaded``).
"""

from __future__ import annotations

import pytest

from cadenza.node.core.request import RemoteKV, RequestStatus
from fake_engine import FakeClock, make_request, make_scheduler

BS = 4  # make_scheduler's block size


class FakeConnector:
    max_hold_s = 60.0

    def __init__(self) -> None:
        self.loads: dict[str, tuple[int, list[int]]] = {}  # request id -> (first block, local block ids)
        self.cancelled: list[str] = []
        self.released: list[str] = []

    def start_load(self, request, first_block, block_ids):
        self.loads[request.request_id] = (first_block, block_ids)

    def cancel(self, request_id):
        self.cancelled.append(request_id)

    def release(self, request):
        self.released.append(request.request_id)


def remote(num_tokens: int) -> RemoteKV:
    return RemoteKV("10.0.0.7", 7001, "p-1", "boot-a", num_tokens)


def step(sched, token=5):
    out = sched.schedule()
    sched.update_from_output(out, [token] * out.num_sampled)
    return out


def test_the_prompt_loads_without_spending_budget_and_only_its_last_token_is_prefilled():
    conn = FakeConnector()
    sched = make_scheduler(token_budget=64, chunk_size=16, connector=conn)
    req = make_request(30, remote_kv=remote(30))  # 7 whole blocks + 2 tokens: 8 blocks hold tokens 0-28
    sched.add_request(req)
    out = sched.schedule()
    assert out.is_empty and req.status is RequestStatus.WAITING_FOR_REMOTE_KV
    first, blocks = conn.loads[req.request_id]
    assert first == 0 and len(blocks) == 8 and blocks == sched.block_manager.block_table(req.request_id)[:8]
    assert sched.num_running == 0 and sched.num_waiting == 0 and sched.has_unfinished_requests()
    assert sched.remote_kv_loaded(req.request_id, 8)
    out = step(sched)  # the last prompt token is a decode row: it samples the first token
    assert out.prefill_rows == [] and out.decodes == [req] and out.decode_positions == [29]
    assert req.num_output_tokens == 1 and sched.stats.remote_kv_tokens == 29
    assert sched.block_manager.consistent()


def test_the_last_prompt_token_is_always_computed_here_to_sample_the_first_token():
    conn = FakeConnector()
    sched = make_scheduler(connector=conn)
    req = make_request(8, remote_kv=remote(8))  # 2 blocks; the second's last token is computed here
    sched.add_request(req)
    sched.schedule()
    assert len(conn.loads[req.request_id][1]) == 2
    sched.remote_kv_loaded(req.request_id, 2)
    out = step(sched)
    assert out.decodes == [req] and out.decode_positions == [7] and req.num_output_tokens == 1


def test_a_one_token_prompt_has_nothing_to_load_and_a_thin_source_gives_what_it_holds():
    conn = FakeConnector()
    sched = make_scheduler(connector=conn)
    one, thin = make_request(1, remote_kv=remote(1)), make_request(40, remote_kv=remote(3))
    sched.add_request(one)
    sched.add_request(thin)
    out = step(sched)
    assert [r.request.request_id for r in out.prefill_rows] == [one.request_id]
    assert len(conn.loads[thin.request_id][1]) == 1  # tokens 0-2, in one partial block
    sched.remote_kv_loaded(thin.request_id, 1)
    assert [(r.start, r.num_tokens) for r in step(sched).prefill_rows if r.request is thin] == [(3, 16)]


def test_a_load_that_failed_from_some_block_on_recomputes_from_that_block():
    conn = FakeConnector()
    sched = make_scheduler(token_budget=64, chunk_size=64, connector=conn)
    req = make_request(30, remote_kv=remote(30))
    sched.add_request(req)
    sched.schedule()
    sched.remote_kv_loaded(req.request_id, 3)  # blocks 0-2 verified, block 3 failed
    out = step(sched)
    assert [(r.start, r.num_tokens) for r in out.prefill_rows] == [(12, 18)]
    s = sched.stats
    assert (s.remote_kv_failed_loads, s.remote_kv_recomputed_tokens, s.remote_kv_tokens) == (1, 17, 12)
    assert sched.remote.drain_ended() == [(req.request_id, 12, 18)] and sched.remote.drain_ended() == []  # once, for the span
    with pytest.raises(ValueError):
        other = make_request(30, remote_kv=remote(30))
        sched.add_request(other)
        sched.schedule()
        sched.remote_kv_loaded(other.request_id, 9)


def test_only_verified_blocks_enter_the_prefix_cache_and_a_local_hit_is_not_loaded_again():
    conn = FakeConnector()
    sched = make_scheduler(token_budget=64, chunk_size=64, connector=conn)
    req = make_request(30, remote_kv=remote(30), max_tokens=1)
    sched.add_request(req)
    sched.schedule()
    sched.remote_kv_loaded(req.request_id, 5)  # of 8
    twin = make_request(30, tokens=list(req.token_ids[:30]), remote_kv=remote(30))
    sched.add_request(twin)
    step(sched)
    assert conn.loads[twin.request_id][0] == 5  # blocks 0-4 hit the cache; 5-7 load
    assert len(conn.loads[twin.request_id][1]) == 3


def test_a_loading_request_holds_a_running_slot():
    conn = FakeConnector()
    sched = make_scheduler(max_num_seqs=2, connector=conn)
    loading = [make_request(20, remote_kv=remote(20)) for _ in range(2)]
    local = make_request(6)
    for r in (*loading, local):
        sched.add_request(r)
    out = sched.schedule()
    assert out.is_empty and local.status is RequestStatus.WAITING
    sched.remote_kv_loaded(loading[0].request_id, 4)
    step(sched)
    step(sched)  # loading[0] decodes; the second slot is still the other load's
    assert local.status is RequestStatus.WAITING


def test_aborting_a_loading_request_cancels_its_load_and_frees_its_blocks():
    conn = FakeConnector()
    sched = make_scheduler(connector=conn)
    req = make_request(30, remote_kv=remote(30))
    sched.add_request(req)
    sched.schedule()
    used = sched.block_manager.num_used_blocks
    assert used > 0
    sched.abort_request(req.request_id)
    assert conn.cancelled == [req.request_id] and sched.block_manager.num_used_blocks == 0
    assert not sched.remote_kv_loaded(req.request_id, 8) and not sched.has_unfinished_requests()
    assert sched.block_manager.consistent()


def test_without_a_connector_or_after_a_preemption_the_prompt_is_computed_here():
    sched = make_scheduler()
    req = make_request(30, remote_kv=remote(30))
    sched.add_request(req)
    assert step(sched).prefill_rows[0].num_tokens == 16
    conn = FakeConnector()
    sched = make_scheduler(connector=conn)
    req = make_request(30, remote_kv=remote(30))
    req.num_preemptions = 1  # as if preempted after an earlier load: its source may be gone
    sched.add_request(req)
    assert step(sched).prefill_rows[0].num_tokens == 16 and conn.loads == {}


def test_a_request_that_needs_nothing_from_its_source_releases_it_once():
    conn = FakeConnector()
    sched = make_scheduler(connector=conn)
    req = make_request(1, remote_kv=remote(1))  # the one token is the last: computed here
    sched.add_request(req)
    step(sched)
    assert conn.released == [req.request_id] and req.remote_kv is None and conn.loads == {}


def test_a_queued_request_holds_its_source_until_admitted_and_no_longer_than_the_bound():
    clock, conn = FakeClock(), FakeConnector()
    sched = make_scheduler(max_num_seqs=1, connector=conn, clock=clock)
    busy, early, late = make_request(8, max_tokens=100), make_request(30, remote_kv=remote(30)), make_request(
        30, remote_kv=remote(30))
    sched.add_request(busy)
    step(sched)  # the one slot is taken
    sched.add_request(early)
    clock.now += 20
    sched.add_request(late)
    step(sched)
    assert list(sched.remote.held) == [early.request_id, late.request_id]  # the connector renews both sources
    clock.now += 41  # early: 61 s queued, past the 60 s bound; late: 41 s
    step(sched)
    assert list(sched.remote.held) == [late.request_id] and conn.released == [early.request_id]
    assert early.remote_kv is None and sched.stats.remote_kv_released_holds == 1
    sched.abort_request(busy.request_id)
    step(sched)  # early is admitted and prefilled here: nothing is loaded for it
    assert early.status is RequestStatus.RUNNING and early.num_computed_tokens == 16 and conn.loads == {}
    sched.abort_request(early.request_id)
    sched.schedule()  # late is admitted within its bound: it loads, and is held no more
    assert late.status is RequestStatus.WAITING_FOR_REMOTE_KV and late.request_id in conn.loads
    assert sched.remote.held == {} and conn.released == [early.request_id]


def test_a_queued_request_that_ends_before_its_admission_releases_its_source_at_once():
    conn = FakeConnector()
    sched = make_scheduler(max_num_seqs=1, connector=conn)
    busy, queued = make_request(8, max_tokens=100), make_request(30, remote_kv=remote(30))
    sched.add_request(busy)
    step(sched)
    sched.add_request(queued)
    step(sched)
    sched.abort_request(queued.request_id)
    assert conn.released == [queued.request_id] and sched.remote.held == {}
    sched.abort_request(busy.request_id)
    assert conn.released == [queued.request_id]  # a request that held nothing releases nothing
