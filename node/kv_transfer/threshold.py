"""When moving a prompt's KV pays: the selective disaggregation rule.

A prompt of ``n`` uncached tokens prefilled on a decode replica takes its prefill time from that
replica's decode steps: with the engine's step-time model (:mod:`cadenza.node.core.cost_model`)
that is ``c_p n + c_pa n^2 / 2`` seconds, however the prompt is chunked (the attention term sums
``n_i (start_i + n_i / 2)`` over the chunks, which is ``n^2 / 2``). Prefilled on a prefill replica
instead, the decode replica pays the transfer, ``n b / B`` for ``b`` KV bytes per token over a link
of ``B`` bytes per second, plus a fixed cost ``c`` (one more HTTP round trip, the prefill replica's
queue, the prompt's last block prefilled locally). So move it when

    (c_pa / 2) n^2 + (c_p - b / B) n >= c

and :func:`min_prompt_tokens` is the smallest such ``n``. Without an attention term and with a
link slower than the prefill (``b / B >= c_p``) no prompt is worth moving.

Sources: DistServe (Zhong et al., OSDI 2024) and Splitwise (Patel et al., ISCA 2024) for the
phases' costs; llm-d's selective P/D threshold and Dynamo's prefill-length rule for moving only
long prompts.
"""

from __future__ import annotations

import math

FIXED_S = 0.01  # a round trip through the gateway, a prefill replica's idle queue and the last block


def min_prompt_tokens(prefill_s_per_token: float, prefill_s_per_token_pair: float, bytes_per_token: int,
                      link_bytes_per_s: float, fixed_s: float = FIXED_S) -> int | None:
    """The shortest prompt worth prefilling elsewhere (tokens), None when none is.

    Args:
        prefill_s_per_token: ``c_p``, seconds one prompt token's prefill adds to a decode
            replica's step (its cost model's prefill coefficient).
        prefill_s_per_token_pair: ``c_pa``, seconds per query-key pair of prefill attention.
        bytes_per_token: KV bytes per token (``2 x layers x KV heads x head dim x dtype size``).
        link_bytes_per_s: the transfer bandwidth between the replicas (measured).
        fixed_s: the fixed cost of going through a prefill replica.

    Raises:
        ValueError: a negative cost, or a bandwidth or byte count that is not positive.
    """
    if min(prefill_s_per_token, prefill_s_per_token_pair, fixed_s) < 0:
        raise ValueError("costs must be non-negative seconds")
    if not (bytes_per_token > 0 and link_bytes_per_s > 0):
        raise ValueError("bytes_per_token and link_bytes_per_s must be positive")
    a = prefill_s_per_token_pair / 2
    b = prefill_s_per_token - bytes_per_token / link_bytes_per_s
    if a <= 0:
        return None if b <= 0 else max(1, math.ceil(fixed_s / b))
    n = (-b + math.sqrt(b * b + 4 * a * fixed_s)) / (2 * a)
    return max(1, math.ceil(n - 1e-9))
