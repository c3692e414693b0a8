"""Disaggregated prefill in the simulator: the KV link, the selective rule, and when a moved
prompt's KV has arrived.

A prompt is moved when the gateway's router (:class:`cadenza.gateway.router.Router`) moves it:
with a pinned ``spec.disaggregated.minPromptTokens``, or solving the rules the decode replicas
report with the queue of the prefill replica it would use (the prompts sent there and not yet
computed). Each simulated decode replica reports the engine's own rule
(:mod:`cadenza.node.kv_transfer.threshold`, :func:`rule`) on its step-time model (calibrated on
the roofline's step times, as an engine's on its measured ones) and the link's bandwidth, with
the link's per-message latency added to the fixed cost. Before one has calibrated nothing moves,
as in the engine.

A moved prompt runs as in cadenza: the prefill replica computes it by chunked prefill as a
one-token request, while the decode replica takes the request at once with a remote KV source.
The request waits there with its blocks allocated and spends no token budget (the scheduler's
remote-KV path). The blocks stream as each chunk's step writes them, so the last of them lands at

    ready = max(prefill end + last chunk's bytes / B, arrival + prompt bytes / B) + latency

for a link of ``B`` bytes/s. From there the decode replica computes the prompt's last token and
decodes. A prefill replica that refuses the prompt (a 429) is backed off from and the next one
tried; with none left the decode replica is sent the request without a source and computes the
prompt itself, as the gateway's fallback does. The prefill replica frees the blocks at its
request's end; the lease is not modelled.
"""

from __future__ import annotations

import math

from collections.abc import Callable
from dataclasses import dataclass

from cadenza.node.core import disagg_rule
from cadenza.node.core.cost_model import StepCostModel
from cadenza.node.core.request import Request
from cadenza.node.kv_transfer.threshold import FIXED_S, Rule


@dataclass(frozen=True, slots=True)
class KVLinkModel:
    """The link between prefill and decode replicas.

    Attributes:
        bytes_per_s: payload bandwidth (1.25e9: 10 Gb/s TCP; ~5e10 for 400 Gb/s RDMA).
        latency_s: per message (the last frame's trip and the pull's round trip).
    """

    bytes_per_s: float = 1.25e9
    latency_s: float = 50e-6

    def __post_init__(self) -> None:
        if not (self.bytes_per_s > 0 and self.latency_s >= 0):
            raise ValueError(f"a KV link needs a positive bandwidth and a non-negative latency, got {self}")


def rule(cost: StepCostModel, link: KVLinkModel, bytes_per_token: int) -> Rule | None:
    """The selective rule of a decode replica with step-time model ``cost`` (None before
    calibration), the link's per-message latency added to its fixed cost."""
    return disagg_rule.rule(cost, bytes_per_token, link.bytes_per_s, fixed_s=FIXED_S + link.latency_s)


def ready_at(link: KVLinkModel, arrival_s: float, prefill_end_s: float, prompt_tokens: int, chunk_tokens: int,
             bytes_per_token: int) -> float:
    """When the last of a moved prompt's KV has reached the decode replica (virtual seconds)."""
    last_chunk = min(prompt_tokens, chunk_tokens) * bytes_per_token
    streamed = arrival_s + prompt_tokens * bytes_per_token / link.bytes_per_s
    return max(prefill_end_s + last_chunk / link.bytes_per_s, streamed) + link.latency_s


@dataclass(slots=True)
class Move:
    """A prompt prefilled elsewhere, as the fleet follows it: where it decodes, and its load."""

    decode: str
    prompt_tokens: int
    arrival_s: float
    ready_s: float | None = None  # when its KV has all arrived (None: still prefilling)
    blocks: int | None = None  # blocks the decode replica is loading (None: not admitted yet)


class SimConnector:
    """A decode replica's KV connector: tells the fleet a load began (the fleet ends it)."""

    # The simulated prefill replica keeps a request's KV until the request ends (no lease to
    # renew), so a request queued here keeps its source however long it waits.
    max_hold_s = math.inf

    def __init__(self, on_start: Callable[[str, int], None]) -> None:
        self._on_start = on_start

    def start_load(self, request: Request, first_block: int, block_ids: list[int]) -> None:
        self._on_start(request.request_id, len(block_ids))

    def cancel(self, request_id: str) -> None:
        pass  # nothing is in flight but the fleet's event, which finds the load gone

    def release(self, request: Request) -> None:
        pass  # the prefill replica frees its blocks at its request's end
