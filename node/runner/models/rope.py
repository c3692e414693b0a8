"""Rotary-embedding frequency tables, with ``rope_theta`` and ``rope_scaling``.

Frequencies follow RoFormer (Su et al., 2021): ``inv_freq[i] = theta ** (-2i / D)``. Scaling:
``linear`` divides every frequency by ``factor`` (Chen et al., 2023, position interpolation);
``llama3`` divides only the low frequencies, keeps the high ones and interpolates in between
(Meta's Llama 3.1 reference ``apply_scaling``).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """``[head_dim // 2]`` fp32 inverse frequencies, scaled as ``scaling`` says."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported")


def cos_sin_cache(
    head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None = None
) -> torch.Tensor:
    """``[max_position, head_dim]`` fp32 table: cos of each angle, then sin."""
    inv_freq = inverse_frequencies(head_dim, theta, scaling)
    positions = torch.arange(max_position, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)  # [P, D/2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)
