"""Replay timed requests against an OpenAI-compatible streaming endpoint and time every token.

Each request is sent at its scheduled arrival (open loop: a slow server never delays later
arrivals) over one shared ``aiohttp.ClientSession`` with no connection limit. The response is a
server-sent event stream (OpenAI API, ``stream: true``): ``data: {json}`` lines ending with
``data: [DONE]``. A chunk that carries non-empty text (``choices[0].text`` for completions,
``choices[0].delta.content`` for chat) is a token event: the first one fixes TTFT, and every gap
between consecutive ones is an ITL sample. Token counts come from the final usage chunk
(``stream_options.include_usage``), or else from the number of content chunks.

An HTTP error status, a connection error, a timeout, a malformed stream or an ``error`` object in
the stream marks the request failed with a message; the replay itself never raises for them.

Every request carries a fresh W3C ``traceparent`` and, when a :class:`ClassRule` says so, an
``x-cadenza-class`` header (:mod:`cadenza.loadgen.headers`). A :class:`ServerSampler` given to
:func:`replay` polls the server's counters alongside (:mod:`cadenza.loadgen.server_samples`).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

import aiohttp

from cadenza.loadgen.headers import ClassRule, new_traceparent, request_headers
from cadenza.loadgen.server_samples import ServerSampler
from cadenza.loadgen.trace import TraceRequest

Endpoint = Literal["completions", "chat"]
ENDPOINT_PATHS: dict[str, str] = {"completions": "/completions", "chat": "/chat/completions"}
DEFAULT_API_VERSION = "v1"
_VERSION_SEGMENT = re.compile(r"v\d+")


def api_base_url(url: str) -> str:
    """The API root of ``url``, ending in its version segment and without a trailing slash.

    ``http://h:8000``, ``http://h:8000/``, ``http://h:8000/v1`` and ``http://h:8000/v1/`` all give
    ``http://h:8000/v1``: ``/v1`` is appended unless the path already ends in a version segment
    (``/v1``, ``/v2``, ...), so a gateway prefix such as ``https://gw/tenant/a`` becomes
    ``https://gw/tenant/a/v1``. A query or fragment is dropped.

    Raises:
        ValueError: ``url`` is not an ``http://`` or ``https://`` URL with a host.
    """
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"not an http(s) URL: {url!r}; give the API root, e.g. "
                         "http://127.0.0.1:8000 or http://127.0.0.1:8000/v1")
    path = parts.path.rstrip("/")
    if not _VERSION_SEGMENT.fullmatch(path.rsplit("/", 1)[-1]):
        path += f"/{DEFAULT_API_VERSION}"
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """Where and how to send requests.

    Attributes:
        base_url: API root including the version, e.g. ``http://localhost:8000/v1`` (see
            :func:`api_base_url` to accept one without it).
        model: the ``model`` field sent with every request.
        endpoint: ``completions`` (``POST {base}/completions``, field ``prompt``) or ``chat``
            (``POST {base}/chat/completions``, one user message).
        timeout_s: per-request limit in seconds, from send to the end of the stream.
        api_key: sent as ``Authorization: Bearer ...`` when set.
        classes: which ``x-cadenza-class`` each request carries (default: none).
    """

    base_url: str
    model: str
    endpoint: Endpoint = "completions"
    timeout_s: float = 600.0
    api_key: str | None = None
    classes: ClassRule = ClassRule()


@dataclass(slots=True)
class RequestRecord:
    """What one replayed request measured. Times in milliseconds unless named ``_s``.

    Attributes:
        index: position in the replayed trace.
        arrival_s: scheduled send time, seconds after the replay started.
        start_s: actual send time, seconds after the replay started.
        input_len / output_len: requested prompt and output lengths, tokens.
        ok: the stream completed with ``[DONE]`` and no error.
        error: why it failed (``HTTP 429: ...``, ``ClientConnectorError: ...``), else None.
        ttft_ms: send to the first chunk carrying text; None when no text came.
        itl_ms: every gap between consecutive text-carrying chunks (chunks − 1 values).
        e2e_ms: send to the end of the stream (or to the failure).
        prompt_tokens: from the usage chunk, else None.
        completion_tokens: from the usage chunk, else the number of text-carrying chunks.
        traffic_class: the ``x-cadenza-class`` sent (JSON key ``class``), or None when none was.
        tenant: the ``x-cadenza-tenant`` sent (the trace's ``tenant``), or None.
        trace_id: the trace id of the ``traceparent`` sent (32 hex digits).
    """

    index: int
    arrival_s: float
    input_len: int
    output_len: int
    start_s: float = 0.0
    ok: bool = False
    error: str | None = None
    ttft_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    e2e_ms: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    traffic_class: str | None = None
    tenant: str | None = None
    trace_id: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """Plain dict for JSON output (keys are the attribute names, ``class`` for the class)."""
        out = asdict(self)
        out["class"] = out.pop("traffic_class")
        return out


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """All records, in trace order, and the wall time in seconds from first send to last end."""

    records: list[RequestRecord]
    duration_s: float


def build_payload(config: ReplayConfig, prompt: str, max_tokens: int) -> dict[str, Any]:
    """The JSON body for one streaming request of exactly ``max_tokens`` output tokens."""
    body: dict[str, Any] = {
        "model": config.model,
        "max_tokens": max_tokens,
        "ignore_eos": True,  # vLLM-style extension: generate max_tokens whatever the text says
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def fetch_model(session: aiohttp.ClientSession, base_url: str,
                      api_key: str | None = None, timeout_s: float = 30.0) -> str:
    """The first model id listed by ``GET {base_url}/models``.

    Raises:
        RuntimeError: the request fails, or the list is empty or malformed; says to pass --model.
    """
    url = base_url.rstrip("/") + "/models"
    try:
        async with session.get(url, headers=request_headers(api_key),
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status >= 400:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
            return str((await resp.json(content_type=None))["data"][0]["id"])
    except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
        raise RuntimeError(f"cannot reach {url} ({type(exc).__name__}: {exc}); is the server running?") from exc
    except (aiohttp.ClientError, KeyError, IndexError, TypeError, ValueError, RuntimeError) as exc:
        raise RuntimeError(
            f"could not read the model list at {url} ({type(exc).__name__}: {exc}); "
            "pass --model to name the model yourself"
        ) from exc


def _chunk_text(chunk: dict[str, Any], endpoint: str) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if endpoint == "chat":
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def _error_message(resp: aiohttp.ClientResponse) -> str:
    body = await resp.text()
    try:
        error = json.loads(body).get("error")
        message = error.get("message") if isinstance(error, dict) else error
        body = str(message or body)
    except (ValueError, AttributeError):
        pass
    return f"HTTP {resp.status}: {body.strip()[:200]}"


async def send_request(session: aiohttp.ClientSession, config: ReplayConfig,
                       record: RequestRecord, prompt: str, clock_zero: float) -> None:
    """Send one streaming request and fill ``record`` in place; never raises for failures.

    ``clock_zero`` is the replay's start on ``time.perf_counter``'s clock, for ``start_s``.
    """
    url = config.base_url.rstrip("/") + ENDPOINT_PATHS[config.endpoint]
    payload = build_payload(config, prompt, record.output_len)
    traceparent, record.trace_id = new_traceparent()
    headers = request_headers(config.api_key, record.traffic_class, traceparent, record.tenant)
    sent = time.perf_counter()
    record.start_s = sent - clock_zero
    last: float | None = None
    chunks = 0
    try:
        async with session.post(url, json=payload, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=config.timeout_s)) as resp:
            if resp.status >= 400:
                record.error = await _error_message(resp)
                return
            done = False
            async for raw in resp.content:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue  # blank separators, comments (":"), "event:" lines
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    error = chunk["error"]
                    record.error = "stream error: " + str(
                        error.get("message", error) if isinstance(error, dict) else error)
                    return
                if _chunk_text(chunk, config.endpoint):
                    now = time.perf_counter()
                    if last is None:
                        record.ttft_ms = (now - sent) * 1e3
                    else:
                        record.itl_ms.append((now - last) * 1e3)
                    last = now
                    chunks += 1
                if usage := chunk.get("usage"):
                    record.prompt_tokens = usage.get("prompt_tokens")
                    record.completion_tokens = usage.get("completion_tokens") or 0
            if not done:
                record.error = "stream ended without data: [DONE]"
                return
        record.ok = True
    except asyncio.TimeoutError:
        record.error = f"timed out after {config.timeout_s:g} s"
    except (aiohttp.ClientError, OSError, ValueError, UnicodeDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    finally:
        record.e2e_ms = (time.perf_counter() - sent) * 1e3
        if not record.completion_tokens:
            record.completion_tokens = chunks


async def replay(
    requests: Sequence[TraceRequest],
    prompts: Sequence[str],
    config: ReplayConfig,
    on_done: Callable[[RequestRecord], None] | None = None,
    sampler: ServerSampler | None = None,
) -> ReplayResult:
    """Send ``requests[i]`` with ``prompts[i]`` at its ``arrival_s`` after the start.

    Args:
        requests: sorted by ``arrival_s`` (seconds).
        prompts: one prompt per request.
        config: endpoint, model and limits.
        on_done: called with each record as its request finishes (e.g. a progress bar).
        sampler: polls the server from the start until every request has finished, then once
            more; its samples stay on it (times in seconds since the same start).

    Returns:
        Records in trace order and the wall time from the start to the last finished request.

    Raises:
        ValueError: ``requests`` and ``prompts`` differ in length.
    """
    if len(requests) != len(prompts):
        raise ValueError(f"{len(requests)} requests but {len(prompts)} prompts")
    records = [RequestRecord(i, r.arrival_s, r.input_len, r.output_len,  # a --class rule wins over the trace's
                             traffic_class=config.classes.class_for(r.input_len) or r.traffic_class, tenant=r.tenant)
               for i, r in enumerate(requests)]

    async def one(record: RequestRecord, prompt: str, session: aiohttp.ClientSession,
                  clock_zero: float) -> None:
        await send_request(session, config, record, prompt, clock_zero)
        if on_done is not None:
            on_done(record)

    connector = aiohttp.TCPConnector(limit=0)  # open loop: never queue requests client-side
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        clock_zero = time.perf_counter()
        if sampler is not None:
            sampler.start(session, clock_zero)
        tasks = []
        for record, prompt in zip(records, prompts):
            delay = clock_zero + record.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(record, prompt, session, clock_zero)))
        await asyncio.gather(*tasks)
        duration_s = time.perf_counter() - clock_zero
        if sampler is not None:
            await sampler.stop()
    return ReplayResult(records, duration_s)
