"""SLO signals of a pool: per class, its latency and the engines' load over a fast and a slow window.

A :class:`ClassWindow` is one class's figures over one window: requests, TTFT and ITL p99, SLO
attainment (from the gateways' client-side histograms, :mod:`.histograms`) and the engines'
queue depth, KV usage, preemptions and predicted step time. :class:`Signals` holds every class's
fast and slow window — what :func:`cadenza.control.decide.decide` reads. A source
(:class:`SignalSource`: scraping, :mod:`.scrape`; a Prometheus API, :mod:`.prometheus`; the
simulator's fleet) gives the windows; :func:`read_signals` reads them all at one time.

Invariants:
- A window whose data is missing, stale, NaN, not yet covered, or holds fewer than
  ``min_samples`` requests (but more than none: a covered window with no request is a known zero,
  the class has no traffic) is **unknown** (``ClassWindow.known`` False, with the reason). Unknown
  means "hold" to the controller, never "no load".
- A missing engine series leaves its figure None, never zero.

Pure: nothing here reads a clock or the network.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from cadenza.control.histograms import Histogram
from cadenza.node.core.policy import CLASSES  # one home for the traffic classes


@dataclass(frozen=True)
class ClassWindow:
    """One class's latency over one window.

    Attributes:
        known: False when the figures below must not be acted on; ``reason`` says why.
        requests: requests that got a first token in the window (TTFT observations).
        ttft_p99_ms / itl_p99_ms: p99 estimates (None when there were no observations).
        attainment: share of observations within target, the lower of TTFT's and ITL's (None
            without a target or without observations).
        queue_depth: the most requests of the class queued at once, over the engines, at the
            window's scrapes.
        kv_usage: the highest KV usage (0-1) of any engine at the window's scrapes (the pool's).
        preemptions: requests of the class preempted in the window.
        predicted_step_p99_ms: p99 of the engines' predicted step time in the window (the pool's).
        prefill_share: of the tokens the engines computed in the window, the share (0-1) that were
            prompt (prefill) tokens (the pool's).
        min_prompt_tokens: the selective disaggregation rule's threshold, the shortest prompt worth
            prefilling on another replica (tokens; the largest the engines report, as the gateway
            takes it; the pool's).
        long_prompt_share: of the prompt tokens the engines took in the window, the share (0-1) in
            prompts at least ``min_prompt_tokens`` long: what a prefill replica would take (the pool's).
        The engine figures are None when the engines' series were not scraped (or, for the last
            three, when the engines report no rule yet).
    """

    known: bool
    reason: str = ""
    requests: int = 0
    ttft_p99_ms: float | None = None
    itl_p99_ms: float | None = None
    attainment: float | None = None
    window_s: float = 0.0
    queue_depth: int | None = None
    kv_usage: float | None = None
    preemptions: int | None = None
    predicted_step_p99_ms: float | None = None
    prefill_share: float | None = None
    min_prompt_tokens: float | None = None
    long_prompt_share: float | None = None

    def load(self) -> str:
        """The engine figures as "queue 3, KV 97 %, 2 preempted, predicted step p99 410 ms"
        (empty without them)."""
        parts = []
        if self.queue_depth is not None:
            parts.append(f"queue {self.queue_depth}")
        if self.kv_usage is not None:
            parts.append(f"KV {self.kv_usage:.0%}")
        if self.preemptions:
            parts.append(f"{self.preemptions} preempted")
        if self.predicted_step_p99_ms is not None:
            parts.append(f"predicted step p99 {self.predicted_step_p99_ms:.0f} ms")
        return ", ".join(parts)

    def over(self, slo: Mapping[str, float], factor: float = 1.0) -> list[str]:
        """The figures above ``factor`` x their target, as "TTFT p99 812 ms > 500 ms" strings."""
        out = []
        for key, name, value in (("ttftP99Ms", "TTFT", self.ttft_p99_ms), ("itlP99Ms", "ITL", self.itl_p99_ms)):
            target = slo.get(key)
            if target is not None and value is not None and value > factor * target:
                out.append(f"{name} p99 {value:.0f} ms > {factor * target:.0f} ms")
        return out

    def to_status(self) -> dict:
        doc: dict = {"known": self.known, "requests": self.requests, "windowSeconds": round(self.window_s)}
        for key, value in (("ttftP99Ms", self.ttft_p99_ms), ("itlP99Ms", self.itl_p99_ms),
                           ("attainment", self.attainment), ("queueDepth", self.queue_depth),
                           ("kvUsage", self.kv_usage), ("preemptions", self.preemptions),
                           ("predictedStepP99Ms", self.predicted_step_p99_ms),
                           ("prefillShare", self.prefill_share), ("minPromptTokens", self.min_prompt_tokens),
                           ("longPromptShare", self.long_prompt_share)):
            if value is not None:
                doc[key] = round(value, 4 if key in ("attainment", "kvUsage", "prefillShare", "longPromptShare") else 1) if isinstance(value, float) else value
        if self.reason:
            doc["reason"] = self.reason
        return doc


@dataclass(frozen=True)
class Signals:
    """Per class, the fast and the slow window (what :func:`cadenza.control.decide.decide` reads)."""

    fast: Mapping[str, ClassWindow]
    slow: Mapping[str, ClassWindow]



class SignalSource(Protocol):
    """Where a pool's windows come from."""

    def record(self, now: float) -> None:
        """Take what a window needs at ``now`` (a scrape; nothing when a backend keeps history)."""

    def window(self, cls: str, window_s: float, now: float, slo: Mapping[str, float], *, min_samples: int,
               stale_s: float) -> ClassWindow:
        """``cls`` over the last ``window_s`` seconds at ``now`` (unknown, with the reason, when it cannot say)."""


def window_of(ttft: Histogram, itl: Histogram | None, slo: Mapping[str, float], min_samples: int,
              span: float) -> ClassWindow:
    """The figures of one window's histograms (shared by both sources and the simulator); the
    engine figures are left unset."""
    requests = int(round(ttft.total))
    ttft_p99, itl_p99 = ttft.quantile(0.99), itl.quantile(0.99) if itl is not None else None
    shares = [h.share_at_most(slo[key] / 1e3) for key, h in (("ttftP99Ms", ttft), ("itlP99Ms", itl))
              if h is not None and slo.get(key) is not None]
    shares = [s for s in shares if s is not None]
    # No request at all in a covered window is a known zero (the class has no traffic); a few
    # are too few to estimate a p99 from.
    enough = requests == 0 or requests >= min_samples
    return ClassWindow(
        known=enough,
        reason="" if enough else f"{requests} requests < {min_samples} needed",
        requests=requests,
        ttft_p99_ms=None if ttft_p99 is None else ttft_p99 * 1e3,
        itl_p99_ms=None if itl_p99 is None else itl_p99 * 1e3,
        attainment=min(1.0, max(0.0, min(shares))) if shares else None,
        window_s=span,
    )


def prefill_figures(prefill_tokens: float | None, decode_tokens: float | None, prompts: Histogram | None,
                    prompt_tokens: float | None, moved_tokens: float | None, threshold: float | None) -> dict:
    """The window's prefill-interference figures from the engines' counts over it (shared by both
    sources): ``prefill_share``, ``min_prompt_tokens`` and ``long_prompt_share`` for
    :class:`ClassWindow`, each left out when it cannot be said.

    Args:
        prefill_tokens / decode_tokens: tokens the engines computed in the window, by kind
            (``cadenza.step.tokens``'s sums).
        prompts: prompt lengths of the requests the engines finished in the window (tokens;
            ``gen_ai.client.token.usage``, ``input``), and ``prompt_tokens`` their sum.
        moved_tokens: prompt tokens whose KV a decode replica loaded from a prefill replica (or
            recomputed after a failed load) in the window. Such a prompt is counted by the
            prefill replica and again by the decode replica, so it is taken out once.
        threshold: the selective rule's threshold now (tokens).

    The long-prompt share comes from the prompt-length histogram's buckets
    (:meth:`Histogram.mass_share_at_least`): an estimate, as fine as the buckets (the GenAI
    conventions' token buckets step x4), scaled to the exact token sum.
    """
    out: dict = {}
    if prefill_tokens is not None and decode_tokens is not None and prefill_tokens + decode_tokens > 0:
        out["prefill_share"] = prefill_tokens / (prefill_tokens + decode_tokens)
    if threshold is None:
        return out
    out["min_prompt_tokens"] = float(threshold)
    share = prompts.mass_share_at_least(threshold) if prompts is not None and prompts.finite else None
    moved = moved_tokens or 0.0
    if share is not None and prompt_tokens is not None and prompt_tokens - moved > 0:
        out["long_prompt_share"] = min(1.0, max(0.0, (share * prompt_tokens - moved) / (prompt_tokens - moved)))
    return out


def read_signals(source, now: float, slo: Mapping[str, Mapping[str, float]], fast_s: float, slow_s: float,
                 *, min_samples: int, stale_s: float) -> Signals:
    """Every class's fast and slow window from ``source`` (any :class:`SignalSource`) at ``now``."""
    def windows(seconds: float) -> dict[str, ClassWindow]:
        return {cls: source.window(cls, seconds, now, slo.get(cls) or {}, min_samples=min_samples, stale_s=stale_s)
                for cls in CLASSES}

    return Signals(windows(fast_s), windows(slow_s))
