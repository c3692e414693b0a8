"""A request's JSON body: read within the body timeout, parsed off the event loop when large.

A body over :data:`INLINE_BODY_BYTES` is decoded (and checked) in a worker thread, so its
Python-level work interleaves with the event loop instead of stalling every stream and probe.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from aiohttp import web

from cadenza.node.http.errors import APIError
from cadenza.node.http.hardening import body_timeout

INLINE_BODY_BYTES = 64 * 2**10  # larger bodies are parsed and checked in a worker thread


async def read_json(request: web.Request, check: Callable[[Any], Any] | None = None) -> Any:
    """The body of ``request`` as JSON, passed through ``check`` (a validation that may be slow:
    it runs where the parsing does) when given.

    Raises:
        APIError: 408 (body too slow) or 413 (too large) from
            :func:`~cadenza.node.http.hardening.body_timeout`, 400 (not valid JSON); what
            ``check`` raises.
    """
    async with body_timeout(request):
        raw = await request.read()
    if len(raw) <= INLINE_BODY_BYTES:
        return _decode(raw, check)
    return await asyncio.get_running_loop().run_in_executor(None, _decode, raw, check)


def _decode(raw: bytes, check: Callable[[Any], Any] | None) -> Any:
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, absurd nesting
        raise APIError(400, f"request body is not valid JSON: {exc}") from None
    return data if check is None else check(data)
