"""The scheduling policy, driven without a model: classes, tenants, aging, KV pressure, overload.

Numbers in test names and assertions are those of the issue that specified the policy.
"""

from __future__ import annotations

import dataclasses
import random
import time

import pytest

from cadenza.node.core.admission import AdmissionError
from cadenza.node.core.codec import encode
from cadenza.node.core.messages import StepOutputs
from cadenza.node.core.policy import MAX_TENANTS, ClassPolicy, Policy, PolicyError, TenantPolicy, default_class_policies
from cadenza.node.core.request import RequestStatus
from fake_engine import FakeEngine, make_request, make_scheduler


def classes(**changes: ClassPolicy) -> dict:
    return {**default_class_policies(), **changes}


# -- token budget and chunks ----------------------------------------------------------------------


def test_unchunked_prompt_one_over_the_budget_completes_in_two_prefill_steps_beside_ten_short_ones():
    sched = make_scheduler(token_budget=2048, chunk_size=None, max_num_seqs=16, max_model_len=4096, num_blocks=2048,
                           block_size=16)
    engine = FakeEngine(sched)
    long = engine.add(make_request(2049, max_tokens=4))
    short = [engine.add(make_request(20, max_tokens=4)) for _ in range(10)]
    engine.run()
    prefill_steps = [i for i, out in enumerate(engine.record.steps)
                     if any(r.request is long and r.start < 2049 and not (r.num_tokens == 1 and r.start == 2049)
                            for r in out.rows)]
    assert len(prefill_steps) == 2
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in [long, *short])
    assert all(out.num_tokens <= 2048 for out in engine.record.steps)


def test_short_prompts_get_their_first_token_within_a_few_steps_of_a_64k_prompt():
    """Budget 2048: one 64k-token prompt, then 50 prompts of 100 tokens, with 8 streams decoding."""
    sched = make_scheduler(token_budget=2048, chunk_size=256, max_num_seqs=64, max_model_len=70_000,
                           num_blocks=80_000 // 16, block_size=16)
    engine = FakeEngine(sched)
    streams = [engine.add(make_request(10, max_tokens=10_000)) for _ in range(8)]
    while any(s.num_output_tokens == 0 for s in streams):
        engine.step()
    engine.add(make_request(65_536, max_tokens=1))
    short = [engine.add(make_request(100, max_tokens=2)) for _ in range(50)]
    before = len(engine.record.steps)
    for _ in range(12):
        counts = [s.num_output_tokens for s in streams]
        engine.step()
        assert [s.num_output_tokens for s in streams] == [c + 1 for c in counts]  # every stream, every step
    ttft_steps = [engine.record.first_token_step[r.request_id] - before + 1 for r in short]
    assert max(ttft_steps) <= 4


# -- traffic classes ------------------------------------------------------------------------------


def test_higher_classes_prefill_first_but_lower_classes_keep_their_min_share():
    sched = make_scheduler(token_budget=100, chunk_size=100, max_num_seqs=32, max_model_len=4096, num_blocks=1024,
                           classes=classes(batch=ClassPolicy(min_share=0.2)))
    engine = FakeEngine(sched)
    batch = engine.add(make_request(1000, max_tokens=1, traffic_class="batch"))
    inter = engine.add(make_request(1000, max_tokens=1, traffic_class="interactive"))
    out = engine.step()
    tokens = {r.request.request_id: r.num_tokens for r in out.rows}
    assert tokens == {inter.request_id: 80, batch.request_id: 20}


def test_a_class_never_takes_more_than_its_max_prefill_tokens_per_step():
    sched = make_scheduler(token_budget=256, chunk_size=256, max_num_seqs=32, max_model_len=4096,
                           classes=classes(batch=ClassPolicy(max_prefill_tokens=32)))
    engine = FakeEngine(sched)
    for _ in range(3):
        engine.add(make_request(500, max_tokens=1, traffic_class="batch"))
    for _ in range(5):
        out = engine.step()
        assert sum(r.num_tokens for r in out.rows if r.request.traffic_class == "batch") <= 32


def test_batch_request_is_admitted_within_its_max_queue_age_despite_an_interactive_flood():
    """Interactive flood plus one batch request: its queue age never exceeds the class maximum."""
    max_age = 2.0
    sched = make_scheduler(token_budget=64, chunk_size=64, max_num_seqs=4, max_model_len=1024, num_blocks=4096,
                           classes=classes(batch=ClassPolicy(min_share=0.0, max_queue_age_s=max_age)),
                           queue_depth=100_000)
    engine = FakeEngine(sched, step_seconds=0.1)
    for _ in range(8):
        engine.add(make_request(60, max_tokens=8))
    batch = engine.add(make_request(60, max_tokens=4, traffic_class="batch"))
    for _ in range(60):
        for _ in range(3):  # the flood keeps coming
            engine.add(make_request(60, max_tokens=8))
        engine.step()
        if batch.admitted_time is not None:
            break
        assert engine.clock.now - batch.arrival_time <= max_age
    assert batch.admitted_time is not None
    assert batch.admitted_time - batch.arrival_time <= max_age


# -- tenants --------------------------------------------------------------------------------------


def test_two_saturating_tenants_with_weights_3_to_1_get_prefill_tokens_3_to_1():
    policy = {"tenants": {"gold": TenantPolicy(weight=3.0), "bronze": TenantPolicy(weight=1.0)}}
    sched = make_scheduler(token_budget=128, chunk_size=64, max_num_seqs=8, max_model_len=4096, num_blocks=8192,
                           queue_depth=100_000, **policy)
    engine = FakeEngine(sched)
    rng = random.Random(0)
    for _ in range(400):
        engine.add(make_request(rng.randint(20, 300), max_tokens=2, tenant="gold"))
        engine.add(make_request(rng.randint(20, 300), max_tokens=2, tenant="bronze"))
    for _ in range(300):  # both stay saturated throughout
        engine.step()
    served = sched.stats.prefill_tokens_by_tenant
    assert len(sched.queues["interactive"].tenants) == 2
    assert served["gold"] / served["bronze"] == pytest.approx(3.0, rel=0.10)


def test_tenant_quotas_refuse_with_429_and_a_too_large_prompt_with_413():
    sched = make_scheduler(tenants={"t": TenantPolicy(max_concurrent=2, max_queued_prompt_tokens=100)})
    sched.add_request(make_request(40, tenant="t"))
    with pytest.raises(AdmissionError) as err:
        sched.add_request(make_request(70, tenant="t"))
    assert err.value.status == 429 and err.value.reason == "tenant_tokens" and err.value.retry_after >= 1
    sched.add_request(make_request(10, tenant="t"))
    with pytest.raises(AdmissionError) as err:
        sched.add_request(make_request(10, tenant="t"))
    assert err.value.status == 429 and err.value.reason == "tenant_concurrency"
    with pytest.raises(AdmissionError) as err:
        sched.add_request(make_request(101, tenant="u", ))  # other tenants are not limited
        sched.add_request(make_request(101, tenant="t"))
    assert err.value.status in (413, 429)
    assert sched.stats.rejected["tenant_concurrency"] >= 1


def test_queue_depth_limit_refuses_with_retry_after_from_the_drain_rate():
    sched = make_scheduler(token_budget=32, chunk_size=32, max_num_seqs=1, max_model_len=1024,
                           classes=classes(interactive=ClassPolicy(max_queue_depth=5)))
    engine = FakeEngine(sched, step_seconds=0.5)
    for _ in range(5):
        engine.add(make_request(16, max_tokens=1))
    for _ in range(6):
        engine.step()  # one request drains per 0.5 s step
    for _ in range(5):
        engine.add(make_request(16, max_tokens=1))
    with pytest.raises(AdmissionError) as err:
        engine.add(make_request(16, max_tokens=1))
    assert err.value.status == 429 and err.value.reason == "queue_full"
    assert 2 <= err.value.retry_after <= 4  # 5 queued at ~2 per second


def test_without_a_configured_depth_each_queue_is_bounded_by_the_engines_capacity():
    """max_num_seqs 8: 16 interactive and 128 batch requests may wait; the next is a 429."""
    sched = make_scheduler(token_budget=64, chunk_size=16, max_num_seqs=8, max_model_len=1024)
    engine = FakeEngine(sched)
    for _ in range(8):
        engine.add(make_request(10, max_tokens=100))
    engine.step()
    engine.step()
    assert sched.num_running == 8 and sched.num_waiting == 0
    for _ in range(16):
        engine.add(make_request(10, max_tokens=100))
    for _ in range(128):
        engine.add(make_request(10, max_tokens=100, traffic_class="batch"))
    for cls in ("interactive", "batch"):
        with pytest.raises(AdmissionError) as refused:
            engine.add(make_request(10, max_tokens=100, traffic_class=cls))
        assert refused.value.status == 429 and refused.value.reason == "queue_full"
        assert refused.value.retry_after >= 1
    snapshot = sched.snapshot().classes
    assert snapshot["interactive"].queue_limit == 16 and snapshot["batch"].queue_limit == 128
    sched.reconfigure(dataclasses.replace(sched.config, policy=sched.policy.updated(
        {"classes": {"interactive": {"max_queue_depth": 17}}})))  # an explicit depth overrides it
    engine.add(make_request(10, max_tokens=100))
    engine.run()
    assert sched.num_waiting == 0


@pytest.mark.parametrize("isolated", [False, True])
def test_with_tenant_cache_isolation_one_tenant_never_hits_anothers_prompt(isolated):
    sched = make_scheduler(max_model_len=1024, tenant_cache_isolation=isolated)
    engine = FakeEngine(sched)
    prompt = list(range(100, 164))
    engine.add(make_request(64, tokens=prompt, tenant="alice"))
    engine.run()
    bob = engine.add(make_request(64, tokens=prompt, tenant="bob"))
    alice_again = engine.add(make_request(64, tokens=prompt, tenant="alice"))
    salted = engine.add(make_request(64, tokens=prompt, tenant="alice", cache_salt="s1"))
    engine.run()
    assert (bob.num_cached_tokens == 0) == isolated
    assert alice_again.num_cached_tokens == 60  # a tenant's own prompts still hit (last block recomputed)
    assert salted.num_cached_tokens == 0  # a client's cache_salt keeps it apart, isolation or not


def test_invalid_class_or_tenant_is_a_400():
    sched = make_scheduler()
    for fields in ({"traffic_class": "vip"}, {"tenant": "bad tenant!"}):
        with pytest.raises(AdmissionError) as err:
            sched.add_request(make_request(4, **fields))
        assert err.value.status == 400


def test_prompt_plus_max_tokens_over_max_model_len_is_a_400():
    sched = make_scheduler(max_model_len=1024)
    with pytest.raises(AdmissionError) as err:
        sched.add_request(make_request(1000, max_tokens=100))
    assert err.value.status == 400 and "max_model_len" in str(err.value)


# -- KV pressure ----------------------------------------------------------------------------------


def test_new_prefill_waits_for_kv_headroom_before_anything_is_preempted():
    sched = make_scheduler(token_budget=512, chunk_size=64, max_num_seqs=8, max_model_len=256, num_blocks=80,
                           block_size=4)
    engine = FakeEngine(sched)
    first = engine.add(make_request(200, max_tokens=20))
    engine.step()
    second = engine.add(make_request(200, max_tokens=20))
    engine.step()
    assert second.status == RequestStatus.WAITING and sched.stats.kv_admission_delays > 0
    engine.run()
    assert sched.stats.num_preemptions == 0
    assert first.status == second.status == RequestStatus.FINISHED_LENGTH


def test_preemption_takes_the_lowest_class_first_and_the_newest_within_a_class():
    sched = make_scheduler(token_budget=64, chunk_size=64, max_num_seqs=8, max_model_len=24, num_blocks=12,
                           block_size=4, watermark=0.0)
    engine = FakeEngine(sched)
    old_batch = engine.add(make_request(10, max_tokens=14, traffic_class="batch"))
    engine.clock.now += 1
    new_batch = engine.add(make_request(10, max_tokens=14, traffic_class="batch"))
    engine.clock.now += 1
    inter = engine.add(make_request(10, max_tokens=14))
    victims = []
    while sched.has_unfinished_requests():
        victims += engine.step().preempted
    assert victims and victims[0] is new_batch
    assert inter not in victims
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in (old_batch, new_batch, inter))


def test_a_victim_already_scheduled_in_the_step_is_unscheduled_and_refunded():
    # Nine blocks of 4: a batch request (older, scheduled first) and an interactive one that needs
    # a new block when none is free.
    sched = make_scheduler(token_budget=64, chunk_size=64, max_num_seqs=8, max_model_len=32, num_blocks=9,
                           block_size=4, watermark=0.0)
    engine = FakeEngine(sched)
    batch = engine.add(make_request(14, max_tokens=10, traffic_class="batch"))
    engine.clock.now += 1
    inter = engine.add(make_request(6, max_tokens=10))
    refunded = []
    while sched.has_unfinished_requests():
        out = engine.step()
        if batch in out.preempted:
            refunded.append(out)
            assert all(r.request is not batch for r in out.rows)  # its row is gone
            assert out.num_decode_tokens == sum(1 for r in out.rows if r.num_tokens == 1 and r.request.num_output_tokens)
    assert refunded, "the batch request should have been preempted while scheduled"
    assert batch.status == inter.status == RequestStatus.FINISHED_LENGTH


def test_a_request_preempted_more_than_n_times_is_protected():
    sched = make_scheduler(token_budget=64, chunk_size=64, max_num_seqs=8, max_model_len=40, num_blocks=12,
                           block_size=4, watermark=0.0, max_preemptions=1)
    engine = FakeEngine(sched)
    reqs = []
    for _ in range(4):
        reqs.append(engine.add(make_request(8, max_tokens=30, traffic_class="background")))
        engine.clock.now += 1
    engine.run()
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
    assert max(r.num_preemptions for r in reqs) <= 2  # preempted at most N + 1 = 2 times
    assert sched.stats.num_preemptions > 0


def test_preempted_request_resumes_before_new_admissions_of_its_class():
    sched = make_scheduler(token_budget=64, chunk_size=64, max_num_seqs=8, max_model_len=24, num_blocks=6,
                           block_size=4, watermark=0.0)
    engine = FakeEngine(sched)
    a = engine.add(make_request(10, max_tokens=14))
    engine.clock.now += 1
    b = engine.add(make_request(10, max_tokens=14))
    while not b.num_preemptions:
        engine.step()
    engine.clock.now += 1
    c = engine.add(make_request(4, max_tokens=2))
    engine.run()
    assert engine.record.first_token_step[c.request_id] >= 0
    resumed = next(i for i, out in enumerate(engine.record.steps) if any(r.request is b for r in out.rows)
                   and i > engine.record.arrival_step[c.request_id])
    c_first = next(i for i, out in enumerate(engine.record.steps) if any(r.request is c for r in out.rows))
    assert resumed <= c_first
    assert a.status == b.status == c.status == RequestStatus.FINISHED_LENGTH


# -- a higher class takes a lower class's place -------------------------------------------------


def _decoding(engine: FakeEngine, reqs) -> None:
    while any(r.num_output_tokens == 0 for r in reqs):
        engine.step()


def test_an_interactive_request_displaces_the_newest_batch_decode_when_every_slot_is_taken():
    sched = make_scheduler(token_budget=64, chunk_size=16, max_num_seqs=4, max_model_len=1024, num_blocks=1024)
    engine = FakeEngine(sched)
    batch = []
    for _ in range(4):
        batch.append(engine.add(make_request(8, max_tokens=900, traffic_class="batch")))
        engine.clock.now += 1
    _decoding(engine, batch)
    inter = engine.add(make_request(8, max_tokens=4))
    before = len(engine.record.steps)
    steps = 0
    while inter.request_id not in engine.record.first_token_step:
        engine.step()
        steps += 1
    assert steps <= 2  # scheduled at once, not after a batch request's 900 tokens
    assert [r for out in engine.record.steps[before:] for r in out.preempted] == [batch[-1]]  # the newest
    assert sched.stats.num_admission_preemptions == 1
    classes = sched.snapshot().classes  # counted by the victim's class (the controller's signal)
    assert classes["batch"].preemptions == 1 and classes["interactive"].preemptions == 0
    engine.run()
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in [*batch, inter])
    assert batch[-1].num_output_tokens == 900  # it resumed and finished all of it


def test_an_interactive_request_displaces_background_before_batch_when_kv_is_full():
    """Twelve blocks of 4, filled by the decodes of one batch and two background requests that
    would need fifteen to finish."""
    sched = make_scheduler(token_budget=64, chunk_size=64, max_num_seqs=8, max_model_len=64, num_blocks=12,
                           block_size=4, watermark=0.0)
    engine = FakeEngine(sched)
    batch = engine.add(make_request(6, max_tokens=14, traffic_class="batch"))
    engine.clock.now += 1
    old_bg = engine.add(make_request(6, max_tokens=14, traffic_class="background"))
    engine.clock.now += 1
    new_bg = engine.add(make_request(6, max_tokens=14, traffic_class="background"))
    while sched.block_manager.num_free_blocks:
        engine.step()
    assert sched.num_running == 3 and sched.stats.num_preemptions == 0
    inter = engine.add(make_request(10, max_tokens=3))
    first = len(engine.record.steps)
    while inter.request_id not in engine.record.first_token_step:
        engine.step()
    assert len(engine.record.steps) - first <= 2
    victims = [r for out in engine.record.steps[first:] for r in out.preempted]
    assert victims and victims[0] is new_bg and batch not in victims[:2]
    engine.run()
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in (batch, old_bg, new_bg, inter))
    assert sched.block_manager.num_used_blocks == 0


def test_an_equal_class_never_displaces_a_running_request():
    sched = make_scheduler(token_budget=64, chunk_size=16, max_num_seqs=4, max_model_len=1024, num_blocks=1024)
    engine = FakeEngine(sched)
    running = [engine.add(make_request(8, max_tokens=50, traffic_class="batch")) for _ in range(4)]
    _decoding(engine, running)
    late = engine.add(make_request(8, max_tokens=4, traffic_class="batch"))
    engine.run()
    assert sched.stats.num_preemptions == 0
    first_done = min(i for i, out in enumerate(engine.record.steps)
                     if any(r.request in running and r.request.is_finished for r in out.rows))
    assert engine.record.first_token_step[late.request_id] > first_done  # it waited for a free slot
    assert all(r.num_preemptions == 0 for r in [*running, late])


def test_a_lower_class_under_steady_interactive_arrivals_still_finishes():
    """Every step a new interactive request arrives; two slots; batch may be preempted, boundedly."""
    sched = make_scheduler(token_budget=64, chunk_size=16, max_num_seqs=2, max_model_len=1024, num_blocks=1024,
                           max_preemptions=2, queue_depth=100_000)
    engine = FakeEngine(sched, step_seconds=0.05)
    batch = engine.add(make_request(20, max_tokens=60, traffic_class="batch"))
    engine.step()
    inter = []
    for _ in range(2000):
        if batch.is_finished:
            break
        inter.append(engine.add(make_request(6, max_tokens=3)))
        engine.step()
    assert batch.status == RequestStatus.FINISHED_LENGTH and batch.num_output_tokens == 60
    assert 1 <= batch.num_preemptions <= 3  # displaced, then protected after max_preemptions + 1
    engine.run()
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in inter)


def test_two_thousand_requests_with_30_percent_cancelled_leave_no_used_block():
    """Then one request that needs the whole pool succeeds (cached blocks are evicted for it)."""
    rng = random.Random(1)
    sched = make_scheduler(token_budget=256, chunk_size=64, max_num_seqs=32, max_model_len=1024, num_blocks=256,
                           block_size=4, queue_depth=100_000)
    engine = FakeEngine(sched)
    shared = [rng.randrange(3, 500) for _ in range(64)]
    live = []
    for i in range(2000):
        prefix = shared[: rng.choice([0, 16, 32, 64])]
        n = rng.randint(1, 120)
        tokens = prefix + [rng.randrange(3, 500) for _ in range(n)]
        live.append(engine.add(make_request(len(tokens), max_tokens=rng.randint(1, 20), tokens=tokens)))
        if i % 10 == 9:  # every 10 arrivals: a step, then 3 live requests (30 %) are cancelled
            engine.step()
            live = [r for r in live if not r.is_finished]
            for req in rng.sample(live, k=min(len(live), 3)):
                sched.abort_request(req.request_id)
            live = [r for r in live if not r.is_finished]
    engine.run()
    bm = sched.block_manager
    assert sched.stats.num_aborted == 600
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks
    assert sched.stats.prefix_cache_hit_tokens > 0 and bm.num_cached_free_blocks > 0
    whole = engine.add(make_request(1023, max_tokens=1))  # 1024 tokens: all 256 blocks
    engine.run()
    assert whole.status == RequestStatus.FINISHED_LENGTH and bm.num_evictions > 0


# -- decode reservation in time -------------------------------------------------------------------


def test_step_time_target_shrinks_prefill_chunks_while_an_interactive_stream_decodes():
    sched = make_scheduler(token_budget=1024, chunk_size=1024, max_num_seqs=16, max_model_len=8192,
                           num_blocks=4096, block_size=16)
    engine = FakeEngine(sched)
    # Teach the cost model: 1 ms per 10 prefill tokens, 0.5 ms per decode, 2 ms fixed.
    for n in (50, 100, 200, 400, 800, 150, 300, 600, 90, 700):
        req = engine.add(make_request(n, max_tokens=1))
        out = sched.schedule()
        assert (out.predicted_seconds is None) == (sched.cost_model.coef is None)  # none uncalibrated
        seconds = 0.002 + out.num_prefill_tokens * 1e-4 + out.num_decode_tokens * 5e-4
        sched.observe_step_time(out, seconds)
        sched.update_from_output(out, [5] * sum(r.sample for r in out.rows))
        assert req.is_finished
    assert sched.cost_model.ready
    target = sched.config.policy.updated({"step_time_target_ms": 20.0})
    sched.reconfigure(sched.config.__class__(1024, 1024, 16, 8192, True, target))
    engine.add(make_request(8000, max_tokens=1, traffic_class="batch"))
    out = sched.schedule()  # no interactive stream is decoding: nothing to protect, full chunk
    assert out.num_prefill_tokens == 1024
    sched.update_from_output(out, [])
    stream = engine.add(make_request(4, max_tokens=50))
    while stream.num_output_tokens == 0:
        engine.step()
    out = sched.schedule()
    predicted = sched.cost_model.predict(out.features())
    assert out.predicted_seconds == pytest.approx(predicted)  # what the engines export per step
    assert out.num_decode_tokens == 1
    assert out.num_prefill_tokens < 1024 and predicted <= 0.020 * 1.01
    assert out.num_prefill_tokens >= 150  # the chunk shrank, it did not vanish


def test_live_reconfiguration_takes_effect_from_the_next_step():
    sched = make_scheduler(token_budget=64, chunk_size=64, max_num_seqs=8, max_model_len=2048)
    engine = FakeEngine(sched)
    engine.add(make_request(1000, max_tokens=1))
    assert engine.step().num_prefill_tokens == 64
    sched.reconfigure(sched.config.__class__(token_budget=128, chunk_size=32, max_num_seqs=8, max_model_len=2048))
    assert engine.step().num_prefill_tokens == 32
    with pytest.raises(ValueError, match="max_model_len"):
        sched.reconfigure(sched.config.__class__(max_model_len=4096))


def test_policy_updates_merge_and_validate():
    policy = Policy().updated({"classes": {"batch": {"min_share": 0.3}}, "tenants": {"gold": {"weight": 3}}})
    assert policy.classes["batch"].min_share == 0.3 and policy.classes["batch"].max_queue_age_s == 30.0
    assert policy.tenant("gold").weight == 3 and policy.tenant("other").weight == 1.0
    assert "gold" not in Policy(tenants={"gold": TenantPolicy()}).updated({"tenants": {"gold": None}}).tenants
    for bad, path in [({"classes": {"batch": {"min_share": 2}}}, "classes.batch.min_share"),
                      ({"classes": {"vip": {}}}, "class"), ({"tenants": {"gold": {"weight": 0}}}, "tenants.gold.weight"),
                      ({"turbo": 1}, "turbo"), ({"classes": {"batch": {"speed": 1}}}, "classes.batch.speed")]:
        with pytest.raises(ValueError, match=path):
            Policy().updated(bad)


def test_a_returning_tenant_starts_level_with_those_waiting_neither_credit_nor_debt():
    """A used 10,000 tokens alone, B 200 alone; when both flood, they alternate."""
    sched = make_scheduler(token_budget=512, chunk_size=512, max_num_seqs=1, max_model_len=4096, num_blocks=4096,
                           queue_depth=100_000)
    engine = FakeEngine(sched)
    engine.add(make_request(4000, max_tokens=1, tenant="a"))
    engine.add(make_request(4000, max_tokens=1, tenant="a"))
    engine.add(make_request(2000, max_tokens=1, tenant="a"))
    engine.run()
    engine.add(make_request(200, max_tokens=1, tenant="b"))
    engine.run()
    for _ in range(10):
        engine.add(make_request(100, max_tokens=1, tenant="b"))
        engine.add(make_request(100, max_tokens=1, tenant="a"))
    order = []
    while sched.has_unfinished_requests():
        for row in engine.step().rows:
            if row.start == 0:
                order.append(row.request.tenant)
    assert order[:6] in (["b", "a"] * 3, ["a", "b"] * 3)
    assert all(not q.service for q in sched.queues.values())  # idle tenants leave no state behind


def test_per_tenant_state_stays_bounded_with_many_distinct_tenants():
    sched = make_scheduler(token_budget=512, chunk_size=512, max_num_seqs=64, max_model_len=512, num_blocks=4096)
    engine = FakeEngine(sched)
    for i in range(3000):
        engine.add(make_request(8, max_tokens=1, tenant=f"t{i}"))
        if i % 50 == 49:
            engine.run()
    engine.run()
    assert not sched.tenant_live and all(not q.service and not q.tenants for q in sched.queues.values())
    assert len(sched.stats.prefill_tokens_by_tenant) <= 1025


def test_a_policy_lists_at_most_max_tenants_tenants_and_says_so():
    full = Policy(tenants={f"t{i}": TenantPolicy(weight=2) for i in range(MAX_TENANTS)})
    with pytest.raises(PolicyError, match=f"^tenants: at most {MAX_TENANTS} tenants may be listed, got {MAX_TENANTS + 1}"):
        Policy(tenants={f"t{i}": TenantPolicy() for i in range(MAX_TENANTS + 1)})
    with pytest.raises(PolicyError, match=f"at most {MAX_TENANTS}"):
        full.updated({"tenants": {"one-more": {"weight": 2}}})
    swapped = full.updated({"tenants": {"t0": None, "one-more": {"weight": 2}}})  # one out, one in: still the limit
    assert len(swapped.tenants) == MAX_TENANTS and "one-more" in swapped.tenants
    assert len(full.updated({"tenants": {"t1": {"weight": 3}}}).tenants) == MAX_TENANTS  # changing one is no new one


def _publish_seconds(sched, rounds: int = 30) -> float:
    """The fastest of ``rounds`` stats publications: a snapshot, encoded as the core sends it."""
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        encode(StepOutputs(0.0, stats=sched.snapshot()))
        best = min(best, time.perf_counter() - started)
    return best


def test_publishing_stats_costs_the_same_with_the_most_tenants_configured_as_with_none():
    """Issue 28, point 7: stats walked every configured tenant on each update (100,000 tenants made
    every request 0.86 s). Only tenants with live requests may cost anything."""
    quotas = TenantPolicy(weight=2, max_concurrent=50, max_queued_prompt_tokens=100_000)
    many = make_scheduler(tenants={f"t{i:04d}": quotas for i in range(MAX_TENANTS)})
    none = make_scheduler()
    for sched in (many, none):
        for tenant in ("t0001", "t0002", "walk-in"):
            sched.add_request(make_request(8, tenant=tenant))
    assert set(many.snapshot().tenants) == {"t0001", "t0002"}  # the live tenants with a quota, no others
    assert many.snapshot().tenants["t0001"].live == 1
    assert _publish_seconds(many) < 2 * _publish_seconds(none)


@pytest.mark.parametrize("change", [
    {"tenants": {"t": {"weight": None}}}, {"default_tenant": {"weight": None}}, {"step_time_target_ms": float("inf")},
    {"tenants": {"t": {"weight": float("inf")}}}, {"tenants": {"t": {"weight": 1e-320}}}, {"watermark": False},
    {"classes": {"batch": {"max_queue_age_s": float("inf")}}}, {"classes": {"batch": {"min_share": float("nan")}}},
])
def test_non_finite_null_or_boolean_numbers_are_refused(change):
    with pytest.raises(ValueError):
        Policy().updated(change)


def test_class_names_are_case_insensitive():
    sched = make_scheduler()
    req = make_request(4, traffic_class=" Batch")
    from cadenza.node.core.policy import check_class

    assert check_class(" Batch") == "batch" and check_class("INTERACTIVE") == "interactive"
    sched.add_request(req)
    assert req.traffic_class == "batch" and len(sched.queues["batch"]) == 1


def test_retry_after_reflects_the_recent_drain_not_admissions_before_an_idle_spell():
    from cadenza.node.core.admission import DrainRate

    drain = DrainRate()
    for t in range(0, 600, 10):  # one admission every 10 s, then idle
        drain.record(float(t))
    assert drain.retry_after(20, now=900.0) == 1  # nothing recent: no guess from stale admissions
    for i in range(20):  # a burst drains at 10 requests/s
        drain.record(900.0 + i * 0.1)
    assert drain.retry_after(20, now=902.0) <= 3
