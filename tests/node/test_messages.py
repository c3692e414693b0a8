"""The engine core's messages and their codec: every type survives msgpack, nothing else gets in."""

from __future__ import annotations

import msgpack
import pytest

from cadenza.node.core.codec import MESSAGE_TYPES, decode, encode, frame
from cadenza.node.core.messages import (
    AbortRequests,
    AddRequest,
    EngineDead,
    EngineReady,
    KVEndpoint,
    MessageError,
    Reconfigure,
    ReconfigureResult,
    RequestDelta,
    RequestFailure,
    RequestsQueued,
    Shutdown,
    StartCore,
    StepOutputs,
    StepRecord,
)
from cadenza.node.core.request import RemoteKV, SamplingParams
from cadenza.node.core.stats import ClassStats, EngineStats, TenantLoad

SAMPLING = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=3, seed=-5, stop=("\n\n", "END"),
                          stop_token_ids=(9, 2), ignore_eos=True)
STATS = EngineStats(num_running=2, kv_blocks_total=64, rejected={"queue_full": 3}, cost_model_error=0.12,
                    classes={"batch": ClassStats(1, 2, 128, 0.5, 900, 1, 3.25)},
                    tenants={"acme": TenantLoad(2, 300)}, step_time_ms_p99=41.5)
EXAMPLES = [
    AddRequest("cmpl-1", [1, 2, 3], SAMPLING, "batch", "acme", 12.5, "salt", "00-" + "a" * 32 + "-" + "b" * 16 + "-01"),
    AddRequest("cmpl-4", [1] * 40, SAMPLING, remote_kv=RemoteKV("10.1.2.3", 7100, "cmpl-9", "f" * 32, 32)),
    AddRequest("cmpl-9", [1] * 40, SAMPLING, publish_kv=True, acknowledge=True),
    AddRequest("cmpl-5", [7, 8, 9], SAMPLING, n=4),  # a call of four sequences, one prefill
    RequestsQueued(["cmpl-9", "cmpl-10"]),
    RemoteKV("10.1.2.3", 7100, "cmpl-9", "f" * 32, 32),
    AbortRequests(["a", "b"], "stop"),
    Reconfigure(4, {"token_budget": 64, "classes": {"batch": {"min_share": 0.2}}, "chunk_size": None}),
    StartCore({"model": "/m", "scheduler": {"token_budget": 8}}, [2, 7], 2, "--threads"),
    Shutdown(),
    SAMPLING,
    EngineReady(2048, 49152, [2], 640, 16, {"token_budget": 512}),
    EngineReady(2048, 49152, [2], 640, 16, {"token_budget": 512}, KVEndpoint("10.1.2.3", 7100, "f" * 32)),
    KVEndpoint("10.1.2.3", 7100, "f" * 32),
    EngineDead("no such folder", loaded=False, kind="FileNotFoundError"),
    ReconfigureResult(4, error="token_budget: must be >= 1", error_kind="invalid"),
    RequestDelta("cmpl-1", [42], "length", 3, 7, 16),
    RequestFailure("cmpl-2", "admission", "queue full", 429, "queue_full", 3),
    StepRecord(0.031, 0.029, 256, 12, [("cmpl-1", "batch", "admission", 0.25)], [("cmpl-1", 0, 256)], [("x", 2)],
               [("cmpl-1", 240, 16)], 4096, 512.0, 13, 12, 0.0004),
    StepOutputs(99.5, [RequestDelta("cmpl-1", [42], None, 3, 1)], StepRecord(0.01, None, 0, 1), STATS,
                [RequestFailure("cmpl-3", "step", "boom")]),
    StepOutputs(99.5, [RequestDelta("cmpl-5", [42], None, 3, 1, 0, [[-0.25, [[42, -0.25], [7, -1.5]]]])]),
    RequestDelta("cmpl-5", [42], None, 3, 1, 0, [[-0.25, []]]),
    SamplingParams(max_tokens=3, logprobs=20),
    STATS,
    ClassStats(),
    TenantLoad(1, 2),
]


def test_the_examples_cover_every_message_type():
    assert {type(m) for m in EXAMPLES} == set(MESSAGE_TYPES)


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_type_round_trips_through_msgpack(message):
    assert decode(encode(message)) == message


def test_a_frame_is_its_length_then_the_message():
    data = frame(Shutdown())
    assert int.from_bytes(data[:4], "big") == len(data) - 4 and decode(data[4:]) == Shutdown()


def test_an_unknown_tag_is_refused():
    with pytest.raises(MessageError, match="unknown message tag 99"):
        decode(msgpack.packb(msgpack.ExtType(99, msgpack.packb([1]))))


@pytest.mark.parametrize("data", [
    b"\xc1",  # never used in msgpack
    msgpack.packb([1, 2, 3]),  # plain data, not a message
    msgpack.packb(msgpack.ExtType(2, msgpack.packb([["a"], "stop", "extra", "fields"]))),  # wrong arity
    msgpack.packb(msgpack.ExtType(2, msgpack.packb([["a"], "explode"]))),  # a reason that is not one
    msgpack.packb(msgpack.ExtType(2, msgpack.packb({"request_ids": ["a"]}))),  # not a field list
    encode(Shutdown()) + b"\x00",  # trailing bytes
], ids=["invalid-byte", "not-a-message", "bad-arity", "bad-value", "a-map", "trailing"])
def test_a_bad_frame_is_a_message_error_not_a_crash(data):
    with pytest.raises(MessageError):
        decode(data)


def test_only_message_types_can_be_encoded():
    with pytest.raises(TypeError):
        encode({"not": "a message"})
    with pytest.raises(TypeError):
        encode(AbortRequests([object()]))  # type: ignore[list-item]
