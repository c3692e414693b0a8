"""Disaggregated serving, engine to engine: a prefill engine publishes a prompt's KV, a decode
engine pulls it over loopback TCP and generates — and its greedy output equals a colocated
engine's, token for token, whatever the prompt length, chunk size and prefix caching.

Three engine cores in this process on the tiny random Llama (fp32): the prefill one and the
decode one each with a KV transfer endpoint, and a plain one for the colocated reference. A
fourth, of the same shape and served name but other weights, shows that KV never crosses models.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import time

import pytest

from cadenza.node.core.config import ConfigError
from cadenza.node.core.engine_core import EngineCore
from cadenza.node.core.kv_link import HOLDER
from cadenza.node.core.messages import AddRequest
from cadenza.node.core.request import RemoteKV, SamplingParams
from cadenza.node.credentials import TOKEN_ENV, TOKEN_FILE_ENV
from tiny_models import build_tiny_model

BS = 16
LENGTHS = (1, 2, 15, 16, 17, 31, 33, 64, 65, 100, 127, 128, 129, 200, 255, 257, 300)
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
def engines(model, chunk_size, prefix_caching):
    """(prefill, decode, colocated) engine cores; the two with endpoints are closed after."""
    knobs = dict(token_budget=64, chunk_size=chunk_size, max_model_len=512, num_kv_blocks=160, block_size=BS,
                 prefix_caching=prefix_caching, attention_backend="torch")
    prefill = EngineCore.from_model(model, kv_transfer_port=0, **knobs)
    decode = EngineCore.from_model(model, kv_transfer_port=0, **knobs)
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
@pytest.mark.parametrize("chunk_size", [16, 64, None])
@pytest.mark.parametrize("prefix_caching", [True, False])
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
        settle(prefill)
        assert prefill.block_manager.num_used_blocks == 0  # every lease released, every block freed
        assert not any(k.startswith(HOLDER) for k in prefill.block_manager.tables)


def test_a_prefix_cached_on_the_decode_side_is_not_pulled_again(tiny_llama_dir):
    with engines(tiny_llama_dir, 64, True) as (prefill, decode, colocated):
        prompt = [random.Random(7).randrange(3, 300) for _ in range(100)]
        want = run(colocated, AddRequest("c-shared", prompt, greedy(4)))
        assert disaggregated(prefill, decode, prompt, 4) == want
        first = decode.scheduler.stats.remote_kv_tokens
        assert disaggregated(prefill, decode, prompt, 4) == want
        assert first == 99 and decode.scheduler.stats.remote_kv_tokens == first + 3  # the second: 6 blocks hit the cache


def test_a_failed_transfer_is_recomputed_locally_with_the_same_output(tiny_llama_dir):
    with engines(tiny_llama_dir, 16, False) as (prefill, decode, colocated):
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


def test_kv_of_other_weights_is_refused_before_any_block_moves_and_never_cached(tiny_llama_dir, other_weights_dir):
    """A model-revision rollout keeps the served name and the shapes: the weights must still differ."""
    knobs = dict(token_budget=64, chunk_size=64, max_model_len=512, num_kv_blocks=160, block_size=BS,
                 prefix_caching=True, attention_backend="torch", served_model_name="tiny")
    foreign = EngineCore.from_model(other_weights_dir, kv_transfer_port=0, **knobs)
    decode = EngineCore.from_model(tiny_llama_dir, kv_transfer_port=0, **knobs)
    colocated = EngineCore.from_model(tiny_llama_dir, **knobs)
    try:
        prompt = [random.Random(11).randrange(3, 300) for _ in range(120)]
        want = run(colocated, AddRequest("c-foreign", prompt, greedy(6)))
        assert run(foreign, AddRequest("f-ref", prompt, greedy(6))) != want  # the weights do differ
        assert disaggregated(foreign, decode, prompt) == want  # refused, then computed here
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


def test_a_kv_transfer_endpoint_without_the_pools_token_does_not_start(tiny_llama_dir, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV)
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)
    with pytest.raises(ConfigError, match=TOKEN_ENV):
        EngineCore.from_model(tiny_llama_dir, kv_transfer_port=0, attention_backend="torch")
