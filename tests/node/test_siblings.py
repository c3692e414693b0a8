"""Specification of a call's n sequences in the scheduler: one prefill, the prompt's KV shared."""

from __future__ import annotations

import pytest

from cadenza.node.core.admission import AdmissionError
from cadenza.node.core.request import (
    MAX_N,
    Request,
    RequestStatus,
    SamplingParams,
    choice_request_id,
    choice_sampling,
    choice_seed,
)
from cadenza.node.core.scheduler import Scheduler
from cadenza.node.frontend.llm import Engine
from fake_engine import make_request, make_scheduler


def siblings(prompt_len: int, n: int, max_tokens: int = 4) -> list[Request]:
    """The ``n`` sequences of one call, as the engine core builds them."""
    first = make_request(prompt_len, max_tokens)
    return [first] + [Request(choice_request_id(first.request_id, i), list(first.token_ids), first.sampling)
                      for i in range(1, n)]


def run(sched: Scheduler, limit: int = 500) -> int:
    """Step until nothing is left; the prefill tokens the steps computed."""
    prefill = 0
    for _ in range(limit):
        if not sched.has_unfinished_requests():
            return prefill
        out = sched.schedule()
        prefill += out.num_prefill_tokens
        sched.update_from_output(out, [5] * out.num_sampled)
        assert sched.block_manager.consistent()
    raise AssertionError("the requests did not finish")


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_call_of_n_sequences_computes_its_prompt_once(prefix_caching):
    sched = make_scheduler(prefix_caching=prefix_caching, block_size=4)
    reqs = siblings(30, 4)
    sched.add_requests(reqs)
    prefill = run(sched)
    assert all(r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 4 for r in reqs)
    # the leader's 30, then each follower recomputes only the prompt's last partial block (2 tokens)
    assert prefill == 30 + 3 * 2
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_siblings_wait_for_the_leaders_prompt_across_chunks():
    sched = make_scheduler(token_budget=16, chunk_size=8, block_size=4)
    reqs = siblings(32, 3)
    sched.add_requests(reqs)
    out = sched.schedule()
    assert [row.request for row in out.rows] == [reqs[0]]  # the budget would fit a follower: it waits
    sched.update_from_output(out, [5] * out.num_sampled)
    assert run(sched) == 24 + 2 * 4  # 32 % 4 == 0: each follower recomputes the last block


def test_preempting_a_sibling_leaves_the_others_intact():
    # 12 blocks of 4: the prompt's 5 blocks are shared, each sequence grows its own 4 beyond it
    sched = make_scheduler(num_blocks=14, block_size=4, token_budget=64, chunk_size=64, prefix_caching=False)
    reqs = siblings(20, 4, max_tokens=14)
    sched.add_requests(reqs)
    run(sched)
    assert sched.stats.num_preemptions > 0
    assert all(r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 14 for r in reqs)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_aborting_every_sequence_frees_every_block_at_once():
    sched = make_scheduler(block_size=4, prefix_caching=False)
    reqs = siblings(30, 4, max_tokens=50)
    sched.add_requests(reqs)
    for _ in range(3):  # the leader's prompt, then two followers of four started (the rest wait)
        out = sched.schedule()
        sched.update_from_output(out, [5] * out.num_sampled)
    assert sched.block_manager.num_free_blocks < sched.block_manager.num_blocks
    for r in reqs:
        sched.abort_request(r.request_id)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    assert sched.block_manager.consistent() and not sched.has_unfinished_requests()


def test_followers_of_a_leader_aborted_before_its_prompt_prefill_on_their_own():
    sched = make_scheduler(token_budget=8, chunk_size=8, block_size=4, prefix_caching=False)
    reqs = siblings(20, 3)
    sched.add_requests(reqs)
    sched.update_from_output(sched.schedule(), [])
    sched.abort_request(reqs[0].request_id)
    run(sched)
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs[1:])


def test_admission_counts_every_sequence_and_refuses_the_call_whole():
    sched = make_scheduler(queue_depth=6)
    sched.add_requests(siblings(10, 4))
    with pytest.raises(AdmissionError) as exc:
        sched.add_requests(siblings(10, 3))  # 4 + 3 > 6: none of the three is queued
    assert exc.value.status == 429 and sched.num_waiting == 4
    with pytest.raises(AdmissionError) as exc:
        sched.add_requests(siblings(10, 7))  # could never fit
    assert exc.value.status == 400 and "n:" in str(exc.value)


def test_choice_seeds_are_distinct_reproducible_and_keep_choice_zero():
    seeds = [choice_seed(1234, i) for i in range(MAX_N)]
    assert seeds[0] == 1234 and len(set(seeds)) == MAX_N
    assert seeds == [choice_seed(1234, i) for i in range(MAX_N)]
    assert all(-(2**63) <= s < 2**63 for s in seeds)
    unseeded = SamplingParams(seed=None)
    assert choice_sampling(unseeded, 3).seed is None  # the engine draws one per sequence
    assert choice_sampling(SamplingParams(seed=-1), 2).seed == choice_seed(-1, 2)


# -- through the engine, with the tiny model -------------------------------------------------------


def generate_choices(engine: Engine, prompt: list[int], sp: SamplingParams, n: int) -> tuple[list[list[int]], int]:
    """Run one call of ``n`` choices to the end: each choice's tokens, and the prefill tokens computed."""
    before = engine.scheduler.stats.prefill_tokens_admitted
    engine.add_request("call", prompt, sp, n=n)
    tokens: dict[str, list[int]] = {choice_request_id("call", i): [] for i in range(n)}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
    return list(tokens.values()), engine.scheduler.stats.prefill_tokens_admitted - before


@pytest.mark.slow
def test_n_seeded_choices_survive_preemption_and_chunked_prefill(tiny_llama_dir):
    prompt = [(7 * i) % 300 + 3 for i in range(37)]
    sp = SamplingParams(max_tokens=24, temperature=1.0, seed=11, ignore_eos=True)
    knobs = dict(max_model_len=64, block_size=4, chunk_size=8)
    roomy, prefill = generate_choices(Engine.from_model(tiny_llama_dir, token_budget=64, **knobs), prompt, sp, 4)
    assert prefill <= len(prompt) + 4 * 4  # the prompt once, then at most a block per follower
    assert all(len(t) == 24 for t in roomy) and len({tuple(t) for t in roomy}) == 4  # distinct seed streams
    # 10 blocks of the prompt shared, 6 more each to finish: 34 > 24 blocks, so some give way
    tight = Engine.from_model(tiny_llama_dir, token_budget=12, num_kv_blocks=24, **knobs)
    assert generate_choices(tight, prompt, sp, 4)[0] == roomy
    assert tight.scheduler.stats.num_preemptions > 0
    assert tight.block_manager.num_free_blocks == tight.block_manager.num_blocks
