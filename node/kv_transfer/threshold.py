"""When moving a prompt's KV pays: the selective disaggregation rule.

A prompt of ``n`` uncached tokens prefilled on a decode replica takes its prefill time from that
replica's decode steps: with the engine's step-time model (:mod:`cadenza.node.core.cost_model`)
that is ``c_p n + c_pa n^2 / 2`` seconds, however the prompt is chunked (the attention term sums
``n_i (start_i + n_i / 2)`` over the chunks, which is ``n^2 / 2``). Prefilled on a prefill replica
instead, the prompt's last ``l`` tokens (:attr:`Rule.local_tokens`: its last token, whose row
samples the first output token) are still computed on the decode replica, so ``m = n - l`` move. Their KV costs the request ``m t`` seconds on the
link (``t = b / B`` for ``b`` KV bytes per token over ``B`` bytes per second), the prefill
replica's queue ``q`` (the prompts it is computing before this one), and a fixed cost ``c`` (one
more HTTP round trip). So move it when the interference avoided exceeds what the move costs,

    (c_pa / 2) m^2 + (c_p - t) m >= c + q

and :meth:`Rule.min_prompt_tokens` is the smallest such ``n``. Without an attention term and with
a link slower than the prefill (``t >= c_p``) no prompt is worth moving; a longer prefill queue
raises the threshold, so a busy prefill replica is sent only the prompts that still pay.

The decode replicas compute the coefficients (they know their cost model, KV layout and the
bandwidth their pulls measured) and send them to the gateway in :meth:`Rule.header`; the gateway,
which knows what it has sent each prefill replica, adds ``q``.

Sources: DistServe (Zhong et al., OSDI 2024) and Splitwise (Patel et al., ISCA 2024) for the
phases' costs; llm-d's selective P/D threshold and Dynamo's prefill-length rule for moving only
long prompts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FIXED_S = 0.01  # a round trip through the gateway to a prefill replica and back
MAX_HEADER_CHARS = 256
_KEYS = {"c_p": "prefill_s_per_token", "c_pa": "prefill_s_per_token_pair", "t": "transfer_s_per_token",
         "l": "local_tokens", "c": "fixed_s"}


@dataclass(frozen=True, slots=True)
class Rule:
    """The coefficients of the rule for one decode replica (seconds, tokens).

    Attributes:
        prefill_s_per_token: ``c_p``, seconds one prompt token's prefill adds to a step.
        prefill_s_per_token_pair: ``c_pa``, seconds per query-key pair of prefill attention.
        transfer_s_per_token: ``t``, seconds one token's KV takes on the link.
        local_tokens: ``l``, the prompt's tokens prefilled on the decode replica anyway (its last
            token).
        fixed_s: ``c``, the fixed cost of going through a prefill replica.

    Raises:
        ValueError: a negative or non-finite coefficient.
    """

    prefill_s_per_token: float
    prefill_s_per_token_pair: float
    transfer_s_per_token: float
    local_tokens: int = 0
    fixed_s: float = FIXED_S

    def __post_init__(self) -> None:
        values = (self.prefill_s_per_token, self.prefill_s_per_token_pair, self.transfer_s_per_token,
                  self.local_tokens, self.fixed_s)
        if not all(math.isfinite(v) and v >= 0 for v in values):
            raise ValueError(f"the rule's coefficients must be finite and non-negative, got {self}")

    @classmethod
    def of_link(cls, prefill_s_per_token: float, prefill_s_per_token_pair: float, bytes_per_token: int,
                link_bytes_per_s: float, local_tokens: int = 0, fixed_s: float = FIXED_S) -> Rule:
        """The rule for KV of ``bytes_per_token`` bytes per token over a link of
        ``link_bytes_per_s``.

        Raises:
            ValueError: a bandwidth or byte count that is not positive, or a negative cost.
        """
        if not (bytes_per_token > 0 and link_bytes_per_s > 0):
            raise ValueError("bytes_per_token and link_bytes_per_s must be positive")
        return cls(prefill_s_per_token, prefill_s_per_token_pair, bytes_per_token / link_bytes_per_s,
                   local_tokens, fixed_s)

    def queue_s(self, tokens: int, token_pairs: float) -> float:
        """Predicted seconds of a prefill queue of prompts with ``tokens`` tokens in all and
        ``token_pairs`` the sum of ``n^2 / 2`` over them."""
        return self.prefill_s_per_token * tokens + self.prefill_s_per_token_pair * token_pairs

    def min_prompt_tokens(self, queue_s: float = 0.0) -> int | None:
        """The shortest prompt worth moving when the prefill replica has ``queue_s`` seconds of
        prompts before it (tokens), None when none is.

        Raises:
            ValueError: a negative or non-finite ``queue_s``.
        """
        if not (math.isfinite(queue_s) and queue_s >= 0):
            raise ValueError(f"queue_s must be finite seconds >= 0, got {queue_s!r}")
        a = self.prefill_s_per_token_pair / 2
        b = self.prefill_s_per_token - self.transfer_s_per_token
        c = self.fixed_s + queue_s
        if a <= 0:
            moved = None if b <= 0 else math.ceil(c / b - 1e-9)
        else:
            moved = math.ceil((-b + math.sqrt(b * b + 4 * a * c)) / (2 * a) - 1e-9)
        return None if moved is None else max(1, self.local_tokens + max(1, moved))

    def header(self) -> str:
        """The rule as a header value, e.g. ``c_p=0.0001;c_pa=1e-09;t=2e-06;l=16;c=0.01``."""
        return ";".join(f"{key}={getattr(self, name)!r}" for key, name in _KEYS.items())

    @classmethod
    def from_header(cls, value: str | None) -> Rule | None:
        """The rule in a :meth:`header` value; None when absent or unreadable (never raises)."""
        if not value or len(value) > MAX_HEADER_CHARS:
            return None
        fields: dict[str, float | int] = {}
        for item in value.split(";"):
            key, _, text = item.strip().partition("=")
            if key not in _KEYS or _KEYS[key] in fields:
                return None
            try:
                fields[_KEYS[key]] = int(text) if key == "l" else float(text)
            except ValueError:
                return None
        if len(fields) != len(_KEYS):
            return None
        try:
            return cls(**fields)
        except ValueError:
            return None


def min_prompt_tokens(prefill_s_per_token: float, prefill_s_per_token_pair: float, bytes_per_token: int,
                      link_bytes_per_s: float, fixed_s: float = FIXED_S) -> int | None:
    """The shortest prompt worth prefilling elsewhere with an idle prefill replica and nothing
    prefilled locally (tokens), None when none is: :meth:`Rule.min_prompt_tokens` of
    :meth:`Rule.of_link`.

    Raises:
        ValueError: a negative cost, or a bandwidth or byte count that is not positive.
    """
    return Rule.of_link(prefill_s_per_token, prefill_s_per_token_pair, bytes_per_token, link_bytes_per_s,
                        fixed_s=fixed_s).min_prompt_tokens()
