"""What the operator reads of a disaggregated pool's gateways for its status: the shortest prompt
they send through a prefill replica (``status.disaggregated``).

(A pool's SLO readings — ``status.latency``, ``SLOMet``, ``status.controller`` — come from its
control loop: :mod:`cadenza.control.status`.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import cadenza.node.metric_names as names
from cadenza.control.exposition import gauge_values

THRESHOLD_METRIC = names.GATEWAY_DISAGG_MIN_PROMPT_TOKENS.prometheus


def disaggregation_status(pinned: int | None, scraped: Mapping[str, str] | None) -> dict[str, Any]:
    """``status.disaggregated`` of a disaggregated pool: the shortest prompt its gateways send
    through a prefill replica, and where that figure comes from.

    Args:
        pinned: ``spec.disaggregated.minPromptTokens``, or None (the engines compute it).
        scraped: ``/metrics`` text by pod (:func:`~cadenza.operator.k8s_roles.scrape_pool`), or
            None; the gateways' ``cadenza.gateway.disagg.min_prompt_tokens`` gauge is read.

    Returns:
        ``{"minPromptTokens", "source": "pinned" | "computed", "message"}``, or ``source:
        unknown`` (no ``minPromptTokens``) while no gateway reports a computed threshold — the
        decode replicas' cost models calibrate on their first steps and their link on the first
        1 MiB pulled; until then nothing is moved.
    """
    if pinned is not None:
        return {"minPromptTokens": pinned, "source": "pinned", "message": "spec.disaggregated.minPromptTokens"}
    values = gauge_values((scraped or {}).values(), THRESHOLD_METRIC)
    if not values:
        return {"source": "unknown", "message": "no gateway reports a computed threshold yet (the decode replicas "
                                                "calibrate their step-time model and measure the link first); "
                                                "until then every prompt is prefilled where it decodes"}
    return {"minPromptTokens": int(max(values)), "source": "computed",
            "message": "from the decode replicas' step-time models and measured KV transfer bandwidth"}
