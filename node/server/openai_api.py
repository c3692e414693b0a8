"""``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models`` handlers.

Responses follow the OpenAI API reference: ``text_completion`` / ``chat.completion`` objects,
or server-sent events of ``*.chunk`` objects ending with ``data: [DONE]``; with
``stream_options.include_usage`` every chunk carries ``"usage": null`` and a last chunk with empty
``choices`` carries ``usage``. A call of ``n`` choices is one engine call whose outputs carry
their choice's index (:mod:`.choices` gathers them): each choice streams its own chunks and ends
with its own ``finish_reason``; usage counts the prompt once.
A client that disconnects cancels its handler, which closes the engine stream and aborts the
request (its KV blocks are freed before the next step).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, replace

from aiohttp import web

from cadenza.node.core.admission import AdmissionError
from cadenza.node.core.policy import DEFAULT_TENANT, PolicyError, check_class, check_tenant
from cadenza.node.core.request import RemoteKV, SamplingParams, StructuredOutput
from cadenza.node.core.structured import GrammarError
from cadenza.node.core.structured import check as check_grammar
from cadenza.node.frontend.client import EngineDeadError, Queued
from cadenza.node.frontend.input_processor import InputError, InputProcessor
from cadenza.node.server.access_log import ACCESS
from cadenza.node.server import tool_calls
from cadenza.node.server.app_keys import DEFAULT_CLASS, ENGINE, MODEL_NAME, STARTED, TELEMETRY, TOOL_PARSER
from cadenza.node.server.choices import Choices
from cadenza.node.http.errors import APIError, error_body
from cadenza.node.http.hardening import send
from cadenza.node.server.json_body import read_json
from cadenza.node.server.kv_headers import format_source, kv_options
from cadenza.node.server.protocol import ChatCompletionRequest, CompletionRequest, check_sizes, parse
from cadenza.node.wire import (CLASS_HEADER, DISAGG_RULE_HEADER, KV_SOURCE_HEADER, REQUEST_ID_HEADER, TENANT_HEADER,
                               TRACEPARENT_HEADER)


@dataclass(slots=True)
class _Call:
    """One validated generation call, ready for the engine."""

    kind: str  # "text_completion" | "chat.completion"
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    traffic_class: str
    tenant: str
    arrival: float  # time.monotonic() when the HTTP request arrived
    cache_salt: str | None = None
    n: int = 1  # choices: sequences sharing one prefill
    tools: Callable[[], tool_calls.ToolCallOutput] | None = None  # a chat choice's tool-call parsing, made per choice


def _class_and_tenant(request: web.Request) -> tuple[str, str]:
    """The request's traffic class and tenant from the ``x-cadenza-*`` headers (400 if invalid)."""
    cls = request.headers.get(CLASS_HEADER, request.app[DEFAULT_CLASS])
    tenant = request.headers.get(TENANT_HEADER, DEFAULT_TENANT)
    try:
        cls, tenant = check_class(cls), check_tenant(tenant)
        request.get(ACCESS, {}).update({"class": cls, "tenant": tenant})
        return cls, tenant
    except PolicyError as exc:
        header = CLASS_HEADER if exc.field == "class" else TENANT_HEADER
        raise APIError(400, f"{header}: {exc.reason}", param=header) from None


async def completions(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    inputs = _ready_inputs(request)
    traffic_class, tenant = _class_and_tenant(request)
    body = await _body(request, CompletionRequest, inputs.max_model_len)
    _check_model(request, body.model)
    body.check_supported()
    await _check_grammar(body.structured)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    with _traced(request, request_id, "text_completion", body, body.max_tokens, traffic_class, tenant, arrival):
        with _input_errors():
            prompt_ids = await inputs.prompt(body.prompt)
            sampling = inputs.sampling(body, len(prompt_ids), body.max_tokens, default_fill=False)
        call = _Call("text_completion", request_id, prompt_ids, sampling, body.stream, body.include_usage,
                     traffic_class, tenant, arrival, body.cache_salt, body.n)
        return await _respond(request, call)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    inputs = _ready_inputs(request)
    traffic_class, tenant = _class_and_tenant(request)
    body = await _body(request, ChatCompletionRequest, inputs.max_model_len)
    _check_model(request, body.model)
    body.check_supported()
    await _check_grammar(body.structured)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    with _traced(request, request_id, "chat", body, body.requested_max_tokens, traffic_class, tenant, arrival):
        tools = tool_calls.prepare(body, inputs.tokenizer.chat_template, request.app[TOOL_PARSER])
        await _check_grammar(tools.structured, "tools")  # tool_choice required or a named function
        with _input_errors():
            prompt_ids = await inputs.chat(tools.messages, **tools.template_extra)
            sampling = inputs.sampling(body, len(prompt_ids), body.requested_max_tokens, default_fill=True)
        if tools.structured is not None:  # it holds the output, over any response_format
            sampling = replace(sampling, structured=tools.structured)
        call = _Call("chat.completion", request_id, prompt_ids, sampling, body.stream, body.include_usage,
                     traffic_class, tenant, arrival, body.cache_salt, body.n, tools=tools.output)
        return await _respond(request, call)


async def models(request: web.Request) -> web.Response:
    """The served model's card: OpenAI's ``id``, ``object``, ``created`` (when this server
    started, Unix seconds) and ``owned_by``, with vLLM's ``root``, ``parent`` and
    ``max_model_len``."""
    client = request.app[ENGINE]
    name = request.app[MODEL_NAME]
    card = {"id": name, "object": "model", "created": request.app[STARTED], "owned_by": "cadenza",
            "root": name, "parent": None}
    if client.info is not None:
        card["max_model_len"] = client.info.max_model_len
    return web.json_response({"object": "list", "data": [card]})


# -- helpers ---------------------------------------------------------------------------------------


@contextmanager
def _traced(request: web.Request, request_id: str, operation: str, body, max_tokens: int | None,
            traffic_class: str, tenant: str, arrival: float):
    """The request's span: opened here, ended with its last output — or here, on an error."""
    telemetry = request.app[TELEMETRY]
    telemetry.start_request(request_id, operation, request.headers, max_tokens=max_tokens,
                            temperature=body.temperature, top_p=body.top_p, traffic_class=traffic_class,
                            tenant=tenant, arrival=arrival)
    try:
        yield
    except APIError as exc:
        telemetry.fail_request(request_id, exc.code or str(exc.status), exc.message)
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        telemetry.fail_request(request_id, "cancelled", "the client went away")
        raise
    except Exception as exc:
        telemetry.fail_request(request_id, type(exc).__name__, str(exc))
        raise


@contextmanager
def _input_errors():
    """The input processor's refusals as OpenAI errors."""
    try:
        yield
    except InputError as exc:
        raise APIError(exc.status, exc.message, param=exc.param, code=exc.code) from None


async def _body(request: web.Request, model: type, max_model_len: int):
    """The request body, read within the body timeout, parsed and validated as ``model`` (off
    the event loop when large: :func:`~cadenza.node.server.json_body.read_json`).

    Raises:
        APIError: 408 (body too slow), 400 (not JSON, too large a shape, invalid fields).
    """
    def validated(data):
        if isinstance(data, dict):
            check_sizes(data, max_model_len)
        return parse(model, data)

    return await read_json(request, validated)


async def _check_grammar(structured: StructuredOutput | None, param: str = "response_format") -> None:
    """Refuse a constraint the engine cannot compile, off the event loop (a compile of a large
    schema takes milliseconds; :func:`~cadenza.node.core.structured.check` caches the verdicts).

    Raises:
        APIError: 400 naming ``param``, with the grammar engine's reason.
    """
    if structured is None:
        return
    try:
        await asyncio.to_thread(check_grammar, structured)
    except GrammarError as exc:
        raise APIError(400, f"{param}: {exc}", param=param) from None


def _ready_inputs(request: web.Request) -> InputProcessor:
    client = request.app[ENGINE]
    if not client.is_ready or client.inputs is None:
        raise APIError(503, "the model is still loading; retry shortly", headers={"Retry-After": "5"})
    return client.inputs


def _check_model(request: web.Request, model: str) -> None:
    if model != request.app[MODEL_NAME]:
        raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


async def _respond(request: web.Request, call: _Call) -> web.StreamResponse:
    client = request.app[ENGINE]
    model = request.app[MODEL_NAME]
    created = int(time.time())
    endpoint = client.info.kv_transfer if client.info is not None else None
    remote_kv, publish_kv = kv_options(request, endpoint)
    headers = {REQUEST_ID_HEADER: call.request_id}
    if endpoint is not None and (rule := client.stats().kv_transfer_rule) is not None:
        headers[DISAGG_RULE_HEADER] = rule  # for the gateway's selective rule
    if publish_kv:  # validated as the decode call will be; computed for its KV: one token is enough,
        call.sampling = replace(call.sampling, max_tokens=1)  # streamed so the headers go out once queued
        call.stream, call.n = True, 1  # (the decode call runs the n choices)
        # where the decode replica pulls this prompt's KV from
        headers[KV_SOURCE_HEADER] = format_source(RemoteKV(endpoint.host, endpoint.port, call.request_id,
                                                           endpoint.boot_id, len(call.prompt_ids)))
    stream = client.generate(call.request_id, call.prompt_ids, call.sampling, call.traffic_class, call.tenant,
                             arrival_time=call.arrival, cache_salt=call.cache_salt,
                             traceparent=request.headers.get(TRACEPARENT_HEADER), remote_kv=remote_kv,
                             publish_kv=publish_kv, acknowledge=publish_kv, n=call.n)
    if call.n > 1:
        request.app[TELEMETRY].expect_choices(call.request_id, call.n)
    chat = call.kind == "chat.completion"
    access = request.get(ACCESS, {})
    access["id"] = call.request_id
    tokenizer = client.inputs.tokenizer
    choices = Choices(call.n, (lambda: _Logprobs(tokenizer, chat)) if call.sampling.logprobs is not None else None)
    tools = [call.tools() for _ in range(call.n)] if call.tools is not None else None  # per choice
    if not call.stream:
        async with aclosing(stream) as outputs:
            async for output in _guard(outputs):
                choices.gather(output)
        assert choices.any_output
        access["tokens"] = choices.tokens
        response_choices = choices.response(chat)
        if tools is not None:  # each choice's text through its own tool parser
            for item, choice in zip(choices.items, response_choices):
                choice.update(tools[item.index].choice("".join(item.text), item.finish_reason))
        return web.json_response(
            {"id": call.request_id, "object": call.kind, "created": created, "model": model,
             "choices": response_choices, "usage": choices.usage()},
            headers=headers,
        )

    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers})
    chunk_kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta: str | dict | None, finish_reason: str | None, index: int = 0) -> dict:
        logprobs = choices.items[index].logprobs
        choice = {"index": index, "logprobs": logprobs and logprobs.take(), "finish_reason": finish_reason}
        if chat:
            choice["delta"] = delta if isinstance(delta, dict) else ({"content": delta} if delta else {})
        else:
            choice["text"] = delta or ""
        body = {"id": call.request_id, "object": chunk_kind, "created": created, "model": model, "choices": [choice]}
        if call.include_usage:
            body["usage"] = None
        return body

    async with aclosing(stream) as outputs:
        try:
            async for item in _guard(outputs):
                if isinstance(item, Queued):  # a publish call the core queued (a refusal raised: a 429):
                    await response.prepare(request)  # the headers now, so the decode side pulls as this prefills
                    continue
                if not response.prepared:
                    await response.prepare(request)
                choice = choices.add(item)  # its logprobs go with its next chunk that carries text
                if not choice.started:
                    choice.started = True
                    if chat:
                        await _send(request, response, chunk({"role": "assistant", "content": ""}, None, item.index))
                if tools is not None:
                    for delta, reason in tools[item.index].chunks(item):
                        await _send(request, response, chunk(delta, reason, item.index))
                elif item.text or item.finished:
                    await _send(request, response, chunk(item.text or None, item.finish_reason, item.index))
        except APIError as exc:
            if not response.prepared:
                raise
            request.app[TELEMETRY].fail_request(call.request_id, exc.code or str(exc.status), exc.message)
            await _send(request, response, error_body(exc.status, exc.message, exc.param, exc.code))  # mid-stream
            await response.write_eof()
            return response
    if choices.any_output:
        access["tokens"] = choices.tokens
        if call.include_usage:
            await _send(request, response, {"id": call.request_id, "object": chunk_kind, "created": created,
                                            "model": model, "choices": [], "usage": choices.usage()})
    await send(request, response, b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _guard(outputs):
    """Engine failures become API errors (before the first byte) with the right status."""
    try:
        async for item in outputs:
            yield item
    except AdmissionError as exc:
        headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else None
        raise APIError(exc.status, str(exc), code=exc.reason, headers=headers) from None
    except ValueError as exc:  # the engine's refusal; a grammar that failed names its parameter
        raise APIError(400, str(exc), param=getattr(exc, "param", None)) from None
    except EngineDeadError as exc:
        raise APIError(503, str(exc), headers={"Retry-After": "5"}) from None
    except RuntimeError as exc:
        raise APIError(500, str(exc)) from None


async def _send(request: web.Request, response: web.StreamResponse, body: dict) -> None:
    await send(request, response, b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n")


class _Logprobs:
    """A choice's ``logprobs`` in OpenAI's shapes, built from the outputs' entries
    (:attr:`~cadenza.node.frontend.output_processor.RequestOutput.logprobs`) as they arrive, and
    taken for each response or chunk.

    Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
    "bytes"}, ...]}, ...]}``. Completions: ``{"tokens", "token_logprobs", "top_logprobs": [{token:
    logprob}, ...], "text_offset"}``. A token's text is its bytes decoded (a token holding part of a
    character shows U+FFFD; ``bytes`` has the exact bytes), as OpenAI's and vLLM's do. The token that
    completes a stop string is reported whole; the end-of-sequence or stop token that ends a request
    is not (it makes no text). A chunk without tokens (the role, held text) carries ``null``.
    """

    def __init__(self, tokenizer, chat: bool) -> None:
        self.tokenizer, self.chat = tokenizer, chat
        self.entries: list[tuple[int, list]] = []
        self.offset = 0  # completions' text_offset: characters of the tokens before

    def add(self, output) -> None:
        if output.logprobs:
            self.entries += zip(output.token_ids, output.logprobs)

    def _token(self, token_id: int, logprob: float) -> dict:
        raw = self.tokenizer.token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    def take(self, whole: bool = False) -> dict | None:
        """The entries gathered since the last take, in OpenAI's shape; None when there are none,
        unless ``whole`` (a non-streamed response: an empty list then)."""
        entries, self.entries = self.entries, []
        if not entries and not whole:
            return None
        if self.chat:
            return {"content": [{**self._token(t, lp), "top_logprobs": [self._token(i, v) for i, v in top]}
                                for t, (lp, top) in entries]}
        tokens = [self._token(t, lp)["token"] for t, (lp, _top) in entries]
        offsets = []
        for token in tokens:
            offsets.append(self.offset)
            self.offset += len(token)
        return {"tokens": tokens, "token_logprobs": [lp for _t, (lp, _top) in entries],
                "top_logprobs": [{self._token(i, v)["token"]: v for i, v in top} for _t, (_lp, top) in entries],
                "text_offset": offsets}
