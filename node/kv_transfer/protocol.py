"""The KV transfer wire: what a prefill replica and a decode replica say over TCP, as pure functions.

A connection carries **frames**. Every frame starts with a 4-byte big-endian length and that many
bytes of a msgpack map (the header, at most :data:`MAX_HEADER_BYTES`); a header of kind
``blocks`` is followed by ``nbytes`` raw payload bytes — KV block contents, never encoded per
element. The consumer (the decode side) opens the connection and speaks first:

=============  =========  =============================================================
kind           direction  fields
=============  =========  =============================================================
``hello``      C -> P     ``version``, ``nonce`` (:data:`NONCE_BYTES` random bytes)
``challenge``  P -> C     ``version``, ``nonce`` (the producer's), ``proof`` (it holds the token)
``auth``       C -> P     ``fingerprint`` (:class:`Fingerprint`, msgpack bytes), ``proof``
``welcome``    P -> C     ``version``, ``fingerprint`` (msgpack bytes), ``boot_id`` (the
                          producer process's), ``proof``
``refused``    P -> C     ``code`` (a :data:`ERROR_KINDS` kind), ``reason`` (the connection is
                          closed after it)
``pull``       C -> P     ``request_id``, ``first_block``, ``num_blocks`` (0: all it will hold):
                          stream that many of the request's blocks from there
``blocks``     P -> C     ``request_id``, ``first_block``, ``num_blocks``, ``first_layer``,
                          ``num_layers``, ``nbytes``, ``crc32c`` (of the payload that follows)
``pending``    P -> C     ``request_id``, ``num_blocks``: nothing new yet (the prompt waits in the
                          producer's queue or is being computed); sent when a pull has
                          had no frame for a third of the lease, so the pull's read
                          timeout measures a silent producer, not a busy one
``done``       P -> C     ``request_id``, ``num_blocks``: the pull is over; blocks up to this index
                          were sent (fewer than asked: the producer holds no more)
``error``      P -> C     ``request_id``, ``code`` (a :class:`TransferError` kind), ``message``
``release``    C -> P     ``request_id``: the consumer holds what it needs; free the blocks
``renew``      C -> P     ``request_id``: the consumer still holds the request queued (it will
                          pull it once it runs); its lease runs on from now
=============  =========  =============================================================

The first four frames are the handshake (:mod:`.handshake`): a mutual HMAC challenge-response
over the pool's token, bound to both nonces and to the fingerprint each side sends, so neither
side reveals its fingerprint to a peer that has not proved the token and no block moves before
both have. Nothing after it is encrypted or signed (no TLS): what an on-path attacker can still
do, and what keeps one off the path, is in :mod:`.handshake`.

Invariants: a consumer uses a payload only after its CRC32C matched (:func:`check_payload`); a
block's payload for ``num_layers`` layers from ``first_layer`` is ``num_layers x
Fingerprint.block_layer_bytes`` bytes, laid out layer-major; a fingerprint mismatch (the weights
included) refuses the connection before any block moves; a boot id is fixed for the life of a
producer process, so a changed one tells the consumer that every lease it held there is gone.

Sources: the vLLM KV-connector contract (remote tokens, failed blocks recomputed) and
NixlConnector's handshake (metadata check before transfer); CRC32C (Castagnoli), RFC 3720 §12.1.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import crc32c
import msgpack

PROTOCOL_VERSION = 2  # 2: the token handshake, the weights in the fingerprint
MAX_HEADER_BYTES = 64 * 2**10  # a header is a small map; more is a broken or hostile peer
MAX_PAYLOAD_BYTES = 1 << 30  # one frame's block bytes (a chunk's worth of blocks is far less)
MAX_ID_CHARS = 256  # a request id on the wire (ids are uuids or completion ids)
_LENGTH = struct.Struct("!I")

# Bytes per element of the KV cache dtypes an engine may run.
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}

# Failure kinds: each counted apart and each meaning one thing to the decode side.
ERROR_KINDS = (
    "unauthorized",  # a side did not prove it holds the pool's token (or has none): nothing else is said
    "incompatible",  # fingerprints or protocol versions differ: no block may move
    "busy",  # the producer has no connection slot (every one is streaming) or queued too many pulls
    "unknown_request",  # the producer holds no KV for this request (never had, released, expired)
    "expired",  # the lease ran out while streaming
    "corrupt",  # a payload's CRC32C did not match
    "truncated",  # the connection ended inside a frame
    "connection",  # could not connect, or the connection failed between frames
    "restarted",  # the producer's boot id changed: its leases are gone
    "protocol",  # a frame that breaks this module's rules
    "internal",  # the producer could not read the blocks it holds (a bug there)
)


class TransferError(Exception):
    """A KV transfer that failed; ``kind`` is one of :data:`ERROR_KINDS`."""

    def __init__(self, kind: str, message: str) -> None:
        if kind not in ERROR_KINDS:
            raise ValueError(f"unknown transfer error kind {kind!r}")
        super().__init__(f"{kind}: {message}")
        self.kind = kind


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """What must match for one engine's KV blocks to mean the same on another.

    Attributes:
        model: the served model's name.
        dtype: the KV cache's element type, a key of :data:`DTYPE_BYTES`.
        block_size: tokens per KV block.
        num_layers: transformer layers (each has a K and a V per block).
        num_kv_heads: KV heads per layer (per tensor-parallel rank: the whole count / TP).
        head_dim: elements per head.
        tensor_parallel_size: ranks the heads are split across.
        weights: the SHA-256 of the model's files (:func:`cadenza.node.model_digest.model_digest`):
            the same name and shapes with other weights make other KV.

    Raises:
        ValueError: a field of the wrong type or range.
    """

    model: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tensor_parallel_size: int = 1
    weights: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"fingerprint.model: must be a non-empty string, got {self.model!r}")
        if not isinstance(self.weights, str) or len(self.weights) > 128:
            raise ValueError(f"fingerprint.weights: must be a digest of at most 128 characters, got {self.weights!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"fingerprint.dtype: must be one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")
        for f in ("block_size", "num_layers", "num_kv_heads", "head_dim", "tensor_parallel_size"):
            value = getattr(self, f)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"fingerprint.{f}: must be a positive integer, got {value!r}")

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token holds across every layer: 2 (K and V) x layers x KV heads x head dim
        x dtype size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def block_layer_bytes(self) -> int:
        """Bytes of one block in one layer (K then V)."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    def packed(self) -> bytes:
        """The fingerprint as the handshake sends it (and its proofs sign): msgpack bytes."""
        return msgpack.packb(self.to_wire(), use_bin_type=True)

    @classmethod
    def unpacked(cls, data: bytes) -> Fingerprint:
        """The fingerprint of :meth:`packed` bytes, or :class:`TransferError` (``protocol``)."""
        try:
            doc = msgpack.unpackb(data, raw=False)
        except Exception as e:  # msgpack raises several unrelated types for bad bytes
            raise TransferError("protocol", f"a fingerprint that is not msgpack ({type(e).__name__})") from None
        return cls.from_wire(doc)

    @classmethod
    def from_wire(cls, doc: Any) -> Fingerprint:
        """The fingerprint a peer sent, or :class:`TransferError` (``protocol``)."""
        names = {f.name for f in fields(cls)}
        if not isinstance(doc, Mapping) or set(doc) != names:
            raise TransferError("protocol", f"a fingerprint must have exactly {', '.join(sorted(names))}")
        try:
            return cls(**doc)
        except (TypeError, ValueError) as e:
            raise TransferError("protocol", str(e)) from None

    def mismatch(self, other: Fingerprint) -> list[str]:
        """``field: ours != theirs`` for each field that differs (empty: compatible)."""
        return [f"{f.name}: {getattr(self, f.name)!r} != {getattr(other, f.name)!r}"
                for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]


def encode(kind: str, **fields_: Any) -> bytes:
    """One frame's length prefix and header: ``kind`` and ``fields_`` as a msgpack map."""
    body = msgpack.packb({"kind": kind, **fields_}, use_bin_type=True)
    if len(body) > MAX_HEADER_BYTES:
        raise ValueError(f"a {kind} header of {len(body)} bytes exceeds {MAX_HEADER_BYTES}")
    return _LENGTH.pack(len(body)) + body


def header_length(prefix: bytes) -> int:
    """The header length a frame's 4-byte prefix announces, or :class:`TransferError` (``protocol``)."""
    (n,) = _LENGTH.unpack(prefix)
    if not 0 < n <= MAX_HEADER_BYTES:
        raise TransferError("protocol", f"a header of {n} bytes (at most {MAX_HEADER_BYTES})")
    return n


_REQUIRED: dict[str, dict[str, type | tuple[type, ...]]] = {
    "hello": {"version": int},  # its nonce is checked once its version is known (an old peer is told why)
    "challenge": {"version": int, "nonce": bytes, "proof": bytes},
    "auth": {"fingerprint": bytes, "proof": bytes},
    "welcome": {"version": int, "fingerprint": bytes, "boot_id": str, "proof": bytes},
    "refused": {"code": str, "reason": str},
    "pull": {"request_id": str, "first_block": int, "num_blocks": int},
    "blocks": {"request_id": str, "first_block": int, "num_blocks": int, "first_layer": int, "num_layers": int,
               "nbytes": int, "crc32c": int},
    "pending": {"request_id": str, "num_blocks": int},
    "done": {"request_id": str, "num_blocks": int},
    "error": {"request_id": str, "code": str, "message": str},
    "release": {"request_id": str},
    "renew": {"request_id": str},
}


def decode(body: bytes) -> dict[str, Any]:
    """A header's map, its kind and fields checked, or :class:`TransferError` (``protocol``)."""
    try:
        msg = msgpack.unpackb(body, raw=False)
    except Exception as e:  # msgpack raises several unrelated types for bad bytes
        raise TransferError("protocol", f"a header that is not msgpack ({type(e).__name__})") from None
    kind = msg.get("kind") if isinstance(msg, dict) else None
    if not isinstance(kind, str) or kind not in _REQUIRED:
        raise TransferError("protocol", f"a header of unknown kind {str(kind)[:64]!r}")
    for name, kind in _REQUIRED[msg["kind"]].items():
        value = msg.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise TransferError("protocol", f"{msg['kind']}.{name}: {value!r} is not {getattr(kind, '__name__', kind)}")
        if isinstance(value, int) and value < 0:
            raise TransferError("protocol", f"{msg['kind']}.{name}: {value} is negative")
    if len(msg.get("request_id", "")) > MAX_ID_CHARS:
        raise TransferError("protocol", f"{msg['kind']}.request_id: longer than {MAX_ID_CHARS} characters")
    if msg["kind"] == "blocks" and msg["nbytes"] > MAX_PAYLOAD_BYTES:
        raise TransferError("protocol", f"blocks.nbytes: {msg['nbytes']} exceeds {MAX_PAYLOAD_BYTES}")
    if msg["kind"] in ("error", "refused") and msg["code"] not in ERROR_KINDS:
        raise TransferError("protocol", f"{msg['kind']}.code: unknown kind {msg['code']!r}")
    return msg


def blocks_header(request_id: str, first_block: int, num_blocks: int, first_layer: int, num_layers: int,
                  payload: bytes | memoryview) -> bytes:
    """The frame prefix and header that precede ``payload`` (its length and CRC32C computed here)."""
    return encode("blocks", request_id=request_id, first_block=first_block, num_blocks=num_blocks,
                  first_layer=first_layer, num_layers=num_layers, nbytes=len(payload), crc32c=crc32c.crc32c(payload))


def check_blocks_header(header: Mapping[str, Any], fingerprint: Fingerprint) -> None:
    """Raise :class:`TransferError` (``protocol``) unless a ``blocks`` header is whole blocks of
    every layer (``first_layer`` 0, ``num_layers`` all, at least one block) and announces
    exactly ``num_blocks x num_layers x block_layer_bytes`` payload bytes. Checked before the
    payload is read, so a lying header costs no memory."""
    if header["num_blocks"] < 1 or header["first_layer"] != 0 or header["num_layers"] != fingerprint.num_layers:
        raise TransferError("protocol", f"{header['num_blocks']} blocks of layers {header['first_layer']}+"
                            f"{header['num_layers']} (whole blocks of all {fingerprint.num_layers} layers expected)")
    expected = header["num_blocks"] * header["num_layers"] * fingerprint.block_layer_bytes
    if header["nbytes"] != expected:
        raise TransferError("protocol", f"{header['nbytes']} payload bytes for {header['num_blocks']} blocks x "
                            f"{header['num_layers']} layers ({expected} expected)")


def check_payload(header: Mapping[str, Any], payload: bytes | memoryview) -> None:
    """Raise :class:`TransferError` unless ``payload`` has the size (``truncated``) and the CRC32C
    (``corrupt``) its ``blocks`` header announced."""
    if len(payload) != header["nbytes"]:
        raise TransferError("truncated", f"{len(payload)} of {header['nbytes']} payload bytes")
    if crc32c.crc32c(payload) != header["crc32c"]:
        raise TransferError("corrupt", f"CRC32C mismatch in blocks {header['first_block']}.."
                            f"{header['first_block'] + header['num_blocks'] - 1} of {header['request_id']}")
