"""Per-request token sampling: greedy, temperature, top-k, top-p, seeded.

Greedy rows take the argmax. Other rows divide the logits by the temperature, keep the ``top_k``
most likely tokens, then the smallest set whose probability reaches ``top_p`` (nucleus sampling,
Holtzman et al., 2020) — always at least the most likely token — and draw from what is left with
the request's own ``torch.Generator``, so a given ``seed`` reproduces its output whatever else
shares the batch.
"""

from __future__ import annotations

from typing import Sequence

import torch

from cadenza.node.core.request import SamplingParams


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> list[int]:
    """Pick one token per row.

    Args:
        logits: ``[R, V]`` fp32.
        params: one per row.
        generators: one per row (None for greedy rows).

    Returns:
        ``R`` token ids.
    """
    tokens = logits.argmax(dim=-1).tolist()
    for i, sp in enumerate(params):
        if not sp.greedy:
            tokens[i] = _sample_row(logits[i], sp, generators[i])
    return tokens


def _sample_row(logits: torch.Tensor, sp: SamplingParams, generator: torch.Generator | None) -> int:
    logits = logits / sp.temperature
    if sp.top_k and sp.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sp.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sp.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # probability of strictly likelier tokens
        drop = mass_before >= sp.top_p
        drop[0] = False  # the most likely token always stays, whatever top_p rounds to
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0:
        return int(logits.argmax())  # degenerate distribution: never fail the step over one row
    return int(torch.multinomial(probs, 1, generator=generator).item())


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    """A generator for one request, seeded."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g
