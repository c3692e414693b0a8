"""Per-request headers the bench adds: the traffic class and a W3C trace context.

- **Traffic class**: ``x-cadenza-class: interactive|batch|background`` (see
  :mod:`cadenza.node.core.policy`). A :class:`ClassRule` picks it from the prompt length, or sends no
  header at all (the server then applies its own default class).
- **Trace context** (W3C Trace Context, https://www.w3.org/TR/trace-context/): every request gets a
  fresh ``traceparent: 00-<32 hex trace id>-<16 hex parent span id>-01`` with random ids, so the
  server's span for that request can be found by its trace id.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import NamedTuple

from cadenza.node.core.policy import CLASSES
from cadenza.node.wire import CLASS_HEADER, TENANT_HEADER, TRACEPARENT_HEADER



@dataclass(frozen=True, slots=True)
class ClassRule:
    """Which traffic class a request is sent as.

    Attributes:
        fixed: send every request as this class; None for no fixed class.
        batch_above: prompts of at least this many tokens go as ``batch``, the others as
            ``interactive``; None for no threshold.

    With neither set, no class header is sent. Setting both is an error.

    Raises:
        ValueError: an unknown class name, a threshold below 1, or both fields set.
    """

    fixed: str | None = None
    batch_above: int | None = None

    def __post_init__(self) -> None:
        if self.fixed is not None and self.fixed not in CLASSES:
            raise ValueError(f"class must be one of {', '.join(CLASSES)}, got {self.fixed!r}")
        if self.batch_above is not None and self.batch_above < 1:
            raise ValueError(f"batch threshold must be >= 1 token, got {self.batch_above}")
        if self.fixed is not None and self.batch_above is not None:
            raise ValueError("give a fixed class or a batch threshold, not both")

    def class_for(self, prompt_tokens: int) -> str | None:
        """The class of a request whose prompt has ``prompt_tokens`` tokens, or None (no header)."""
        if self.batch_above is not None:
            return "batch" if prompt_tokens >= self.batch_above else "interactive"
        return self.fixed


class TraceParent(NamedTuple):
    """A ``traceparent`` header value and the trace id it carries (32 lowercase hex digits)."""

    header: str
    trace_id: str


def _nonzero_hex(num_bytes: int) -> str:
    """Random lowercase hex of ``num_bytes`` bytes; all zeros is invalid in a trace context."""
    while True:
        value = secrets.token_hex(num_bytes)
        if value.strip("0"):
            return value


def new_traceparent() -> TraceParent:
    """A fresh sampled trace context: version 00, random trace and parent span ids, flags 01."""
    trace_id = _nonzero_hex(16)
    return TraceParent(f"00-{trace_id}-{_nonzero_hex(8)}-01", trace_id)


def request_headers(api_key: str | None = None, traffic_class: str | None = None,
                    traceparent: str | None = None, tenant: str | None = None) -> dict[str, str]:
    """HTTP headers for one request: bearer auth, class, tenant and trace context, each when given."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    if traffic_class is not None:
        headers[CLASS_HEADER] = traffic_class
    if tenant is not None:
        headers[TENANT_HEADER] = tenant
    if traceparent is not None:
        headers[TRACEPARENT_HEADER] = traceparent
    return headers
