"""The KV transfer handshake: both sides prove they hold the pool's token, then compare fingerprints.

A mutual HMAC-SHA256 challenge-response (RFC 2104; the shape of RFC 5802's SCRAM proofs, without
a password store): the token itself never crosses the wire.

1. ``hello`` (C -> P): the protocol version and the consumer's nonce ``Nc``.
2. ``challenge`` (P -> C): the producer's nonce ``Np`` and ``HMAC(token, producer | Nc | Np)``.
   The consumer checks it before it says anything about itself.
3. ``auth`` (C -> P): the consumer's fingerprint ``Fc`` and ``HMAC(token, consumer | Nc | Np | Fc)``.
4. ``welcome`` (P -> C): the producer's fingerprint ``Fp``, its boot id ``B`` and
   ``HMAC(token, welcome | Nc | Np | Fp | B)``; or ``refused`` with a code and a reason.

Each proof has its own label and covers both fresh nonces, so no proof can be replayed on another
connection or reflected to the other side, and it covers the fingerprint its sender claims, so
the fingerprint a side checks is the one a token holder sent. A producer without a token sends a
random proof and refuses every ``auth``, so a peer cannot tell it apart from one with another
token. A peer that has not proved the token learns nothing of the replica: no fingerprint, no
reason beyond ``unauthorized``; the detailed mismatch is logged by the producer and told only
to an authenticated consumer.

What this does **not** protect against: there is no encryption and no integrity after the
handshake (no TLS). An attacker on the path between two replicas can read every KV block (the
prompts can be recovered from them), can change blocks and recompute their CRC32C, and can relay
a handshake between two honest replicas to ride on it. Keep the KV port inside the pool with a
NetworkPolicy that admits it only from the pool's own pods; across untrusted networks run the
pool under a service mesh with mutual TLS (Istio, Linkerd), which encrypts and authenticates each
connection below this protocol. The token is as safe as the Secret that holds it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from collections.abc import Callable, Mapping
from typing import Any

from cadenza.node.kv_transfer import protocol
from cadenza.node.kv_transfer.protocol import Fingerprint, TransferError

NONCE_BYTES = 32
PROOF_BYTES = hashlib.sha256().digest_size
# Where each side reads the token (at each connection: a rotated secret takes effect at once).
TokenSource = Callable[[], "str | None"]


class Refusal(Exception):
    """A handshake the producer refuses: ``kind`` (a :data:`~.protocol.ERROR_KINDS` kind) and
    ``reason`` go to the peer, ``detail`` only to the producer's log."""

    def __init__(self, kind: str, reason: str, detail: str | None = None) -> None:
        super().__init__(f"{kind}: {detail or reason}")
        self.kind, self.reason, self.detail = kind, reason, detail or reason


def token_source(token: str | TokenSource | None) -> TokenSource:
    """``token`` as a callable: a fixed string, a function read at each handshake, or None (no
    token; an empty string is none either)."""
    if callable(token):
        return lambda: token() or None
    return lambda: token or None


def proof(token: str, label: bytes, *parts: bytes) -> bytes:
    """``HMAC-SHA256(token, version | label | parts)``, each part length-prefixed."""
    mac = hmac.new(token.encode(), b"cadenza-kv/%d\0%s" % (protocol.PROTOCOL_VERSION, label), hashlib.sha256)
    for part in parts:
        mac.update(struct.pack("!I", len(part)))
        mac.update(part)
    return mac.digest()


def _nonce(msg: Mapping[str, Any]) -> bytes:
    nonce = msg.get("nonce")
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
        raise TransferError("protocol", f"a {msg['kind']} without a {NONCE_BYTES}-byte nonce")
    return nonce


# -- the consumer's side ----------------------------------------------------------------------------


def hello() -> tuple[bytes, bytes]:
    """``(the hello frame, the consumer's nonce)``."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    return protocol.encode("hello", version=protocol.PROTOCOL_VERSION, nonce=nonce), nonce


def _refused(msg: Mapping[str, Any], where: str) -> TransferError:
    return TransferError(msg["code"], f"{where} refused: {msg['reason']}")


def answer(msg: Mapping[str, Any], token: str, nonce_c: bytes, fingerprint: Fingerprint,
           where: str) -> tuple[bytes, bytes]:
    """``(the auth frame, the producer's nonce)`` for the producer's ``challenge``.

    Raises:
        TransferError: a refusal (its code), a producer that does not prove the token
            (``unauthorized``: nothing about this replica was sent), another version
            (``incompatible``) or another frame (``protocol``).
    """
    if msg["kind"] == "refused":
        raise _refused(msg, where)
    if msg["kind"] != "challenge":
        raise TransferError("protocol", f"{where} answered hello with {msg['kind']}")
    if msg["version"] != protocol.PROTOCOL_VERSION:
        raise TransferError("incompatible", f"{where} speaks protocol version {msg['version']} "
                            f"(this replica {protocol.PROTOCOL_VERSION})")
    nonce_p = _nonce(msg)
    if not hmac.compare_digest(msg["proof"], proof(token, b"producer", nonce_c, nonce_p)):
        raise TransferError("unauthorized", f"{where} does not prove the pool's token")
    packed = fingerprint.packed()
    return protocol.encode("auth", fingerprint=packed, proof=proof(token, b"consumer", nonce_c, nonce_p, packed)), nonce_p


def check_welcome(msg: Mapping[str, Any], token: str, nonce_c: bytes, nonce_p: bytes, fingerprint: Fingerprint,
                  where: str) -> str:
    """The producer's boot id from its ``welcome``.

    Raises:
        TransferError: a refusal (its code: ``incompatible`` names the fields that differ), a
            welcome without the token's proof (``unauthorized``), another fingerprint
            (``incompatible``) or another frame (``protocol``).
    """
    if msg["kind"] == "refused":
        raise _refused(msg, where)
    if msg["kind"] != "welcome":
        raise TransferError("protocol", f"{where} answered auth with {msg['kind']}")
    if not hmac.compare_digest(msg["proof"], proof(token, b"welcome", nonce_c, nonce_p, msg["fingerprint"],
                                                   msg["boot_id"].encode())):
        raise TransferError("unauthorized", f"{where} welcomed without the pool's token")
    theirs = Fingerprint.unpacked(msg["fingerprint"])
    if msg["version"] != protocol.PROTOCOL_VERSION or (diff := fingerprint.mismatch(theirs)):
        why = f"version {msg['version']}" if msg["version"] != protocol.PROTOCOL_VERSION else "; ".join(diff)
        raise TransferError("incompatible", f"{where} welcomed with an incompatible layout: {why}")
    return msg["boot_id"]


# -- the producer's side ----------------------------------------------------------------------------


def check_hello(msg: Mapping[str, Any]) -> bytes:
    """The consumer's nonce from its ``hello``, or :class:`Refusal` (``protocol``, ``incompatible``)."""
    if msg["kind"] != "hello":
        raise Refusal("protocol", f"expected hello, got {msg['kind']}")
    if msg["version"] != protocol.PROTOCOL_VERSION:
        raise Refusal("incompatible", f"protocol version {msg['version']} (this replica speaks "
                      f"{protocol.PROTOCOL_VERSION})")
    try:
        return _nonce(msg)
    except TransferError as e:
        raise Refusal("protocol", str(e)) from None


def challenge(token: str | None, nonce_c: bytes) -> tuple[bytes, bytes]:
    """``(the challenge frame, the producer's nonce)``; without a token the proof is random bytes."""
    nonce_p = secrets.token_bytes(NONCE_BYTES)
    signed = secrets.token_bytes(PROOF_BYTES) if token is None else proof(token, b"producer", nonce_c, nonce_p)
    return protocol.encode("challenge", version=protocol.PROTOCOL_VERSION, nonce=nonce_p, proof=signed), nonce_p


def check_auth(msg: Mapping[str, Any], token: str | None, nonce_c: bytes, nonce_p: bytes,
               fingerprint: Fingerprint) -> Fingerprint:
    """The consumer's fingerprint from its ``auth``, once its proof and its fields check.

    Raises:
        Refusal: ``unauthorized`` (told nothing more), then ``protocol`` or ``incompatible`` (told
            which fields differ: the peer holds the token).
    """
    if msg["kind"] != "auth":
        raise Refusal("protocol", f"expected auth, got {msg['kind']}")
    if token is None:
        raise Refusal("unauthorized", "unauthorized", "this replica has no pool token: it refuses every peer "
                      "(set CADENZA_ADMIN_TOKEN or CADENZA_ADMIN_TOKEN_FILE)")
    if not hmac.compare_digest(msg["proof"], proof(token, b"consumer", nonce_c, nonce_p, msg["fingerprint"])):
        raise Refusal("unauthorized", "unauthorized", "the peer does not prove the pool's token")
    try:
        theirs = Fingerprint.unpacked(msg["fingerprint"])
    except TransferError as e:
        raise Refusal("protocol", str(e)) from None
    if diff := fingerprint.mismatch(theirs):
        raise Refusal("incompatible", "incompatible KV layout: " + "; ".join(diff) + " (this replica's != yours)")
    return theirs


def welcome(token: str, nonce_c: bytes, nonce_p: bytes, fingerprint: Fingerprint, boot_id: str) -> bytes:
    """The welcome frame, signed."""
    packed = fingerprint.packed()
    return protocol.encode("welcome", version=protocol.PROTOCOL_VERSION, fingerprint=packed, boot_id=boot_id,
                           proof=proof(token, b"welcome", nonce_c, nonce_p, packed, boot_id.encode()))
