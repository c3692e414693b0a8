"""Disaggregated serving at the gateway: the prefill call of a prompt the router moves.

A pool with replicas in the ``prefill`` role serves a completion in two calls when the selective
rule says it pays (the decision, its threshold and the choice of prefill replica are the
router's: :mod:`.router`):

1. **Prefill.** The gateway sends the request's body as it is to the prefill replica the router
   chose (the least queued), with ``x-cadenza-kv-publish: 1``. The replica validates it as the
   decode call will be (a bad request is refused before anything is computed), and once its
   engine has queued it, streams a one-token answer whose headers say where the prompt's KV will
   be (``x-cadenza-kv-source``); then it computes it, holding each block under a lease as soon as
   a step has written it. The gateway reads that call to its end in the background. A replica
   whose queue is full answers 429 instead (never a 200 whose KV never comes): the router backs
   off from it for its ``Retry-After`` and chooses the next prefill replica, and with none left
   the decode replica prefills the prompt at once (``fallback_busy``).
2. **Decode.** Right after those headers, the gateway sends the original request to the decode
   replica the router chose for the request's class, naming that source. The router chose (and
   counts) that replica with the prefill replica, before the prefill call: a request no decode
   replica could take is refused before any prefill is spent on it, and requests arriving during
   the prefill call see the replica as busy. The decode replica
   pulls the prompt's blocks while they are being computed (the transfer overlaps the prefill),
   prefills only the prompt's last token, and streams the answer to the client. From the
   client's side this is one ordinary stream.

Any failure of the prefill call falls back to step 2 without a source: the decode replica then
prefills the prompt itself, so the client gets the same answer, only later. One that sends no
headers within :data:`HEADERS_TIMEOUT_S` is given up on. When the decode call ends, however it
ends, the prefill call is closed, so the prefill replica stops computing a prompt nobody waits
for. Both calls carry the pool's bearer token (``$CADENZA_ADMIN_TOKEN``), which replicas require
before they move KV. With ``--disagg-min-prompt-tokens auto`` the decode replicas send the rule's
coefficients on every answer (``x-cadenza-disagg-rule``: their step-time model, KV bytes per
token over the bandwidth their pulls measured, the prompt's last token computed where it
decodes), which the proxy keeps on their :class:`~cadenza.gateway.upstreams.Upstream` for the
router.

The gateway counts a prompt's tokens exactly when they are token ids; for text it estimates one
token per :data:`CHARS_PER_TOKEN` characters, because it has no tokenizer. It cannot see the
decode replica's prefix cache, so it counts every token as uncached.

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

from cadenza.gateway.headers import request_headers, retry_after_s
from cadenza.gateway.router import Route, Router
from cadenza.gateway.state import METRICS, PREFILL_CALLS, ROUTER, SESSION, UPSTREAMS
from cadenza.gateway.upstreams import Upstream
from cadenza.node.credentials import admin_token
from cadenza.node.wire import KV_PUBLISH_HEADER, KV_SOURCE_HEADER

logger = logging.getLogger(__name__)

CHARS_PER_TOKEN = 4  # the usual BPE average for English text, for prompts sent as text
PREFILL_TIMEOUT_S = 120.0  # a prefill call that takes longer falls back to local prefill
HEADERS_TIMEOUT_S = 5.0  # a prefill replica answers once it queued the prompt, before it prefills: longer is a hung one
# the request's prefill call being read, in the request's storage
PREFILL_TASK: web.RequestKey[asyncio.Task] = web.RequestKey("cadenza_prefill_call", asyncio.Task)
DISAGG_PATHS = ("/v1/completions", "/v1/chat/completions")


def prompt_tokens(body: object) -> int:
    """The prompt's length in tokens: exact for token ids, estimated for text; of a batch of
    prompts, the longest. 0 when unreadable (the replica answers the 400)."""
    if not isinstance(body, dict):
        return 0
    prompt = body.get("prompt")
    if prompt is None and isinstance(body.get("messages"), list):
        prompt = " ".join(str(m.get("content", "")) for m in body["messages"] if isinstance(m, dict))
    prompts = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
    return max(map(_one_prompt_tokens, prompts), default=0)  # one level: the API nests no deeper


def _one_prompt_tokens(prompt: object) -> int:
    if isinstance(prompt, str):
        return math.ceil(len(prompt) / CHARS_PER_TOKEN)
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    return 0


def prompt_of(request: web.Request, body: bytes) -> tuple[dict | None, int]:
    """The parsed body of a completion whose prompt a prefill replica could take, and the
    prompt's tokens (:func:`prompt_tokens`); ``(None, 0)`` for any other request: not a
    completion, a pool without prefill replicas, a body that is not a JSON object (the decode
    replica answers its 400)."""
    if request.method != "POST" or request.path not in DISAGG_PATHS or not request.app[UPSTREAMS].of_role("prefill"):
        return None, 0
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return None, 0
    if not isinstance(parsed, dict):
        return None, 0
    return parsed, prompt_tokens(parsed)


async def prefill_first(request: web.Request, route: Route, parsed: dict | None) -> CIMultiDict[str] | None:
    """Prefill ``route``'s prompt (``parsed``: the request's body) on the prefill replica the
    router chose, then on the next one it chooses while they refuse it. The extra headers of the
    decode call naming the KV's source; None when the prompt is prefilled where it decodes (the
    router kept it there, or the call failed: counted)."""
    app = request.app
    while route.prefill is not None:
        try:
            source = await prefill(request, parsed, route)
        except PrefillFull as full:
            app[ROUTER].refused(route, app[UPSTREAMS].clock(), full.retry_after_s)
            continue
        return None if source is None else CIMultiDict({**_auth(), KV_SOURCE_HEADER: source})
    if route.kept is not None:
        app[METRICS].count_disagg(route.kept)
    return None


def cancel_prefill(request: web.Request) -> None:
    """The decode call has ended (answered, failed, or its client left): stop reading this
    request's prefill call, so the prefill replica aborts it and frees its KV now."""
    task = request.get(PREFILL_TASK)
    if task is not None and not task.done():
        task.cancel()


class PrefillFull(Exception):
    """The prefill replica's queue is full (it answered 429 with ``retry_after_s``): try another."""

    def __init__(self, url: str, retry_after_s: float) -> None:
        super().__init__(url)
        self.retry_after_s = retry_after_s


async def prefill(request: web.Request, parsed: dict, route: Route) -> str | None:
    """Run the prefill call of ``route``'s prompt on ``route.prefill``; the
    ``x-cadenza-kv-source`` to hand the decode replica, or None to fall back (the call failed:
    logged and counted). The router's count of the call ends with it.

    Raises:
        PrefillFull: the replica answered 429 (its engine refused to queue the prompt; nothing
            was published there): the caller has the router back off from it and choose another.
    """
    app = request.app
    upstreams, router, metrics = app[UPSTREAMS], app[ROUTER], app[METRICS]
    upstream = route.prefill
    headers = request_headers(request.headers, request.remote)
    headers.update(_auth())
    headers[KV_PUBLISH_HEADER] = "1"
    try:  # its headers come at once (before the prefill): a replica that sends none is hung
        resp = await asyncio.wait_for(app[SESSION].post(upstream.url + request.path, json=parsed, headers=headers,
                                                        timeout=aiohttp.ClientTimeout(total=PREFILL_TIMEOUT_S)),
                                      HEADERS_TIMEOUT_S)
    except (aiohttp.ClientError, TimeoutError) as exc:
        router.prefill_done(route)
        logger.warning("prefill replica %s failed: %r; prefilling on the decode replica", upstream.url, exc)
        upstreams.unreachable(upstream)
        metrics.count_disagg("fallback_failed")
        return None
    except BaseException:  # cancelled: the client left; nobody will read this call
        router.prefill_done(route)
        raise
    upstreams.answered(upstream)
    if resp.status == 429:
        resp.close()
        raise PrefillFull(upstream.url, retry_after_s(resp.headers.get("Retry-After")))
    source = resp.headers.get(KV_SOURCE_HEADER)
    if 400 <= resp.status < 500:  # the request's own fault: decode answers it alike
        metrics.count_disagg("fallback_refused")
    elif resp.status != 200 or source is None:
        logger.warning("prefill replica %s answered %d%s; prefilling on the decode replica", upstream.url,
                       resp.status, "" if source else " without a KV source")
        metrics.count_disagg("fallback_failed")
    else:
        metrics.count_disagg("prefilled")
    # read the prefill call to its end while the decode call runs (closing it early would abort it)
    task = asyncio.create_task(_finish(resp, upstream, route, router))
    request[PREFILL_TASK] = task
    app[PREFILL_CALLS].add(task)
    task.add_done_callback(app[PREFILL_CALLS].discard)
    return source if resp.status == 200 else None


async def _finish(resp: aiohttp.ClientResponse, upstream: Upstream, route: Route, router: Router) -> None:
    try:
        await resp.read()
    except (aiohttp.ClientError, TimeoutError) as exc:  # the decode side recomputes what it lacks
        logger.warning("prefill call on %s broke off: %r", upstream.url, exc)
    finally:
        resp.close()
        router.prefill_done(route)


def _auth() -> dict[str, str]:
    token = admin_token()
    return {"Authorization": f"Bearer {token}"} if token else {}
