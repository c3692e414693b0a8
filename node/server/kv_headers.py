"""The HTTP side of disaggregated serving: what a gateway tells a prefill and a decode replica.

- ``x-cadenza-kv-publish: 1`` on a completion call: run it (the gateway asks for one token) and
  hold its prompt's KV for a decode replica to pull. The response says where, in
  ``x-cadenza-kv-source``; it is streamed and sends its headers as soon as the engine core has
  queued the request — admitted first, then answered: a full queue is a 429 with ``Retry-After``,
  never a 200 whose KV never comes — and before the prompt is prefilled, so the decode replica
  can pull each block as soon as it is computed (an error after that, such as a failed step,
  comes as an SSE ``error`` event).
- ``x-cadenza-kv-source: kv://HOST:PORT/REQUEST_ID?boot=BOOT_ID&tokens=N`` on a completion call:
  pull the prompt's KV from that replica instead of prefilling it here; whatever cannot be pulled
  is prefilled here, so the answer is the same either way.

Both headers make this replica hold memory or open connections on another's behalf, so both
need the pool's bearer token (:mod:`.auth`). A replica started without a KV transfer endpoint
(``--kv-transfer-port``) answers 400 to either.
"""

from __future__ import annotations

from urllib.parse import parse_qs, quote, unquote, urlsplit

from aiohttp import web

from cadenza.node.core.messages import KVEndpoint
from cadenza.node.core.request import RemoteKV
from cadenza.node.server.auth import authorize
from cadenza.node.http.errors import APIError
from cadenza.node.wire import KV_PUBLISH_HEADER, KV_SOURCE_HEADER

MAX_HEADER_CHARS = 512


def format_source(source: RemoteKV) -> str:
    """``source`` as the ``x-cadenza-kv-source`` value."""
    host = f"[{source.host}]" if ":" in source.host else source.host
    return (f"kv://{host}:{source.port}/{quote(source.request_id, safe='')}"
            f"?boot={quote(source.boot_id, safe='')}&tokens={source.num_tokens}")


def parse_source(value: str) -> RemoteKV:
    """The :class:`RemoteKV` an ``x-cadenza-kv-source`` value names, or a 400 :class:`APIError`."""
    def bad(why: str) -> APIError:
        return APIError(400, f"{KV_SOURCE_HEADER}: {why} (expected kv://HOST:PORT/REQUEST_ID?boot=ID&tokens=N)",
                        code="invalid_kv_source")

    if len(value) > MAX_HEADER_CHARS:
        raise bad(f"longer than {MAX_HEADER_CHARS} characters")
    try:
        url = urlsplit(value)
        port = url.port
    except ValueError as exc:
        raise bad(str(exc)) from None
    query = parse_qs(url.query, strict_parsing=False)
    boot, tokens = query.get("boot", [""])[0], query.get("tokens", [""])[0]
    request_id = unquote(url.path.lstrip("/"))
    if url.scheme != "kv" or not url.hostname or port is None or not request_id or not boot:
        raise bad(f"{value!r} is not a KV source")
    if not (tokens.isascii() and tokens.isdigit()) or int(tokens) < 1:
        raise bad(f"tokens must be a positive integer, got {tokens!r}")
    return RemoteKV(url.hostname, port, request_id, boot, int(tokens))


def kv_options(request: web.Request, endpoint: KVEndpoint | None) -> tuple[RemoteKV | None, bool]:
    """``(remote_kv, publish_kv)`` the call's headers ask for; ``endpoint`` is this replica's
    KV transfer endpoint (``EngineReady.kv_transfer``; None: it has none).

    Raises:
        APIError: 401 without the pool's token, 400 for a malformed header or no endpoint.
    """
    publish, source = request.headers.get(KV_PUBLISH_HEADER), request.headers.get(KV_SOURCE_HEADER)
    if publish is None and source is None:
        return None, False
    authorize(request, "KV transfer")
    if endpoint is None:
        raise APIError(400, "this replica has no KV transfer endpoint (start it with --kv-transfer-port)",
                       code="kv_transfer_off")
    if publish is not None and publish.strip() not in ("1", "true"):
        raise APIError(400, f"{KV_PUBLISH_HEADER}: must be 1, got {publish!r}", code="invalid_kv_publish")
    return (None if source is None else parse_source(source)), publish is not None
