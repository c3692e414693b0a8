"""The gateway's config file (JSON or YAML) and its validation.

Shape::

    roles:                       # role -> replica base URLs; colocated: both list the same ones
      interactive: [http://127.0.0.1:9001]
      batch: [http://127.0.0.1:9002]
      prefill: [http://127.0.0.1:9003]  # optional: replicas that prefill long prompts for the others
    default_class: interactive   # optional: class of requests without x-cadenza-class
    max_outstanding: 64          # optional: requests in flight that make a replica full

YAML is a superset of JSON, so one parser reads both. A role may be missing or empty (its
replicas are still starting: ``/ready`` answers 503 until it has one).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from yarl import URL

from cadenza.gateway.upstreams import ROLES
from cadenza.node.core.policy import PolicyError, check_class

_KEYS = ("roles", "default_class", "max_outstanding")


class GatewayConfigError(ValueError):
    """An unreadable or invalid gateway config; the message names the file and the field."""


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """A validated config file. ``None`` settings leave the command-line or built-in default."""

    roles: dict[str, list[str]] = field(default_factory=dict)
    default_class: str | None = None
    max_outstanding: int | None = None


def check_url(value: object, where: str) -> str:
    """An ``http(s)://host[:port]`` base URL without trailing slash, or :class:`GatewayConfigError`."""
    try:
        url = URL(value) if isinstance(value, str) else None
    except ValueError:
        url = None
    if url is None or url.scheme not in ("http", "https") or not url.host or url.query_string or url.fragment:
        raise GatewayConfigError(f"{where}: must be an http(s)://host[:port] URL, got {value!r}")
    try:
        url.port  # noqa: B018 - an out-of-range port raises here
    except ValueError as exc:
        raise GatewayConfigError(f"{where}: {exc}") from None
    return str(url).rstrip("/")


def check_roles(roles: object, where: str = "roles") -> dict[str, list[str]]:
    """Role -> list of URLs, each role ``interactive``, ``batch`` or ``prefill``, or :class:`GatewayConfigError`."""
    if not isinstance(roles, Mapping):
        raise GatewayConfigError(f"{where}: must be a mapping of role -> list of URLs, got {roles!r}")
    out = {}
    for role, urls in roles.items():
        if role not in ROLES:
            raise GatewayConfigError(f"{where}: unknown role {role!r}; roles are {', '.join(ROLES)}")
        if urls is None:
            urls = []
        if not isinstance(urls, list):
            raise GatewayConfigError(f"{where}.{role}: must be a list of URLs, got {urls!r}")
        out[role] = [check_url(u, f"{where}.{role}[{i}]") for i, u in enumerate(urls)]
    return out


def parse_config(data: object, name: str = "config") -> GatewayConfig:
    """Validate a parsed config document.

    Raises:
        GatewayConfigError: naming ``name`` and the field at fault.
    """
    if not isinstance(data, Mapping):
        raise GatewayConfigError(f"{name}: must be a mapping with 'roles', got {type(data).__name__}")
    unknown = sorted(set(data) - set(_KEYS))
    if unknown:
        raise GatewayConfigError(f"{name}: unknown key(s) {unknown}; keys are {', '.join(_KEYS)}")
    if "roles" not in data:
        raise GatewayConfigError(f"{name}: 'roles' is required")
    default_class = data.get("default_class")
    if default_class is not None:
        try:
            default_class = check_class(default_class)
        except PolicyError as exc:
            raise GatewayConfigError(f"{name}: default_{exc}") from None
    limit = data.get("max_outstanding")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise GatewayConfigError(f"{name}: max_outstanding: must be a positive integer, got {limit!r}")
    return GatewayConfig(check_roles(data["roles"], f"{name}: roles"), default_class, limit)


def load_config(path: str | Path) -> GatewayConfig:
    """Read and validate the config file at ``path`` (JSON or YAML).

    Raises:
        GatewayConfigError: the file cannot be read or parsed, or a field is invalid.
    """
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise GatewayConfigError(f"{path}: cannot read the gateway config: {exc}") from None
    return parse_config(data, str(path))
