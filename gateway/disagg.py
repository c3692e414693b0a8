"""Disaggregated serving at the gateway: which requests are prefilled on a prefill replica, and how.

A pool with replicas in the ``prefill`` role serves a completion in two calls when the selective
rule says it pays:

1. **Prefill.** The gateway sends the request's body as it is to the least busy prefill replica,
   with ``x-cadenza-kv-publish: 1``. The replica validates it as the decode call will be (a bad
   request is refused before anything is computed), and once its engine has queued it, streams a
   one-token answer whose headers say where the prompt's KV will be (``x-cadenza-kv-source``);
   then it computes it, holding each block under a lease as soon as a step has written it. The
   gateway reads that call to its end in the background. A replica whose queue is full answers
   429 instead (never a 200 whose KV never comes): the gateway backs off from it for its
   ``Retry-After`` and tries the next prefill replica, and with none left the decode replica
   prefills the prompt at once (``fallback_busy``).
2. **Decode.** Right after those headers, the gateway sends the original request to a decode
   replica of the request's class, naming that source. The decode replica pulls the prompt's
   blocks while they are being computed (the transfer overlaps the prefill), prefills only the
   prompt's last token, and streams the answer to the client. From the client's side this is one
   ordinary stream.

Any failure of the prefill call falls back to step 2 without a source: the decode replica then
prefills the prompt itself, so the client gets the same answer, only later. A prefill replica
that is down or backed off is never picked, and one that sends no headers within
:data:`HEADERS_TIMEOUT_S` is given up on. When the decode call ends, however it ends, the prefill call is closed, so the
prefill replica stops computing a prompt nobody waits for. Both calls carry the
pool's bearer token (``$CADENZA_ADMIN_TOKEN``), which replicas require before they move KV.

The rule (:mod:`cadenza.node.kv_transfer.threshold`): a prompt goes through a prefill replica
when it is at least ``--disagg-min-prompt-tokens`` long. Pinned, that is a number. With ``auto``
the decode replicas send the rule's coefficients on every answer (``x-cadenza-disagg-rule``:
their step-time model, KV bytes per token over the bandwidth their pulls measured, the prompt's
last token computed where it decodes) and the gateway solves it for the prefill replica it would use, whose queue is the prompts
this gateway has sent it that it is still computing (their predicted prefill seconds). It takes
the largest threshold over the reachable decode replicas, so a prompt moves only when it pays on
each of them, and none until one has calibrated. So a busy prefill replica is sent only the
prompts that pay even after its queue, and the rest are prefilled where they decode. The prefill
replica is the one with the fewest queued prompt tokens. No prompt is moved while none of the
request's decode replicas could take it (all down, full, or loading: a 503 with
``Retry-After``): its prefill would be thrown away.

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
from cadenza.gateway.state import METRICS, PREFILL_CALLS, SESSION, SETTINGS, UPSTREAMS
from cadenza.gateway.upstreams import SERVING_ROLES, Upstream
from cadenza.node.kv_transfer.threshold import Rule
from cadenza.node.http.hardening import body_timeout
from cadenza.node.server.auth import admin_token
from cadenza.node.wire import KV_PUBLISH_HEADER, KV_SOURCE_HEADER

logger = logging.getLogger(__name__)

CHARS_PER_TOKEN = 4  # the usual BPE average for English text, for prompts sent as text
PREFILL_TIMEOUT_S = 120.0  # a prefill call that takes longer falls back to local prefill
HEADERS_TIMEOUT_S = 5.0  # a prefill replica answers once it queued the prompt, before it prefills: longer is a hung one
# the request's prefill call being read, in the request's storage
PREFILL_TASK: web.RequestKey[asyncio.Task] = web.RequestKey("cadenza_prefill_call", asyncio.Task)
DISAGG_PATHS = ("/v1/completions", "/v1/chat/completions")


def threshold(app: web.Application, prefill: Upstream | None = None) -> int | None:
    """The shortest prompt sent through ``prefill`` now (None: an idle prefill replica): pinned,
    or with ``auto`` the largest the reachable serving replicas' rules give with ``prefill``'s
    queue (None: never, or no rule reported yet)."""
    pinned = app[SETTINGS].disagg_min_prompt_tokens
    if pinned != "auto":
        return pinned
    queued = (0, 0.0) if prefill is None else (prefill.queued_tokens, prefill.queued_pairs)
    found = [rule.min_prompt_tokens(rule.queue_s(*queued)) for rule in _rules(app)]
    return None if not found or None in found else max(found)


def _rules(app: web.Application) -> list[Rule]:
    upstreams = app[UPSTREAMS]
    return [u.disagg_rule for u in {id(u): u for role in SERVING_ROLES for u in upstreams.reachable(role)}.values()
            if u.disagg_rule is not None]


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


async def route(request: web.Request, decode: list[Upstream]) -> CIMultiDict[str] | None:
    """The extra headers of the decode call when this request goes through a prefill replica
    (the prefill call made), else None: no prefill replica free, none of ``decode`` (the
    request's decode replicas) able to take it, a short prompt, not a completion."""
    app = request.app
    if request.method != "POST" or request.path not in DISAGG_PATHS or not app[UPSTREAMS].of_role("prefill"):
        return None
    now, limit = app[UPSTREAMS].clock(), app[SETTINGS].max_outstanding
    if not any(not u.is_down and not u.is_full(limit, now) and now >= u.unready_until for u in decode):
        return None  # the decode call fails or waits: a prefill now would be thrown away
    async with body_timeout(request):
        body = await request.read()  # read once: forward() gets the same bytes
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return None  # the decode replica answers the 400
    if not isinstance(parsed, dict):
        return None
    tokens = prompt_tokens(parsed)
    if (idle := threshold(app)) is None or tokens < idle:
        return None  # not worth moving even to an idle prefill replica
    full: list[Upstream] = []  # prefill replicas that answered 429 to this request
    while (upstream := app[UPSTREAMS].least_queued(app[UPSTREAMS].of_role("prefill"), limit, full)) is not None:
        if tokens < threshold(app, upstream):  # a queue only raises the threshold (never to None)
            app[METRICS].count_disagg("kept_queued")
            return None
        try:
            source = await prefill(request, parsed, upstream, tokens)
        except PrefillFull:
            full.append(upstream)
            continue
        return None if source is None else CIMultiDict({**_auth(), KV_SOURCE_HEADER: source})
    app[METRICS].count_disagg("fallback_busy")
    return None


def cancel_prefill(request: web.Request) -> None:
    """The decode call has ended (answered, failed, or its client left): stop reading this
    request's prefill call, so the prefill replica aborts it and frees its KV now."""
    task = request.get(PREFILL_TASK)
    if task is not None and not task.done():
        task.cancel()


class PrefillFull(Exception):
    """The prefill replica's queue is full (it answered 429, and is backed off from): try another."""


async def prefill(request: web.Request, parsed: dict, upstream: Upstream, tokens: int) -> str | None:
    """Run the prefill call of a ``tokens``-token prompt on ``upstream``; the
    ``x-cadenza-kv-source`` to hand the decode replica, or None to fall back (the call failed:
    logged and counted).

    Raises:
        PrefillFull: ``upstream`` answered 429 (its engine refused to queue the prompt; nothing
            was published there): counted by the caller, who picks another or falls back.
    """
    app = request.app
    upstreams, metrics = app[UPSTREAMS], app[METRICS]
    headers = request_headers(request.headers, request.remote)
    headers.update(_auth())
    headers[KV_PUBLISH_HEADER] = "1"
    queued = _Queued(upstream, tokens)
    try:  # its headers come at once (before the prefill): a replica that sends none is hung
        resp = await asyncio.wait_for(app[SESSION].post(upstream.url + request.path, json=parsed, headers=headers,
                                                        timeout=aiohttp.ClientTimeout(total=PREFILL_TIMEOUT_S)),
                                      HEADERS_TIMEOUT_S)
    except (aiohttp.ClientError, TimeoutError) as exc:
        queued.done()
        logger.warning("prefill replica %s failed: %r; prefilling on the decode replica", upstream.url, exc)
        upstreams.unreachable(upstream)
        metrics.count_disagg("fallback_failed")
        return None
    except BaseException:  # cancelled: the client left; nobody will read this call
        queued.done()
        raise
    upstreams.answered(upstream)
    if resp.status == 429:
        resp.close()
        queued.done()
        upstreams.back_off(upstream, retry_after_s(resp.headers.get("Retry-After")))
        raise PrefillFull(upstream.url)
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
    task = asyncio.create_task(_finish(resp, upstream, queued))
    request[PREFILL_TASK] = task
    app[PREFILL_CALLS].add(task)
    task.add_done_callback(app[PREFILL_CALLS].discard)
    return source if resp.status == 200 else None


class _Queued:
    """A prompt in a prefill replica's queue, as this gateway counts it: in flight and queued
    from the call's start to its end."""

    def __init__(self, upstream: Upstream, tokens: int) -> None:
        self.upstream, self.tokens = upstream, tokens
        upstream.outstanding += 1
        upstream.queue_prompt(tokens)

    def done(self) -> None:
        self.upstream.outstanding -= 1
        self.upstream.unqueue_prompt(self.tokens)


async def _finish(resp: aiohttp.ClientResponse, upstream: Upstream, queued: _Queued) -> None:
    try:
        await resp.read()
    except (aiohttp.ClientError, TimeoutError) as exc:  # the decode side recomputes what it lacks
        logger.warning("prefill call on %s broke off: %r", upstream.url, exc)
    finally:
        resp.close()
        queued.done()


def _auth() -> dict[str, str]:
    token = admin_token()
    return {"Authorization": f"Bearer {token}"} if token else {}

