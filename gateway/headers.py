"""Which headers cross the gateway, and reading ``Retry-After``.

Hop-by-hop headers (RFC 9110 section 7.6.1: ``Connection`` and every header it names,
``Keep-Alive``, ``Proxy-Connection``, ``TE``, ``Transfer-Encoding``, ``Upgrade``, and the
``Proxy-*`` credentials) describe one connection and are dropped in both directions; every other
header — ``authorization``, ``x-cadenza-class``, ``x-cadenza-tenant``, W3C ``traceparent`` and
``tracestate`` among them — is forwarded unchanged. ``Host`` and ``Content-Length`` are set anew by
the client library for the upstream request. A client's ``x-cadenza-kv-*`` headers are dropped:
only the gateway itself asks replicas to move KV (:mod:`.disagg`); and a replica's
``x-cadenza-disagg-rule`` is the gateway's to read, not the client's.
"""

from __future__ import annotations

import datetime
import email.utils
import time
import math

from multidict import CIMultiDict, CIMultiDictProxy

from cadenza.node.kv_transfer.threshold import Rule
from cadenza.node.wire import DISAGG_RULE_HEADER, KV_PUBLISH_HEADER, KV_SOURCE_HEADER

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization",
    "te", "trailer", "trailers", "transfer-encoding", "upgrade",
})
# Set by the client library from the upstream URL and the body it sends; the KV transfer headers
# are the gateway's own.
_RESET_ON_REQUEST = frozenset({"host", "content-length", KV_PUBLISH_HEADER, KV_SOURCE_HEADER})
_GATEWAY_ONLY = frozenset({DISAGG_RULE_HEADER})  # replicas tell the gateway, not the client

DEFAULT_RETRY_AFTER_S = 1.0
MAX_RETRY_AFTER_S = 3600.0  # a longer (or absurd) back-off is read as this


def _connection_tokens(headers: CIMultiDictProxy[str] | CIMultiDict[str]) -> set[str]:
    """Header names listed in ``Connection`` (hop-by-hop by declaration)."""
    values = headers.getall("connection", [])
    return {token.strip().lower() for value in values for token in value.split(",") if token.strip()}


def _end_to_end(headers: CIMultiDictProxy[str] | CIMultiDict[str], also_drop: frozenset[str]) -> CIMultiDict[str]:
    drop = HOP_BY_HOP | also_drop | _connection_tokens(headers)
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in drop)


def request_headers(headers: CIMultiDictProxy[str] | CIMultiDict[str], remote: str | None) -> CIMultiDict[str]:
    """Headers to send upstream: the client's end-to-end headers, plus ``X-Forwarded-For``."""
    out = _end_to_end(headers, _RESET_ON_REQUEST)
    if remote:
        previous = out.pop("x-forwarded-for", None)
        out["X-Forwarded-For"] = f"{previous}, {remote}" if previous else remote
    return out


def response_headers(headers: CIMultiDictProxy[str] | CIMultiDict[str]) -> CIMultiDict[str]:
    """Headers to pass back to the client: every end-to-end header of the upstream response
    (``content-type``, ``content-length``, ``retry-after``, ``x-request-id``, ...)."""
    return _end_to_end(headers, _GATEWAY_ONLY)


def disagg_rule(headers: CIMultiDictProxy[str] | CIMultiDict[str]) -> Rule | None:
    """A replica's reported selective disaggregation rule, None when absent or unreadable."""
    return Rule.from_header(headers.get(DISAGG_RULE_HEADER))


def retry_after_s(value: str | None, now: float | None = None) -> float:
    """Seconds to wait from a ``Retry-After`` value (RFC 9110 section 10.2.3: delay-seconds or an
    HTTP-date); :data:`DEFAULT_RETRY_AFTER_S` when absent or unreadable; within
    ``[0, MAX_RETRY_AFTER_S]``."""
    if not value:
        return DEFAULT_RETRY_AFTER_S
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        seconds = None
    if seconds is not None:
        return min(max(0.0, seconds), MAX_RETRY_AFTER_S) if math.isfinite(seconds) else DEFAULT_RETRY_AFTER_S
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return DEFAULT_RETRY_AFTER_S
    if when is None:
        return DEFAULT_RETRY_AFTER_S
    if when.tzinfo is None:  # an obsolete date form without a zone: HTTP dates are GMT
        when = when.replace(tzinfo=datetime.timezone.utc)
    return min(max(0.0, when.timestamp() - (time.time() if now is None else now)), MAX_RETRY_AFTER_S)
