"""The aiohttp application: OpenAI-compatible routes, health probes, engine lifecycle.

``/health`` is liveness (200 while the engine core runs or loads, 503 once it has died — or has
sent nothing for the stall timeout, see :mod:`cadenza.node.frontend.client`);
``/ready`` is readiness (200 once the model is loaded, with the engine's counters);
``/admin/config`` reads and changes scheduling knobs live (bearer token, :mod:`.admin`);
``/metrics`` is Prometheus text (:mod:`cadenza.node.frontend.telemetry`, which also exports OTLP). The engine starts loading when the app
starts, so the server listens — and Kubernetes probes get answers — while weights load.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from pathlib import Path

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from cadenza.node.core.config import EngineConfig
from cadenza.node.core.policy import check_class
from cadenza.node.frontend.client import STALL_TIMEOUT_S, EngineClient
from cadenza.node.frontend.step_log import StepLog
from cadenza.node.server import admin, auth, openai_api
from cadenza.node.server.access_log import access_log_middleware
from cadenza.node.server.app_keys import DEFAULT_CLASS, ENGINE, MODEL_NAME, STARTED, TELEMETRY, TOOL_PARSER
from cadenza.node.http.errors import error_middleware, error_response
from cadenza.node.http.hardening import HttpTimeouts
from cadenza.node.http.runner import run_app
from cadenza.node.frontend.telemetry import Telemetry
from cadenza.node.wire import MAX_BODY_BYTES

logger = logging.getLogger(__name__)



def create_app(config: EngineConfig, model_name: str | None = None, default_class: str = "interactive",
               engine_process: bool = False, threads=None,
               core_factory: Callable | None = None, step_log: Path | None = None,
               stall_timeout_s: float | None = STALL_TIMEOUT_S, tool_parser: str = "auto") -> web.Application:
    """Build the app; the engine core starts loading when the app starts.

    Args:
        config: the engine configuration.
        model_name: the id clients must send as ``model`` (default: ``config.model_name``).
        default_class: traffic class of requests without an ``x-cadenza-class`` header.
        engine_process: run the engine core in its own process (``cadenza serve`` does by
            default); else in a thread of this one (tests).
        threads: torch threads of a core process (a :class:`ThreadChoice`).
        core_factory: with a thread, builds the core from the tokenizer's EOS ids (tests).
        step_log: append each step's composition and seconds to this JSONL file
            (:mod:`cadenza.node.frontend.step_log`: the table ``cadenza sim calibrate`` fits).
        stall_timeout_s: a ready engine core that sends nothing this long is dead (None: never).
        tool_parser: the format of the model's tool calls (:mod:`cadenza.node.server.tool_calls`),
            or ``auto``: from its chat template.

    Raises:
        OSError: ``step_log`` cannot be opened.
    """
    model_name = model_name or config.model_name
    app = web.Application(middlewares=[access_log_middleware, error_middleware], client_max_size=MAX_BODY_BYTES)
    engine = EngineClient(config, process=engine_process, core_factory=core_factory, threads=threads,
                          stall_timeout_s=stall_timeout_s)
    telemetry = Telemetry(model_name, stats=engine.stats, step_log=StepLog(step_log) if step_log else None)
    engine.telemetry = telemetry
    app[ENGINE] = engine
    app[TELEMETRY] = telemetry
    app[MODEL_NAME] = model_name
    app[DEFAULT_CLASS] = check_class(default_class)
    app[TOOL_PARSER] = tool_parser
    app[STARTED] = int(time.time())
    admin.add_routes(app)
    app.cleanup_ctx.append(_engine_lifecycle)
    app.router.add_post("/v1/completions", openai_api.completions)
    app.router.add_post("/v1/chat/completions", openai_api.chat_completions)
    app.router.add_get("/v1/models", openai_api.models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    return app


async def _engine_lifecycle(app: web.Application) -> AsyncIterator[None]:
    engine = app[ENGINE]
    engine.start()
    yield
    await engine.shutdown()
    await asyncio.get_running_loop().run_in_executor(None, app[TELEMETRY].shutdown)


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text exposition of every metric (GenAI semantic conventions + ``cadenza.*``)."""
    body = await asyncio.get_running_loop().run_in_executor(None, request.app[TELEMETRY].prometheus_text)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    if engine.is_alive:
        return web.json_response({"status": "ok"})
    return error_response(503, f"engine is not running: {engine.error or 'stopped'}")


async def ready(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    if engine.is_ready:
        return web.json_response({"status": "ready", **engine.stats().to_dict()})
    if not engine.is_alive and engine.error is not None:
        return error_response(503, f"engine failed to start: {engine.error}")
    return error_response(503, "model loading", headers={"Retry-After": "5"})


def serve(config: EngineConfig, host: str, port: int, default_class: str = "interactive",
          timeouts: HttpTimeouts | None = None, engine_process: bool = True, threads=None,
          step_log: Path | None = None, stall_timeout_s: float | None = STALL_TIMEOUT_S,
          tool_parser: str = "auto") -> int:
    """Serve until SIGINT/SIGTERM; return the process exit code.

    The server listens at once (probes get answers while the weights load). If the engine fails
    to load — a configuration that cannot work with this model, say — the server stops and the
    exit code is 1, so a supervisor sees the failure instead of a replica that never gets ready;
    so it does when a loaded core dies or stalls (``stall_timeout_s``).
    """
    if auth.admin_token() is None:
        logger.info("admin API off: set %s (or %s) to enable GET/PUT /admin/config", auth.TOKEN_ENV,
                    auth.TOKEN_FILE_ENV)
    else:
        logger.info("admin API on: GET/PUT /admin/config with the bearer token")
    app = create_app(config, default_class=default_class, engine_process=engine_process, threads=threads,
                     step_log=step_log, stall_timeout_s=stall_timeout_s, tool_parser=tool_parser)
    return asyncio.run(_serve(app, host, port, timeouts))


async def _serve(app: web.Application, host: str, port: int, timeouts: HttpTimeouts | None = None) -> int:
    return await run_app(app, host, port, "server", partial(until_stopped_or_failed, app), timeouts=timeouts)


async def until_stopped_or_failed(app: web.Application, stop: asyncio.Event) -> int:
    """Serve until ``stop`` is set (0), the engine fails to load (1) or a loaded engine dies (1).

    A replica whose engine is gone — dead, or silent past the stall timeout — cannot serve
    anything: rather than answer 503 forever while its process lives, it exits, and its
    supervisor (Kubernetes, or ``cadenza up``) restarts it.
    """
    engine = app[ENGINE]
    ready = asyncio.ensure_future(engine.wait_ready())
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if ready.done() and ready.exception() is not None:
            logger.error("%s", ready.exception())
            return 1
        if not ready.done():
            return 0
        logger.info("ready: serving %s", app[MODEL_NAME])
        dead = asyncio.ensure_future(engine.wait_dead())
        await asyncio.wait({dead, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if dead.done():
            logger.error("the engine died (%s); exiting so that this replica is restarted", dead.result())
            return 1
        dead.cancel()
        return 0
    finally:
        ready.cancel()
        stopped.cancel()
