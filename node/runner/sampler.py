"""Token sampling for a whole step at once: greedy, temperature, top-k, top-p, seeded.

Greedy rows take the argmax. The other rows, as one batch: logits divided by each row's
temperature, all but each row's ``top_k`` most likely tokens masked, then all but the smallest set
whose probability reaches its ``top_p`` (nucleus sampling, Holtzman et al., 2020) — always at
least the most likely token. The draw is the exponential race (the Gumbel-max trick as vLLM's
sampler does it): ``argmax(p / q)`` with ``q ~ Exp(1)`` is a sample of ``p``. Each row's noise
comes from its request's own ``torch.Generator``, so a given ``seed`` reproduces its output
whatever else shares the batch; that per-row draw is the only loop, every other operation runs
once for the batch.
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
    greedy = logits.argmax(dim=-1)
    rows = [i for i, sp in enumerate(params) if not sp.greedy]
    if not rows:
        return greedy.tolist()
    picked = _sample_rows(logits[rows], [params[i] for i in rows], [generators[i] for i in rows])
    if len(rows) == len(params):
        return picked.tolist()
    greedy[torch.tensor(rows, device=logits.device)] = picked
    return greedy.tolist()


def _sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """``[N]`` token ids drawn from ``[N, V]`` logits, each row by its own parameters."""
    n, vocab = logits.shape
    device = logits.device
    temperature = torch.tensor([sp.temperature for sp in params], dtype=logits.dtype, device=device)
    scaled = logits / temperature.unsqueeze(1)
    top_k = [sp.top_k if 0 < sp.top_k < vocab else 0 for sp in params]
    if any(top_k):
        k = torch.tensor([kk or vocab for kk in top_k], device=device)
        kth = scaled.topk(int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))  # [N, 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    top_p = [sp.top_p for sp in params]
    if any(p < 1.0 for p in top_p):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # probability of strictly likelier tokens
        drop = mass_before >= torch.tensor(top_p, dtype=probs.dtype, device=device).unsqueeze(1)
        drop[:, 0] = False  # the most likely token always stays, whatever top_p rounds to
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs.masked_fill(drop, 0.0))
    noise = torch.empty_like(probs)
    for i, generator in enumerate(generators):
        noise[i].exponential_(generator=generator)
    picked = (probs / noise).argmax(dim=-1)
    degenerate = ~torch.isfinite(probs).all(dim=-1) | (probs.sum(dim=-1) <= 0)
    if bool(degenerate.any()):  # never fail the step over one row: fall back to its argmax
        picked = torch.where(degenerate, logits.argmax(dim=-1), picked)
    return picked


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    """A generator for one request, seeded."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g
