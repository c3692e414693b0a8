"""OpenTelemetry set-up shared by every cadenza process (engine servers, gateways): which
exporters the standard ``OTEL_*`` variables ask for, and the resource that names the process.

Imports only the OpenTelemetry SDK, so a gateway can use it without loading the engine.
"""

from __future__ import annotations

import os

from opentelemetry.sdk.resources import Resource


def otlp_enabled(signal: str) -> bool:
    """Whether the OTEL_* environment asks for OTLP export of ``signal`` (traces, metrics)."""
    choice = os.environ.get(f"OTEL_{signal.upper()}_EXPORTER", "").strip().lower()
    if choice:
        return "otlp" in choice.split(",")
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT"))


def make_resource() -> Resource:
    """``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES`` (read by the SDK), ``service.name``
    defaulting to ``cadenza``, and the pool and replica names when ``CADENZA_POOL`` /
    ``CADENZA_REPLICA`` are set (the operator sets them)."""
    attrs: dict[str, str] = {}
    if not os.environ.get("OTEL_SERVICE_NAME") and "service.name=" not in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", ""):
        attrs["service.name"] = "cadenza"
    for env, key in (("CADENZA_POOL", "cadenza.pool.name"), ("CADENZA_REPLICA", "cadenza.replica.name")):
        if value := os.environ.get(env):
            attrs[key] = value
    return Resource.create(attrs)
