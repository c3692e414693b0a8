"""The engine core's messages on the wire: msgpack, each object an extension of its type's tag.

Every type of :mod:`cadenza.node.core.messages` (and the request and stats types they carry) has
a tag; :func:`encode` writes a message as msgpack with each object an extension of its tag, and
:func:`decode` builds only those types back (no pickle: a frame can only ever build these types).
A frame with an unknown tag, or fields that do not fit its type, is refused with
:class:`~cadenza.node.core.messages.MessageError`. On a socket each message is a frame: a 4-byte
big-endian length, then the msgpack bytes (:func:`frame`). No torch here.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import msgpack

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
from cadenza.node.core.request import RemoteKV, SamplingParams, StructuredOutput
from cadenza.node.core.stats import ClassStats, EngineStats, TenantLoad

FRAME_HEADER = struct.Struct(">I")  # each frame: payload length (bytes, big-endian), then msgpack
MAX_FRAME_BYTES = 256 * 2**20


def _sampling_to_wire(sp: SamplingParams) -> list:
    return [sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.seed, list(sp.stop),
            sorted(sp.stop_token_ids), sp.ignore_eos, sp.logprobs,
            None if sp.structured is None else [sp.structured.kind, sp.structured.spec]]


def _sampling_from_wire(v: list) -> SamplingParams:
    max_tokens, temperature, top_p, top_k, seed, stop, stop_ids, ignore_eos, logprobs, structured = v
    return SamplingParams(max_tokens, temperature, top_p, top_k, seed, tuple(stop), frozenset(stop_ids), ignore_eos,
                          logprobs, None if structured is None else StructuredOutput(*structured))


def _fields_to_wire(obj: Any) -> list:
    return [getattr(obj, f) for f in obj.__slots__]


def _step_outputs_to_wire(out: StepOutputs) -> list:
    # the hot message (one per step, hundreds of deltas): deltas go inline as field lists, not as
    # an extension each, which would cost a nested packb call per delta
    return [out.time, [[d.request_id, d.new_token_ids, d.finish_reason, d.num_prompt_tokens, d.num_output_tokens,
                        d.num_cached_tokens, d.logprobs] for d in out.outputs], out.step, out.stats, out.failures]


def _step_outputs_from_wire(v: list) -> StepOutputs:
    time_, deltas, step, stats, failures = v
    return StepOutputs(time_, [RequestDelta(*d) for d in deltas], step, stats, failures)


def _plain(cls: type) -> Callable[[list], Any]:
    return lambda v: cls(*v)


def _with_tuples(cls: type, *indexes: int) -> Callable[[list], Any]:  # list fields at indexes: lists of tuples
    def build(v: list) -> Any:
        for i in indexes:
            v[i] = [tuple(x) for x in v[i]]
        return cls(*v)
    return build


# tag -> (type, to wire, from wire); tags are part of the protocol: never reuse one.
_TYPES: dict[int, tuple[type, Callable[[Any], list], Callable[[list], Any]]] = {
    1: (AddRequest, _fields_to_wire, _plain(AddRequest)),
    2: (AbortRequests, _fields_to_wire, _plain(AbortRequests)),
    3: (Reconfigure, _fields_to_wire, _plain(Reconfigure)),
    4: (Shutdown, _fields_to_wire, _plain(Shutdown)),
    6: (StartCore, _fields_to_wire, _plain(StartCore)),
    7: (RemoteKV, _fields_to_wire, _plain(RemoteKV)),
    5: (SamplingParams, _sampling_to_wire, _sampling_from_wire),
    10: (EngineReady, _fields_to_wire, _plain(EngineReady)),
    11: (EngineDead, _fields_to_wire, _plain(EngineDead)),
    12: (ReconfigureResult, _fields_to_wire, _plain(ReconfigureResult)),
    13: (RequestDelta, _fields_to_wire, _plain(RequestDelta)),
    14: (RequestFailure, _fields_to_wire, _plain(RequestFailure)),
    15: (StepRecord, _fields_to_wire, _with_tuples(StepRecord, 4, 5, 6, 7)),
    16: (StepOutputs, _step_outputs_to_wire, _step_outputs_from_wire),
    17: (EngineStats, _fields_to_wire, _plain(EngineStats)),
    18: (ClassStats, _fields_to_wire, _plain(ClassStats)),
    19: (TenantLoad, _fields_to_wire, _plain(TenantLoad)),
    20: (KVEndpoint, _fields_to_wire, _plain(KVEndpoint)),
    21: (RequestsQueued, _fields_to_wire, _plain(RequestsQueued)),
}
_TAG_OF = {cls: tag for tag, (cls, _enc, _dec) in _TYPES.items()}
MESSAGE_TYPES = tuple(cls for cls, _enc, _dec in _TYPES.values())


def _default(obj: Any) -> msgpack.ExtType:
    tag = _TAG_OF.get(type(obj))
    if tag is None:
        if isinstance(obj, int):  # msgpack hands over the integers it cannot carry
            raise TypeError(f"the integer {obj} does not fit 64 bits")
        raise TypeError(f"cannot encode {type(obj).__name__}: not an engine message type")
    return msgpack.ExtType(tag, msgpack.packb(_TYPES[tag][1](obj), default=_default, use_bin_type=True))


def _ext_hook(tag: int, data: bytes) -> Any:
    entry = _TYPES.get(tag)
    if entry is None:
        raise MessageError(f"unknown message tag {tag}")
    values = msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    if not isinstance(values, list):
        raise MessageError(f"bad frame: tag {tag} holds a {type(values).__name__}, not its fields")
    return entry[2](values)


def encode(message: Any) -> bytes:
    """One message as msgpack bytes (without the frame header); TypeError if it is not one of
    :data:`MESSAGE_TYPES` (or holds something that is not)."""
    if type(message) not in _TAG_OF:
        raise TypeError(f"cannot encode {type(message).__name__}: not an engine message type")
    return msgpack.packb(message, default=_default, use_bin_type=True)


def decode(data: bytes) -> Any:
    """The message ``data`` holds.

    Raises:
        MessageError: not msgpack, an unknown tag, fields that do not fit the type, or a frame
            whose top level is not a message.
    """
    try:
        message = msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    except MessageError:
        raise
    except (ValueError, TypeError, msgpack.UnpackException) as exc:  # ExtraData, bad arity, bad values
        raise MessageError(f"bad frame: {type(exc).__name__}: {exc}") from None
    if type(message) not in _TAG_OF:
        raise MessageError(f"bad frame: a {type(message).__name__}, not a message")
    return message


def frame(message: Any) -> bytes:
    """``message`` encoded, with its length header: what goes on the socket."""
    return FRAME_HEADER.pack(len(body := encode(message))) + body


def check_frame_length(length: int) -> int:
    """The payload length a header announced, or MessageError if no real frame is that large."""
    if length > MAX_FRAME_BYTES:
        raise MessageError(f"frame of {length} bytes announced, over the {MAX_FRAME_BYTES}-byte limit")
    return length
