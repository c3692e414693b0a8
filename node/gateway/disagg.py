"""Disaggregated serving at the gateway: which requests are prefilled on a prefill replica, and how.

A pool with replicas in the ``prefill`` role serves a completion in two calls when the selective
rule says it pays:

1. **Prefill.** The gateway sends the request's body to the least busy prefill replica as a
   streamed call for one token, with ``x-cadenza-kv-publish: 1``. The replica answers at once
   where the prompt's KV will be (``x-cadenza-kv-source``), then computes it, holding each block
   under a lease as soon as a step has written it. The gateway reads that call to its end in the
   background.
2. **Decode.** Right after those headers, the gateway sends the original request to a decode
   replica of the request's class, naming that source. The decode replica pulls the prompt's
   blocks while they are being computed (the transfer overlaps the prefill), prefills only the
   prompt's last block, and streams the answer to the client. From the client's side this is one
   ordinary stream.

Any failure of the prefill call falls back to step 2 without a source: the decode replica then
prefills the prompt itself, so the client gets the same answer, only later. A prefill replica
that is down is never picked, and one that sends no headers within :data:`HEADERS_TIMEOUT_S` is
given up on. When the decode call ends, however it ends, the prefill call is closed, so the
prefill replica stops computing a prompt nobody waits for. Both calls carry the
pool's bearer token (``$CADENZA_ADMIN_TOKEN``), which replicas require before they move KV.

The rule (:mod:`cadenza.node.kv_transfer.threshold`): a prompt goes through a prefill replica
when it is at least ``--disagg-min-prompt-tokens`` long. Pinned, that is a number; ``auto`` takes
the threshold the decode replicas compute from their step-time model and the bandwidth their
pulls measured (they send it on every answer, ``x-cadenza-disagg-min-prompt-tokens``): the
largest any reachable one reported, so a prompt moves only when it pays on each of them, and
none until one has calibrated. The gateway counts a prompt's tokens exactly when they are token
ids; for text it estimates one token per :data:`CHARS_PER_TOKEN` characters, because it has no
tokenizer. It cannot see the decode replica's prefix cache, so it counts every token as
uncached.

Sources: DistServe (Zhong et al., OSDI 2024) and Splitwise (Patel et al., ISCA 2024) for
splitting the phases; llm-d's selective P/D threshold and Dynamo's prefill-length rule for
moving only long prompts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from cadenza.node.gateway.headers import request_headers
from cadenza.node.gateway.state import METRICS, PREFILL_CALLS, SESSION, SETTINGS, UPSTREAMS
from cadenza.node.gateway.upstreams import SERVING_ROLES
from cadenza.node.server.http import body_timeout
from cadenza.node.server.auth import admin_token
from cadenza.node.wire import KV_PUBLISH_HEADER, KV_SOURCE_HEADER

logger = logging.getLogger(__name__)

CHARS_PER_TOKEN = 4  # the usual BPE average for English text, for prompts sent as text
PREFILL_TIMEOUT_S = 120.0  # a prefill call that takes longer falls back to local prefill
HEADERS_TIMEOUT_S = 5.0  # a prefill replica answers its headers before it prefills: longer is a hung one
PREFILL_TASK = "cadenza_prefill_call"  # the request's prefill call being read, in the request's storage
DISAGG_PATHS = ("/v1/completions", "/v1/chat/completions")


def threshold(app: web.Application) -> int | None:
    """The shortest prompt sent through a prefill replica now: pinned, or with ``auto`` the
    largest the reachable serving replicas reported (None: never, or none reported yet)."""
    pinned = app[SETTINGS].disagg_min_prompt_tokens
    if pinned != "auto":
        return pinned
    upstreams = app[UPSTREAMS]
    reported = [u.disagg_min_prompt_tokens for role in SERVING_ROLES for u in upstreams.reachable(role)
                if u.disagg_min_prompt_tokens is not None]
    return max(reported, default=None)


def prompt_tokens(body: object) -> int:
    """The prompt's length in tokens: exact for token ids, estimated for text (0 when unreadable)."""
    if not isinstance(body, dict):
        return 0
    prompt = body.get("prompt")
    if prompt is None and isinstance(body.get("messages"), list):
        prompt = " ".join(str(m.get("content", "")) for m in body["messages"] if isinstance(m, dict))
    if isinstance(prompt, list):
        if all(isinstance(t, int) for t in prompt):
            return len(prompt)
        return max((prompt_tokens({"prompt": p}) for p in prompt), default=0)
    if isinstance(prompt, str):
        return math.ceil(len(prompt) / CHARS_PER_TOKEN)
    return 0


async def route(request: web.Request) -> CIMultiDict[str] | None:
    """The extra headers of the decode call when this request goes through a prefill replica
    (the prefill call made), else None: no prefill replica, a short prompt, not a completion."""
    if request.method != "POST" or request.path not in DISAGG_PATHS or not request.app[UPSTREAMS].of_role("prefill"):
        return None
    if (least := threshold(request.app)) is None:
        return None
    async with body_timeout(request):
        body = await request.read()  # read once: forward() gets the same bytes
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return None  # the decode replica answers the 400
    if not isinstance(parsed, dict) or prompt_tokens(parsed) < least:
        return None
    source = await prefill(request, parsed)
    return None if source is None else CIMultiDict({**_auth(), KV_SOURCE_HEADER: source})


def cancel_prefill(request: web.Request) -> None:
    """The decode call has ended (answered, failed, or its client left): stop reading this
    request's prefill call, so the prefill replica aborts it and frees its KV now."""
    task = request.get(PREFILL_TASK)
    if task is not None and not task.done():
        task.cancel()


async def prefill(request: web.Request, parsed: dict) -> str | None:
    """Run the prefill call; the ``x-cadenza-kv-source`` to hand the decode replica, or None to
    fall back (no prefill replica free, or the call failed: logged and counted)."""
    app = request.app
    upstreams, settings, metrics = app[UPSTREAMS], app[SETTINGS], app[METRICS]
    live = [u for u in upstreams.of_role("prefill") if not u.is_down]  # never a down one: decoding here is better
    upstream = upstreams.pick(live, settings.max_outstanding)
    if upstream is None:
        metrics.count_disagg("fallback_busy")
        return None
    body = {**parsed, "max_tokens": 1, "stream": True}
    body.pop("stream_options", None)
    body.pop("max_completion_tokens", None)
    headers = request_headers(request.headers, request.remote)
    headers.update(_auth())
    headers[KV_PUBLISH_HEADER] = "1"
    upstream.outstanding += 1
    try:  # its headers come at once (before the prefill): a replica that sends none is hung
        resp = await asyncio.wait_for(app[SESSION].post(upstream.url + request.path, json=body, headers=headers,
                                                        timeout=aiohttp.ClientTimeout(total=PREFILL_TIMEOUT_S)),
                                      HEADERS_TIMEOUT_S)
    except (aiohttp.ClientError, TimeoutError) as exc:
        upstream.outstanding -= 1
        logger.warning("prefill replica %s failed: %r; prefilling on the decode replica", upstream.url, exc)
        upstreams.unreachable(upstream)
        metrics.count_disagg("fallback_failed")
        return None
    upstreams.answered(upstream)
    source = resp.headers.get(KV_SOURCE_HEADER)
    if 400 <= resp.status < 500 and resp.status != 429:  # the request's own fault: decode answers it alike
        metrics.count_disagg("fallback_refused")
    elif resp.status != 200 or source is None:
        logger.warning("prefill replica %s answered %d%s; prefilling on the decode replica", upstream.url,
                       resp.status, "" if source else " without a KV source")
        metrics.count_disagg("fallback_failed")
    else:
        metrics.count_disagg("prefilled")
    # read the prefill call to its end while the decode call runs (closing it early would abort it)
    task = asyncio.create_task(_finish(resp, upstream))
    request[PREFILL_TASK] = task
    app[PREFILL_CALLS].add(task)
    task.add_done_callback(app[PREFILL_CALLS].discard)
    return source if resp.status == 200 else None


async def _finish(resp: aiohttp.ClientResponse, upstream) -> None:
    try:
        await resp.read()
    except (aiohttp.ClientError, TimeoutError) as exc:  # the decode side recomputes what it lacks
        logger.warning("prefill call on %s broke off: %r", upstream.url, exc)
    finally:
        resp.close()
        upstream.outstanding -= 1


def _auth() -> dict[str, str]:
    token = admin_token()
    return {"Authorization": f"Bearer {token}"} if token else {}

