"""One access-log line per request: method, path, status, class, tokens, latency.

Logged at INFO on the ``cadenza.access`` logger when the response is complete (for a stream:
when its last event is sent), e.g.::

    POST /v1/chat/completions 200 class=interactive tenant=default tokens=25+64 1.873s id=chatcmpl-...

Probes (``/health``, ``/ready``, ``/metrics``) are logged at DEBUG, so a kubelet polling every few
seconds does not drown the log. Handlers add what they know to the request (``ACCESS``); the
line never holds a header or body value beyond those fields.
"""

from __future__ import annotations

import logging
import time

from aiohttp import web

logger = logging.getLogger("cadenza.access")

ACCESS: web.RequestKey[dict] = web.RequestKey("cadenza.access", dict)  # a dict a handler fills (class, tenant, tokens, id)
PROBES = frozenset({"/health", "/ready", "/metrics"})


@web.middleware
async def access_log_middleware(request: web.Request, handler):
    started = time.monotonic()
    request[ACCESS] = fields = {}
    status = 499  # the client went away before an answer (nginx's convention)
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    finally:
        level = logging.DEBUG if request.path in PROBES else logging.INFO
        if logger.isEnabledFor(level):
            extra = "".join(f" {key}={value}" for key, value in fields.items())
            logger.log(level, "%s %s %d%s %.3fs", request.method, request.path, status, extra,
                       time.monotonic() - started)
