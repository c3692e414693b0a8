"""Disaggregated serving, engine to engine: a prefill engine publishes a prompt's KV, a decode
engine pulls it over loopback TCP and generates — and its greedy output equals a colocated
engine's, token for token, whatever the prompt length, chunk size and prefix caching, with every
pull complete well within the lease (a short one here: a pull that stalls fails fast).

Three engine cores in this process on the tiny random Llama (fp32): the prefill one and the
decode one each with a KV transfer endpoint, and a plain one for the colocated reference. A
fourth, of the same shape and served name but other weights, shows that KV never crosses models.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import random
import time

import pytest

from cadenza.node.core.config import ConfigError
from cadenza.node.engine.engine_core import EngineCore
from cadenza.node.engine.kv_link import HOLDER
from cadenza.node.core.messages import AddRequest
from cadenza.node.core.request import RemoteKV, SamplingParams
from cadenza.node.credentials import TOKEN_ENV, TOKEN_FILE_ENV
from tiny_models import build_tiny_model

BS = 16
def test_kv_pulled_into_a_replica_that_replays_step_graphs_decodes_as_colocated(tiny_llama_dir):
    """Pulled blocks are written into the KV cache between steps; the decode side's steps run
    through the fixed, padded buffers of its step graphs (recorded eagerly on the CPU)."""
    with engines(tiny_llama_dir, 16, False) as (prefill, decode, colocated):
        decode.runner.capture_graphs(decode.config.scheduler, record="eager")
        taken, replay = [], decode.runner.graphs.run
        decode.runner.graphs.run = lambda rows: taken.append(replay(rows)) or taken[-1]
        for n in (17, 65, 129):
            prompt = [random.Random(n).randrange(3, 300) for _ in range(n)]
            want = run(colocated, AddRequest(f"c{next(_ids)}", prompt, greedy(6)))
            assert disaggregated(prefill, decode, prompt) == want, f"prompt of {n} tokens"
        assert decode.scheduler.stats.remote_kv_tokens == 16 + 64 + 128
        assert sum(t is not None for t in taken) >= 3 * 5  # the decodes after each pull replayed a graph


# 25 and 217 end in a one-token chunk with chunks of 24 (its last token a decode row) in a block
# the decode side needs; 17 and 65 do so too with chunks of 16 and 64, in a block it does not
LENGTHS = (1, 2, 15, 16, 17, 25, 31, 33, 64, 65, 100, 127, 128, 129, 200, 217, 255, 257, 300)
LEASE_S = 5.0  # a pull that waits for a block never sent fails with this, not after 30 s
_ids = itertools.count()


@pytest.fixture(autouse=True)
def pool_token(monkeypatch):
    """The pool's token, which every KV transfer endpoint needs (both engines read it here)."""
    monkeypatch.setenv(TOKEN_ENV, "pool-token")


@pytest.fixture(scope="module")
def other_weights_dir(tmp_path_factory):
    """The tiny Llama's twin: same shapes, same tokenizer, other weights (seed 1)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-seed-1"), seed=1)


@contextlib.contextmanager
def engines(model, chunk_size, prefix_caching, token_budget=64, num_kv_blocks=160, lease_s=LEASE_S, **more):
    """(prefill, decode, colocated) engine cores; the two with endpoints are closed after."""
    knobs = dict(token_budget=token_budget, chunk_size=chunk_size, max_model_len=512, num_kv_blocks=num_kv_blocks,
                 block_size=BS, prefix_caching=prefix_caching, attention_backend="torch", **more)
    prefill = EngineCore.from_model(model, kv_transfer_port=0, kv_lease_s=lease_s, **knobs)
    decode = EngineCore.from_model(model, kv_transfer_port=0, kv_lease_s=lease_s, **knobs)
    try:
        yield prefill, decode, EngineCore.from_model(model, **knobs)
    finally:
        prefill.close()
        decode.close()


def run(core: EngineCore, add: AddRequest, timeout_s: float = 60.0) -> list[int]:
    core.add_request(add)
    tokens: list[int] = []
    deadline = time.monotonic() + timeout_s
    while core.has_unfinished_requests():
        assert time.monotonic() < deadline, "the request never finished"
        deltas, record = core.step()
        if record is None:
            time.sleep(0.001)  # waiting for remote KV: no step ran
        for d in deltas:
            tokens += d.new_token_ids
    return tokens


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def disaggregated(prefill: EngineCore, decode: EngineCore, prompt: list[int], max_tokens: int = 6,
                  source: RemoteKV | None = None) -> list[int]:
    """The prompt prefilled on ``prefill`` (one token, KV published), then generated on ``decode``."""
    rid = f"d{next(_ids)}"
    run(prefill, AddRequest(rid, prompt, greedy(1), publish_kv=True))
    link = prefill.kv_link
    source = source or RemoteKV("127.0.0.1", link.port, rid, link.boot_id, len(prompt))
    return run(decode, AddRequest(rid, prompt, greedy(max_tokens), remote_kv=source))


def settle(core: EngineCore, timeout_s: float = 5.0) -> None:
    """Poll until the KV transfer has nothing in flight (released leases freed)."""
    deadline = time.monotonic() + timeout_s
    while core.poll() and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.parametrize("chunk_size, prefix_caching", [(16, True), (16, False), (24, False), (64, True), (64, False),
                                                         (None, True), (None, False)])
def test_greedy_output_of_a_disaggregated_pair_equals_colocated(tiny_llama_dir, chunk_size, prefix_caching):
    with engines(tiny_llama_dir, chunk_size, prefix_caching) as (prefill, decode, colocated):
        rng = random.Random(chunk_size or 0)
        loaded = 0
        for n in LENGTHS:
            prompt = [rng.randrange(3, 300) for _ in range(n)]
            want = run(colocated, AddRequest(f"c{next(_ids)}", prompt, greedy(6)))
            assert disaggregated(prefill, decode, prompt) == want, f"prompt of {n} tokens"
            loaded += n - 1
        assert decode.scheduler.stats.remote_kv_tokens == loaded  # every prompt token's KV but the last came over
        assert decode.scheduler.stats.remote_kv_failed_loads == 0
        assert prefill.kv_link.producer.stats.expired == 0
        settle(prefill)
        assert prefill.block_manager.num_used_blocks == 0  # every lease released, every block freed
        assert not any(k.startswith(HOLDER) for k in prefill.block_manager.tables)


def test_a_prompt_whose_last_chunk_is_one_token_is_pulled_at_once(tiny_llama_dir):
    """Budget and chunk 24: 217 tokens are nine chunks of 24 and one token, which the prefill
    replica computes as a decode row; that step completes the prompt and its partial last block
    (tokens 208-216) goes out with it, so the pull ends without waiting out a lease."""
    with engines(tiny_llama_dir, 24, False, token_budget=24) as (prefill, decode, colocated):
        for n in (216, 217):
            prompt = [random.Random(n).randrange(3, 300) for _ in range(n)]
            want = run(colocated, AddRequest(f"c{next(_ids)}", prompt, greedy(4)))
            began = time.monotonic()
            assert disaggregated(prefill, decode, prompt, 4) == want, f"prompt of {n} tokens"
            assert time.monotonic() - began < LEASE_S / 2, f"prompt of {n} tokens"
        assert decode.scheduler.stats.remote_kv_tokens == 215 + 216  # every token but the last came over
        assert decode.scheduler.stats.remote_kv_failed_loads == 0 and not decode.kv_link.stats.failures
        assert prefill.kv_link.producer.stats.expired == 0


def test_concurrent_prompts_split_by_a_shared_budget_are_all_pulled_whole(tiny_llama_dir):
    """24 prompts prefilled at once (budget 64, chunks of 16) while the decode replica pulls them:
    whichever chunk a shared budget leaves a prompt with, one token included, every prompt's KV
    arrives whole, no lease expires, and every answer equals the colocated one."""
    pick, rng = random.Random(8), random.Random(24)
    lengths = [pick.randrange(40, 200) for _ in range(24)]
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in lengths]
    with engines(tiny_llama_dir, 16, False, num_kv_blocks=640) as (prefill, decode, colocated):
        want = [run(colocated, AddRequest(f"c{next(_ids)}", p, greedy(3))) for p in prompts]
        link, ids = prefill.kv_link, [f"d{next(_ids)}" for _ in prompts]
        for rid, prompt in zip(ids, prompts):
            prefill.add_request(AddRequest(rid, prompt, greedy(1), publish_kv=True))
            source = RemoteKV("127.0.0.1", link.port, rid, link.boot_id, len(prompt))
            decode.add_request(AddRequest(rid, prompt, greedy(3), remote_kv=source))
        _, got = run_together(prefill, decode)
        assert [got[rid] for rid in ids] == want
        # the case arose: prompts whose last token was not in a chunk but a decode row
        assert sum(lengths) - prefill.scheduler.stats.prefill_tokens_admitted >= 2
        assert decode.scheduler.stats.remote_kv_tokens == sum(len(p) - 1 for p in prompts)
        assert decode.scheduler.stats.remote_kv_failed_loads == 0 and not decode.kv_link.stats.failures
        assert link.producer.stats.expired == 0


def run_together(*cores: EngineCore, timeout_s: float = 60.0) -> list[dict[str, list[int]]]:
    """Step ``cores`` in turn until none has work; per core, each request's tokens."""
    tokens: list[dict[str, list[int]]] = [{} for _ in cores]
    deadline = time.monotonic() + timeout_s
    while any(core.has_unfinished_requests() for core in cores):
        assert time.monotonic() < deadline, "the requests never finished"
        ran = False
        for core, got in zip(cores, tokens):
            if core.has_unfinished_requests():
                deltas, record = core.step()
                ran |= record is not None
                for d in deltas:
                    got.setdefault(d.request_id, []).extend(d.new_token_ids)
        if not ran:
            time.sleep(0.001)
    return tokens


def queue_behind_a_long_request(decode: EngineCore, add: AddRequest, seconds: float) -> None:
    """Add a long local request, then ``add``, to a decode engine with one running slot, and
    step it for ``seconds``: ``add`` waits in the queue all along; the long one is then aborted."""
    decode.add_request(AddRequest("long", list(range(3, 23)), greedy(480)))
    decode.add_request(add)
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        decode.step()
        time.sleep(0.02)
    assert decode.scheduler.requests[add.request_id].admitted_time is None  # it queued the whole time
    decode.abort_request("long")


def test_a_request_queued_longer_than_the_lease_keeps_its_source_and_pulls_it_whole(tiny_llama_dir):
    """A decode replica whose one slot is busy holds a moved request queued for three leases: it
    renews the source's lease meanwhile, so the KV is still there when the request runs."""
    with engines(tiny_llama_dir, 64, False, lease_s=1.0, max_num_seqs=1) as (prefill, decode, colocated):
        prompt = [random.Random(5).randrange(3, 300) for _ in range(100)]
        want = run(colocated, AddRequest("c-queued", prompt, greedy(4)))
        run(prefill, AddRequest("queued", prompt, greedy(1), publish_kv=True))
        source = RemoteKV("127.0.0.1", prefill.kv_link.port, "queued", prefill.kv_link.boot_id, len(prompt))
        queue_behind_a_long_request(decode, AddRequest("queued", prompt, greedy(4), remote_kv=source), 3.0)
        (got,) = run_together(decode)
        assert got["queued"] == want
        assert decode.scheduler.stats.remote_kv_tokens == 99 and decode.scheduler.stats.remote_kv_failed_loads == 0
        assert prefill.kv_link.producer.stats.expired == 0
        settle(prefill)
        assert prefill.block_manager.num_used_blocks == 0  # released once pulled


def test_past_its_maximum_hold_a_queued_request_releases_its_source_and_computes_the_prompt_itself(tiny_llama_dir):
    """The hold is bounded: after ``kv_max_hold_s`` in the queue the decode replica releases the
    source, whose blocks are freed at once (not at the lease's end), and prefills the prompt itself."""
    with engines(tiny_llama_dir, 64, False, lease_s=2.0, max_num_seqs=1, kv_max_hold_s=0.5) as (
            prefill, decode, colocated):
        prompt = [random.Random(6).randrange(3, 300) for _ in range(100)]
        want = run(colocated, AddRequest("c-held", prompt, greedy(4)))
        run(prefill, AddRequest("held", prompt, greedy(1), publish_kv=True))
        assert any(k.startswith(HOLDER) for k in prefill.block_manager.tables)
        source = RemoteKV("127.0.0.1", prefill.kv_link.port, "held", prefill.kv_link.boot_id, len(prompt))
        queue_behind_a_long_request(decode, AddRequest("held", prompt, greedy(4), remote_kv=source), 1.5)
        settle(prefill, timeout_s=0.5)  # well before the 2 s lease could have ended
        assert prefill.block_manager.num_used_blocks == 0 and prefill.kv_link.producer.stats.expired == 0
        (got,) = run_together(decode)
        assert got["held"] == want
        s = decode.scheduler.stats
        assert s.remote_kv_released_holds == 1 and s.remote_kv_loads == 0 and s.remote_kv_failed_loads == 0
        assert decode.stats().remote_kv_released_holds == 1


def test_a_prefix_cached_on_the_decode_side_is_not_pulled_again(tiny_llama_dir):
    with engines(tiny_llama_dir, 64, True) as (prefill, decode, colocated):
        prompt = [random.Random(7).randrange(3, 300) for _ in range(100)]
        want = run(colocated, AddRequest("c-shared", prompt, greedy(4)))
        assert disaggregated(prefill, decode, prompt, 4) == want
        first = decode.scheduler.stats.remote_kv_tokens
        assert disaggregated(prefill, decode, prompt, 4) == want
        assert first == 99 and decode.scheduler.stats.remote_kv_tokens == first + 3  # the second: 6 blocks hit the cache


def test_a_failed_transfer_is_recomputed_locally_with_the_same_output(tiny_llama_dir):
    with engines(tiny_llama_dir, 16, False, lease_s=30.0) as (prefill, decode, colocated):
        prompt = [random.Random(3).randrange(3, 300) for _ in range(90)]
        want = run(colocated, AddRequest("c-failed", prompt, greedy(5)))
        link = prefill.kv_link
        restarted = RemoteKV("127.0.0.1", link.port, "whatever", "an-older-boot-id", len(prompt))
        assert disaggregated(prefill, decode, prompt, 5, source=restarted) == want
        nobody = RemoteKV("127.0.0.1", link.port, "never-published", link.boot_id, len(prompt))
        assert disaggregated(prefill, decode, prompt, 5, source=nobody) == want
        s = decode.scheduler.stats
        assert s.remote_kv_failed_loads == 2 and s.remote_kv_recomputed_tokens == 2 * 89 and s.remote_kv_tokens == 0
        assert dict(decode.kv_link.stats.failures) == {"restarted": 1, "unknown_request": 1}
        settle(prefill, timeout_s=0.5)  # the two real publications are still leased (nobody pulled them)
        assert len([k for k in prefill.block_manager.tables if k.startswith(HOLDER)]) == 2
        prefill.abort_request("d-never")  # aborting an unknown id is harmless


def test_an_engine_without_an_endpoint_refuses_to_publish_and_computes_remote_prompts_itself(tiny_llama_dir):
    plain = EngineCore.from_model(tiny_llama_dir, max_model_len=256, attention_backend="torch")
    with pytest.raises(ValueError, match="kv_transfer_port"):
        plain.add_request(AddRequest("p", [5, 6, 7], greedy(1), publish_kv=True))
    prompt = list(range(3, 60))
    source = RemoteKV("127.0.0.1", 9, "x", "y", len(prompt))
    assert run(plain, AddRequest("a", prompt, greedy(3), remote_kv=source)) == run(
        plain, AddRequest("b", prompt, greedy(3)))


def test_an_engine_without_an_endpoint_reports_its_threshold_once_calibrated(tiny_llama_dir):
    """A colocated replica of an auto pool has no KV link, yet the controller reads its selective
    threshold to know what a prefill replica would take: over the assumed link, from its own model."""
    from cadenza.node.core import disagg_rule
    from cadenza.node.core.cost_model import StepFeatures
    from cadenza.node.engine.kv_link import ASSUMED_LINK_BYTES_PER_S

    plain = EngineCore.from_model(tiny_llama_dir, max_model_len=256, attention_backend="torch")
    assert plain.kv_link is None and plain.stats().kv_transfer_min_prompt_tokens is None  # not calibrated
    cost = plain.scheduler.cost_model
    for i in range(16):  # 2 ms a step, 20 us a prefill token, 10 ns a prefill attention pair
        n, decode = 16 * (i % 5 + 1), i % 3
        cost.observe(StepFeatures(n, decode, 100 * decode, n * n / 2), 0.002 + 2e-5 * n + 1e-8 * n * n / 2)
    stats = plain.stats()
    kv_bytes = plain.model_config.kv_bytes_per_token(4)  # fp32
    expected = disagg_rule.rule(cost, kv_bytes, ASSUMED_LINK_BYTES_PER_S).min_prompt_tokens()
    assert stats.kv_transfer_min_prompt_tokens == expected and expected > 1
    assert stats.kv_transfer_rule is None  # no endpoint: the gateway is sent no rule to move prompts by


def test_kv_of_other_weights_is_refused_before_any_block_moves_and_never_cached(tiny_llama_dir, other_weights_dir,
                                                                               caplog):
    """A model-revision rollout keeps the served name and the shapes: the weights must still differ.
    The decode replica says why it computes the prompt itself (it logged nothing: a mismatched
    rollout showed only as quiet recomputation)."""
    knobs = dict(token_budget=64, chunk_size=64, max_model_len=512, num_kv_blocks=160, block_size=BS,
                 prefix_caching=True, attention_backend="torch", served_model_name="tiny")
    foreign = EngineCore.from_model(other_weights_dir, kv_transfer_port=0, **knobs)
    decode = EngineCore.from_model(tiny_llama_dir, kv_transfer_port=0, **knobs)
    colocated = EngineCore.from_model(tiny_llama_dir, **knobs)
    try:
        prompt = [random.Random(11).randrange(3, 300) for _ in range(120)]
        want = run(colocated, AddRequest("c-foreign", prompt, greedy(6)))
        assert run(foreign, AddRequest("f-ref", prompt, greedy(6))) != want  # the weights do differ
        with caplog.at_level(logging.WARNING, logger="cadenza.node.engine.kv_link"):
            assert disaggregated(foreign, decode, prompt) == want  # refused, then computed here
        assert any("(incompatible)" in r.getMessage() and "weights" in r.getMessage() for r in caplog.records)
        s = decode.scheduler.stats
        assert s.remote_kv_tokens == 0 and s.remote_kv_failed_loads == 1 and s.remote_kv_recomputed_tokens == 119
        assert dict(decode.kv_link.stats.failures) == {"incompatible": 1}
        assert foreign.kv_link.producer.stats.blocks_sent == 0
        longer = prompt + [7, 8, 9, 10]  # an ordinary request sharing the prefix: a cache hit of this model's KV
        assert run(decode, AddRequest("later", longer, greedy(6))) == run(colocated, AddRequest("c-later", longer,
                                                                                               greedy(6)))
        assert decode.scheduler.stats.prefix_cache_hit_tokens >= 112
    finally:
        foreign.close()
        decode.close()


@pytest.mark.slow
def test_tensor_parallel_replicas_move_every_ranks_kv_heads_and_decode_as_colocated(tiny_llama_dir):
    """Size-2 prefill and decode replicas (each rank holds one of the two KV heads): rank 0 gathers
    its workers' heads into the payload and each decode rank takes its own — the output equals a
    colocated size-1 engine's. A size-1 decode replica refuses the size-2 replica's KV by its
    fingerprint, says why, and computes the prompt itself."""
    with engines(tiny_llama_dir, 16, True, tensor_parallel_size=2) as (prefill, decode, colocated):
        plain = EngineCore.from_model(tiny_llama_dir, kv_transfer_port=0, kv_lease_s=LEASE_S, token_budget=64,
                                      chunk_size=16, max_model_len=512, num_kv_blocks=160, block_size=BS,
                                      attention_backend="torch")
        try:
            for n in (17, 65, 129):
                prompt = [random.Random(n).randrange(3, 300) for _ in range(n)]
                want = run(plain, AddRequest(f"c{next(_ids)}", prompt, greedy(6)))  # size 1, colocated
                assert disaggregated(prefill, decode, prompt) == want, f"prompt of {n} tokens"
                assert run(colocated, AddRequest(f"c{next(_ids)}", prompt, greedy(6))) == want  # size 2
            assert decode.scheduler.stats.remote_kv_tokens == 16 + 64 + 128
            prompt = [random.Random(5).randrange(3, 300) for _ in range(40)]
            want = run(plain, AddRequest("c-tp", prompt, greedy(6)))
            assert disaggregated(prefill, plain, prompt) == want  # refused, then computed here
            assert dict(plain.kv_link.stats.failures) == {"incompatible": 1}
        finally:
            plain.close()


def test_a_kv_transfer_endpoint_without_the_pools_token_does_not_start(tiny_llama_dir, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV)
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)
    with pytest.raises(ConfigError, match=TOKEN_ENV):
        EngineCore.from_model(tiny_llama_dir, kv_transfer_port=0, attention_backend="torch")
