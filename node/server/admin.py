"""``GET/PUT /admin/config``: read and change scheduling knobs on a running server.

Changes take effect from the next engine step. The endpoint needs ``Authorization: Bearer
<token>``; the token comes from ``$CADENZA_ADMIN_TOKEN`` or from the file named by
``$CADENZA_ADMIN_TOKEN_FILE`` (a mounted Kubernetes Secret — read on every request, so a rotated
secret takes effect without a restart). With neither set, the endpoint refuses everyone. A
missing or wrong token is a 401; an invalid change is a 400 and nothing changes.

``PUT`` takes any subset of the live knobs of :mod:`cadenza.node.core.knobs`: ``token_budget``,
``chunk_size`` (``null`` = no cap), ``max_num_seqs``, ``prefix_caching``, ``step_time_target_ms``,
``classes`` (per class, any of ``max_prefill_tokens``, ``min_share``, ``max_queue_age_s``,
``max_queue_depth``), ``tenants`` (per tenant ``weight``, ``max_concurrent``,
``max_queued_prompt_tokens``; ``null`` removes a tenant; at most ``MAX_TENANTS``, 1,024, listed),
``default_tenant``, ``max_preemptions``, ``watermark``, ``tenant_cache_isolation``.
``max_model_len`` is shown but cannot change. The checks are those of a pool file and the flags
(:mod:`cadenza.node.core.knobs`).
"""

from __future__ import annotations

from aiohttp import web

from cadenza.node.frontend.client import EngineCommandError, EngineDeadError
from cadenza.node.server.auth import authorize
from cadenza.node.http.errors import APIError
from cadenza.node.server.app_keys import ENGINE
from cadenza.node.server.json_body import read_json

async def get_config(request: web.Request) -> web.Response:
    authorize(request)
    engine = request.app[ENGINE]
    if engine.info is None:
        raise APIError(503, "the model is still loading", headers={"Retry-After": "5"})
    return web.json_response(engine.config_view)


async def put_config(request: web.Request) -> web.Response:
    authorize(request)
    changes = await read_json(request)  # a large body is parsed off the event loop: probes and streams go on
    if not isinstance(changes, dict) or not changes:
        raise APIError(400, "request body must be a non-empty JSON object of settings")
    try:
        config = await request.app[ENGINE].reconfigure(changes)
    except (ValueError, TypeError) as exc:
        raise APIError(400, str(exc)) from None
    except EngineDeadError as exc:
        raise APIError(503, str(exc), headers={"Retry-After": "5"}) from None
    except EngineCommandError as exc:  # a bug, logged by the engine; nothing changed, it serves on
        raise APIError(500, f"the change failed inside the engine and was not applied: {exc}") from None
    return web.json_response(config)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/admin/config", get_config)
    app.router.add_put("/admin/config", put_config)
