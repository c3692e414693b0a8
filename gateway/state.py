"""What a gateway app holds: its settings, its upstream table and the router that routes over it,
its HTTP client, its latency histograms, its collector of the replicas' engine counters (typed app
keys)."""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp
from aiohttp import web

from cadenza.gateway.engine_stats import EngineStats
from cadenza.gateway.metrics import GatewayMetrics
from cadenza.gateway.router import Router
from cadenza.gateway.upstreams import Upstreams
from cadenza.node.core.policy import check_class

DEFAULT_MAX_OUTSTANDING = 64
DEFAULT_CONNECT_TIMEOUT_S = 5.0
DEFAULT_HEALTH_INTERVAL_S = 2.0


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """How the gateway routes; fixed for the life of the app.

    Args:
        default_class: traffic class of requests without an ``x-cadenza-class`` header.
        max_outstanding: requests in flight through this gateway that make an upstream full.
        connect_timeout_s: seconds to open a connection to an upstream before it counts as down.
            Responses have no timeout: a stream lasts as long as the generation.
        health_interval_s: seconds between active health checks of every upstream (each with the
            same timeout); 0 turns them off.
        disagg_min_prompt_tokens: prompts at least this long go through a ``prefill`` replica
            when the pool has one (:mod:`.disagg`); ``"auto"``: the threshold the decode replicas
            compute; None: never.

    Raises:
        ValueError: a class that is not ``interactive``/``batch``/``background`` (case-insensitive),
            or a non-positive limit.
    """

    default_class: str = "interactive"
    max_outstanding: int = DEFAULT_MAX_OUTSTANDING
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    health_interval_s: float = DEFAULT_HEALTH_INTERVAL_S
    disagg_min_prompt_tokens: int | str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "default_class", check_class(self.default_class))
        if isinstance(self.max_outstanding, bool) or not isinstance(self.max_outstanding, int) \
                or self.max_outstanding < 1:
            raise ValueError(f"max_outstanding: must be a positive integer, got {self.max_outstanding!r}")
        if not self.connect_timeout_s > 0:
            raise ValueError(f"connect_timeout_s: must be positive, got {self.connect_timeout_s!r}")
        least = self.disagg_min_prompt_tokens
        if least not in (None, "auto") and (isinstance(least, bool) or not isinstance(least, int) or least < 1):
            raise ValueError(f"disagg_min_prompt_tokens: must be a positive integer or 'auto', got {least!r}")
        if not self.health_interval_s >= 0:
            raise ValueError(f"health_interval_s: must be 0 (off) or positive, got {self.health_interval_s!r}")


SETTINGS = web.AppKey("gateway_settings", GatewaySettings)
UPSTREAMS = web.AppKey("gateway_upstreams", Upstreams)
ROUTER = web.AppKey("gateway_router", Router)
SESSION = web.AppKey("gateway_session", aiohttp.ClientSession)
METRICS = web.AppKey("gateway_metrics", GatewayMetrics)
ENGINE_STATS = web.AppKey("gateway_engine_stats", EngineStats)
PREFILL_CALLS = web.AppKey("gateway_prefill_calls", set)  # prefill calls read to their end in the background
