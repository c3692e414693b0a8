"""The pool's token: one secret that every replica and gateway of a pool shares.

It guards the admin API (``/admin/config``), the KV transfer HTTP headers
(:mod:`cadenza.node.server.auth`) and the KV transfer endpoint's handshake
(:mod:`cadenza.node.kv_transfer.protocol`). It comes from ``$CADENZA_ADMIN_TOKEN`` or from the
file named by ``$CADENZA_ADMIN_TOKEN_FILE`` (a mounted Kubernetes Secret, read at each use, so a
rotated secret takes effect without a restart). Neither set: None, and everything that needs it
is refused. Kept apart from the HTTP server so the engine core reads it without importing aiohttp.
"""

from __future__ import annotations

import os
from pathlib import Path

from cadenza.node.core.config import ConfigError

TOKEN_ENV = "CADENZA_ADMIN_TOKEN"
TOKEN_FILE_ENV = "CADENZA_ADMIN_TOKEN_FILE"
# Why a replica with a KV transfer endpoint and no token does not start: an endpoint that refuses
# every peer would only look like a working pool.
KV_TRANSFER_NEEDS_TOKEN = (f"the KV transfer endpoint needs the pool's token (set {TOKEN_ENV} or {TOKEN_FILE_ENV}): "
                           "peers must prove they hold it before any KV moves either way")


def admin_token() -> str | None:
    """The configured token (surrounding whitespace stripped), or None when none is set or its
    file cannot be read."""
    if token := os.environ.get(TOKEN_ENV, "").strip():
        return token
    if path := os.environ.get(TOKEN_FILE_ENV):
        try:
            return Path(path).read_text().strip() or None
        except OSError:
            return None
    return None


def require_kv_token(kv_transfer_port: int | None) -> None:
    """Refuse a KV transfer endpoint (``kv_transfer_port`` set) without the pool's token.

    Raises:
        ConfigError: ``kv_transfer_port``, :data:`KV_TRANSFER_NEEDS_TOKEN`.
    """
    if kv_transfer_port is not None and admin_token() is None:
        raise ConfigError("kv_transfer_port", KV_TRANSFER_NEEDS_TOKEN)
