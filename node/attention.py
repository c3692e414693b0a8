"""The attention interface between the model and a kernel backend.

A backend does one thing per layer: write the step's new keys and values into the paged KV cache
at ``slot_mapping``, then attend every query token of the mixed batch over its sequence's blocks.
The model never sees how; swapping backends (torch references, Triton kernels) changes nothing
else.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from cadenza.kernels import reference

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class AttentionMetadata:
    """Where each token of a step goes and what it attends to.

    Attributes:
        slot_mapping: ``[T]`` int64 cache slot of each new token.
        query_start_loc: ``[S + 1]`` int32 cumulative query lengths of the rows, from 0.
        seq_lens: ``[S]`` int32 tokens of each sequence including this step's.
        block_tables: ``[S, max_blocks]`` int32 block ids of each sequence (zero-padded).
        max_query_len: longest row in tokens.
        max_seq_len: longest sequence in tokens.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int


class AttentionBackend(Protocol):
    """Writes new K/V into the paged cache and computes attention for a mixed batch."""

    name: str

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """``q [T, Hq, D]``, ``k, v [T, Hkv, D]``, caches ``[NB, BS, Hkv, D]`` -> ``[T, Hq, D]``."""
        ...


class TorchAttentionBackend:
    """Plain-torch paged attention (``cadenza.kernels.reference``); runs anywhere."""

    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):  # noqa: D102 - see the Protocol
        reference.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        return reference.paged_attention(
            q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale
        )


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend for ``name`` (``auto`` | ``torch``) on ``device``.

    Raises:
        ValueError: an unknown or unavailable backend.
    """
    if name in ("auto", "torch"):
        return TorchAttentionBackend()
    raise ValueError(f"attention backend {name!r} is not available; use 'torch'")
