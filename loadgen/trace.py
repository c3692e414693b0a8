"""Request traces for replay: load the Azure CSV or a JSONL trace, then scale it.

Two formats are read, detected from the first non-blank line:

- **Azure CSV** (Azure Public Dataset, the Splitwise paper, Patel et al., ISCA 2024): a header
  with ``TIMESTAMP`` (date and time, e.g. ``2023-11-16 18:15:46.6805900``), ``ContextTokens``
  (prompt length, tokens) and ``GeneratedTokens`` (output length, tokens); other columns ignored.
- **JSONL** as in public traces such as Mooncake's: one object a line with ``timestamp``
  (milliseconds), ``input_length`` and ``output_length`` (tokens); other keys ignored.

Either may also say who sent each request: a ``class`` column or key (``interactive``,
``batch``, ``background``: the ``x-cadenza-class`` it goes as) and a ``tenant`` (the
``x-cadenza-tenant``); an empty value, or none, leaves the request to the replay's defaults.

A trace carries no text, only arrival times and lengths. Arrivals become offsets in seconds from
the first request, sorted. ``scale_trace`` stretches time, scales and caps lengths, and keeps a
prefix of the trace; it says what it did in a :class:`TraceScaling`, which every report repeats.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, NamedTuple

from cadenza.node.core.policy import CLASSES

CSV_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
JSONL_KEYS = ("timestamp", "input_length", "output_length")
OPTIONAL_COLUMNS = ("class", "tenant")  # CSV columns and JSONL keys alike
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        arrival_s: arrival time in seconds after the trace's first request (≥ 0).
        input_len: prompt length in tokens (≥ 0 as loaded; ≥ 1 after :func:`scale_trace`).
        output_len: output length in tokens (≥ 0 as loaded; ≥ 1 after :func:`scale_trace`).
        traffic_class: the trace's class for it (one of ``CLASSES``), or None.
        tenant: the trace's tenant for it, or None.
    """

    arrival_s: float
    input_len: int
    output_len: int
    traffic_class: str | None = None
    tenant: str | None = None


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Read a trace file (Azure CSV or JSONL, detected from its first non-blank line).

    Returns:
        The requests sorted by arrival, ``arrival_s`` measured from the earliest one.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is empty, lacks a required column or key, or a line holds a bad
            timestamp or length; the message names the file and the line number (1-based).
    """
    path = Path(path)
    with path.open(encoding="utf-8", newline="") as f:
        lines = f.read().splitlines()
    first = next((line.strip() for line in lines if line.strip()), None)
    if first is None:
        raise ValueError(f"{path}: the trace is empty")
    rows = _parse_jsonl(path, lines) if first.startswith("{") else _parse_csv(path, lines)
    if not rows:
        raise ValueError(f"{path}: the trace holds no requests")
    rows.sort(key=lambda row: row[0])
    t0 = rows[0][0]
    return [TraceRequest((t - t0) / 1e6, n_in, n_out, cls, tenant) for t, n_in, n_out, cls, tenant in rows]


_Row = tuple[float, int, int, "str | None", "str | None"]


def _who(cls: Any, tenant: Any, where: str) -> tuple[str | None, str | None]:
    """The optional class and tenant of a row: None when absent or empty."""
    cls = None if cls in (None, "") else cls
    tenant = None if tenant in (None, "") else tenant
    if cls is not None and cls not in CLASSES:
        raise ValueError(f"{where}: bad class {cls!r} (expected one of {', '.join(CLASSES)})")
    if tenant is not None and not isinstance(tenant, str):
        raise ValueError(f"{where}: bad tenant {tenant!r} (expected a string)")
    return cls, tenant


def _parse_csv(path: Path, lines: list[str]) -> list[_Row]:
    """Rows of (arrival in microseconds, input tokens, output tokens, class, tenant)."""
    reader = csv.reader(lines)
    header = next(reader)
    missing = [c for c in CSV_COLUMNS if c not in header]
    if missing:
        raise ValueError(
            f"{path}:1: not a JSONL trace and the CSV header lacks {', '.join(missing)} "
            f"(expected columns {', '.join(CSV_COLUMNS)})"
        )
    i_ts, i_in, i_out = (header.index(c) for c in CSV_COLUMNS)
    i_cls, i_tenant = (header.index(c) if c in header else None for c in OPTIONAL_COLUMNS)
    rows = []
    for lineno, fields in enumerate(reader, start=2):
        if not fields or not "".join(fields).strip():
            continue
        where = f"{path}:{lineno}"
        if len(fields) < len(header):
            raise ValueError(f"{where}: expected {len(header)} fields, got {len(fields)}")
        try:
            t = _microseconds(fields[i_ts])
        except ValueError:
            raise ValueError(f"{where}: bad TIMESTAMP {fields[i_ts]!r}") from None
        who = _who(fields[i_cls].strip() if i_cls is not None else None,
                   fields[i_tenant].strip() if i_tenant is not None else None, where)
        rows.append((t, _length(fields[i_in], "ContextTokens", where),
                     _length(fields[i_out], "GeneratedTokens", where), *who))
    return rows


def _microseconds(timestamp: str) -> int:
    """Microseconds since the POSIX epoch of an ISO date and time (no zone: read as UTC).

    Integer microseconds keep offsets exact; float seconds since 1970 would round them.
    """
    dt = datetime.fromisoformat(timestamp.strip())
    dt = dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)
    return (dt - _EPOCH) // timedelta(microseconds=1)


def _parse_jsonl(path: Path, lines: list[str]) -> list[_Row]:
    """Rows of (arrival in microseconds, input tokens, output tokens, class, tenant)."""
    rows = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not a JSON object ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: not a JSON object")
        missing = [k for k in JSONL_KEYS if k not in obj]
        if missing:
            raise ValueError(f"{where}: missing key(s) {', '.join(missing)}")
        ts = obj["timestamp"]
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
            raise ValueError(f"{where}: bad timestamp {ts!r} (expected milliseconds)")
        rows.append((ts * 1000, _length(obj["input_length"], "input_length", where),
                     _length(obj["output_length"], "output_length", where),
                     *_who(obj.get("class"), obj.get("tenant"), where)))
    return rows


def _length(value: Any, name: str, where: str) -> int:
    """A token count: a non-negative integer (``"12"`` and ``12.0`` are accepted)."""
    try:
        if isinstance(value, bool):
            raise ValueError
        n = float(value)
        if n != int(n):
            raise ValueError
        n = int(n)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(
            f"{where}: bad {name} {value!r} (expected a whole number of tokens)") from None
    if n < 0:
        raise ValueError(f"{where}: negative {name} {n}")
    return n


@dataclass(frozen=True, slots=True)
class TraceScaling:
    """How a trace was scaled for replay; repeated in every report.

    Attributes:
        time_scale: factor on arrival offsets (2.0 halves the request rate; 0 sends all at once).
        length_scale: factor on both lengths, rounded, at least 1 token.
        max_input_len / max_output_len: caps in tokens after length scaling, or None.
        num_requests: keep at most the first N requests, or None.
        duration_s: keep requests arriving within this many seconds after time scaling, or None.
        original_requests / kept_requests: request counts before and after.
        original_span_s / scaled_span_s: first-to-last arrival, in seconds, before and after.
        mean_input_len / mean_output_len: mean lengths in tokens of the kept requests.
    """

    time_scale: float
    length_scale: float
    max_input_len: int | None
    max_output_len: int | None
    num_requests: int | None
    duration_s: float | None
    original_requests: int
    kept_requests: int
    original_span_s: float
    scaled_span_s: float
    mean_input_len: float
    mean_output_len: float

    def as_dict(self) -> dict[str, Any]:
        """Plain dict for JSON output (keys are the attribute names)."""
        return asdict(self)

    def describe(self) -> str:
        """One human-readable paragraph, e.g. for the top of a printed report."""
        rate = (f"{1 / self.time_scale:g}x the original request rate" if self.time_scale > 0
                else "every request sent at once")
        parts = [
            f"arrival offsets x{self.time_scale:g} ({rate})",
            f"lengths x{self.length_scale:g} (min 1 token)",
        ]
        if self.max_input_len is not None:
            parts.append(f"prompts capped at {self.max_input_len} tokens")
        if self.max_output_len is not None:
            parts.append(f"outputs capped at {self.max_output_len} tokens")
        if self.num_requests is not None:
            parts.append(f"first {self.num_requests} requests")
        if self.duration_s is not None:
            parts.append(f"first {self.duration_s:g} s after scaling")
        return (
            f"Trace scaled: {'; '.join(parts)}. Kept {self.kept_requests} of "
            f"{self.original_requests} requests, spanning {self.scaled_span_s:.1f} s "
            f"(originally {self.original_span_s:.1f} s); mean prompt {self.mean_input_len:.0f} "
            f"tokens, mean output {self.mean_output_len:.0f} tokens."
        )


class ScaledTrace(NamedTuple):
    requests: list[TraceRequest]
    scaling: TraceScaling


def scale_trace(
    requests: list[TraceRequest],
    *,
    time_scale: float = 1.0,
    length_scale: float = 1.0,
    max_input_len: int | None = None,
    max_output_len: int | None = None,
    num_requests: int | None = None,
    duration_s: float | None = None,
) -> ScaledTrace:
    """Scale a trace (sorted by arrival, as :func:`load_trace` returns it) for replay.

    Arrival offsets are multiplied by ``time_scale``; both lengths by ``length_scale``, rounded
    to the nearest token, at least 1, then capped. ``duration_s`` keeps requests whose scaled
    arrival is at most that many seconds; ``num_requests`` keeps the first N of those.

    Raises:
        ValueError: a negative or non-finite ``time_scale``, a non-positive or non-finite
            ``length_scale``, a non-positive ``duration_s``, or a cap or count below 1.
    """
    if not (math.isfinite(time_scale) and time_scale >= 0):
        raise ValueError(f"time scale must be a finite number >= 0, got {time_scale}")
    if not (math.isfinite(length_scale) and length_scale > 0):
        raise ValueError(f"length scale must be a finite number > 0, got {length_scale}")
    if duration_s is not None and not duration_s > 0:
        raise ValueError(f"duration must be > 0 seconds, got {duration_s}")
    for name, value in (("max input length", max_input_len),
                        ("max output length", max_output_len),
                        ("number of requests", num_requests)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")

    def length(n: int, cap: int | None) -> int:
        n = max(1, round(n * length_scale))
        return n if cap is None else min(n, cap)

    kept = []
    for r in requests:
        arrival = r.arrival_s * time_scale
        if duration_s is not None and arrival > duration_s:
            break
        if num_requests is not None and len(kept) >= num_requests:
            break
        kept.append(TraceRequest(arrival, length(r.input_len, max_input_len),
                                 length(r.output_len, max_output_len), r.traffic_class, r.tenant))
    n = max(len(kept), 1)
    scaling = TraceScaling(
        time_scale=time_scale,
        length_scale=length_scale,
        max_input_len=max_input_len,
        max_output_len=max_output_len,
        num_requests=num_requests,
        duration_s=duration_s,
        original_requests=len(requests),
        kept_requests=len(kept),
        original_span_s=requests[-1].arrival_s - requests[0].arrival_s if requests else 0.0,
        scaled_span_s=kept[-1].arrival_s - kept[0].arrival_s if kept else 0.0,
        mean_input_len=sum(r.input_len for r in kept) / n,
        mean_output_len=sum(r.output_len for r in kept) / n,
    )
    return ScaledTrace(kept, scaling)
