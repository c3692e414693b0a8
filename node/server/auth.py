"""The pool's bearer token: what ``/admin/config`` and the KV transfer headers require.

The token comes from ``$CADENZA_ADMIN_TOKEN`` or from the file named by
``$CADENZA_ADMIN_TOKEN_FILE`` (a mounted Kubernetes Secret, read on every request, so a rotated
secret takes effect without a restart). With neither set, everything that needs it is refused:
a missing or wrong token is a 401.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

from aiohttp import web

from cadenza.node.server.errors import APIError

TOKEN_ENV = "CADENZA_ADMIN_TOKEN"
TOKEN_FILE_ENV = "CADENZA_ADMIN_TOKEN_FILE"


def admin_token() -> str | None:
    """The configured bearer token, or None when the admin API is disabled."""
    if token := os.environ.get(TOKEN_ENV, "").strip():
        return token
    if path := os.environ.get(TOKEN_FILE_ENV):
        try:
            return Path(path).read_text().strip() or None
        except OSError:
            return None
    return None


def authorize(request: web.Request, what: str = "the admin API") -> None:
    """Raise a 401 :class:`APIError` unless ``request`` carries ``Authorization: Bearer <token>``."""
    expected = admin_token()
    challenge = {"WWW-Authenticate": 'Bearer realm="cadenza-admin"'}
    if expected is None:
        raise APIError(401, f"{what} is disabled: set {TOKEN_ENV} or {TOKEN_FILE_ENV}", headers=challenge)
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected.encode()):
        raise APIError(401, "missing or wrong bearer token", headers=challenge)
