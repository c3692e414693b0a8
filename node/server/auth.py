"""The pool's bearer token: what ``/admin/config`` and the KV transfer headers require.

The token is :func:`cadenza.node.credentials.admin_token` (``$CADENZA_ADMIN_TOKEN`` or the file
named by ``$CADENZA_ADMIN_TOKEN_FILE``, read on every request, so a rotated secret takes effect
without a restart). With neither set, everything that needs it is refused: a missing or wrong
token is a 401.
"""

from __future__ import annotations

import hmac

from aiohttp import web

from cadenza.node.credentials import TOKEN_ENV, TOKEN_FILE_ENV, admin_token
from cadenza.node.http.errors import APIError

__all__ = ["TOKEN_ENV", "TOKEN_FILE_ENV", "admin_token", "authorize"]


def authorize(request: web.Request, what: str = "the admin API") -> None:
    """Raise a 401 :class:`APIError` unless ``request`` carries ``Authorization: Bearer <token>``."""
    expected = admin_token()
    challenge = {"WWW-Authenticate": 'Bearer realm="cadenza-admin"'}
    if expected is None:
        raise APIError(401, f"{what} is disabled: set {TOKEN_ENV} or {TOKEN_FILE_ENV}", headers=challenge)
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected.encode()):
        raise APIError(401, "missing or wrong bearer token", headers=challenge)
