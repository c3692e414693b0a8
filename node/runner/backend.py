"""Kernel backends: the five ops the model runs, from plain torch, Triton or compiled C++.

The model never calls a kernel directly; it calls a :class:`KernelBackend`: ``rms_norm``,
``rotary_embedding``, ``silu_and_mul`` and ``attention`` (write the step's new K/V into the
paged cache at ``slot_mapping``, then attend every query token of the mixed batch over its
sequence's blocks). Two backends share one contract, tested against each other:

- ``torch``: :mod:`cadenza.kernels.reference`, runs anywhere;
- ``triton``: cadenza's Triton kernels; native on a CUDA GPU, under the Triton interpreter on
  a CPU (correct, and 50-250x slower: for tests);
- ``cpu``: :mod:`cadenza.kernels.cpu`, C++ compiled once per machine, fp32 on the CPU (the
  model's linear layers then use its few-row kernel too: :mod:`cadenza.node.runner.cpu_linear`).

Selection: the ``attention_backend`` setting (``--attention-backend``); when it is ``auto``, the
``CADENZA_ATTENTION_BACKEND`` environment variable (``triton`` | ``torch`` | ``cpu``); else
``triton`` on a CUDA device with Triton installed, ``cpu`` for float32 on the CPU where the
kernels build (a C++ compiler and ninja), and ``torch`` otherwise.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import Protocol

import torch

from cadenza.kernels import reference
from cadenza.node.core.config import ATTENTION_BACKENDS, ConfigError

logger = logging.getLogger(__name__)

ENV_VAR = "CADENZA_ATTENTION_BACKEND"


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


class KernelBackend(Protocol):
    """The ops a Llama-family layer needs; shapes as in :mod:`cadenza.kernels.reference`."""

    name: str

    def rms_norm(self, x, weight, eps, residual=None): ...

    def rotary_embedding(self, positions, q, k, cos_sin_cache): ...

    def silu_and_mul(self, x): ...

    def attention(
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


class TorchBackend:
    """Plain-torch references (:mod:`cadenza.kernels.reference`); runs anywhere."""

    name = "torch"
    rms_norm = staticmethod(reference.rms_norm)
    rotary_embedding = staticmethod(reference.rotary_embedding)
    silu_and_mul = staticmethod(reference.silu_and_mul)

    def attention(self, q, k, v, k_cache, v_cache, meta, scale):  # noqa: D102 - see the Protocol
        reference.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        return reference.paged_attention(
            q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale
        )


class CpuBackend:
    """cadenza's compiled CPU kernels (:mod:`cadenza.kernels.cpu`), fp32 only."""

    name = "cpu"

    def __init__(self) -> None:
        from cadenza.kernels import cpu

        self._cpu = cpu
        self.rms_norm = cpu.rms_norm
        self.rotary_embedding = cpu.rotary_embedding
        self.silu_and_mul = cpu.silu_and_mul

    def attention(self, q, k, v, k_cache, v_cache, meta, scale):  # noqa: D102 - see the Protocol
        return self._cpu.paged_attention(q, k, v, k_cache, v_cache, meta.slot_mapping, meta.query_start_loc,
                                         meta.seq_lens, meta.block_tables, scale)


class TritonBackend:
    """cadenza's Triton kernels (:mod:`cadenza.kernels`)."""

    name = "triton"

    def __init__(self) -> None:
        from cadenza.kernels import activation, attention, cache, norm, rotary

        self._attention, self._cache = attention, cache
        self.rms_norm = norm.rms_norm
        self.rotary_embedding = rotary.rotary_embedding
        self.silu_and_mul = activation.silu_and_mul

    def attention(self, q, k, v, k_cache, v_cache, meta, scale):  # noqa: D102 - see the Protocol
        self._cache.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        return self._attention.paged_attention(
            q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale,
            max_query_len=meta.max_query_len,
        )


def resolve_backend_name(name: str, device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    """``auto`` resolved through ``CADENZA_ATTENTION_BACKEND``, the device and the dtype.

    Raises:
        ConfigError: an unknown name, ``triton`` without Triton installed, or ``cpu`` off the CPU,
            below float32 or where the kernels do not build (the reason is in the message).
    """
    if name == "auto":
        name = os.environ.get(ENV_VAR, "").strip().lower() or "auto"
        if name not in ATTENTION_BACKENDS:
            raise ConfigError("attention_backend", f"{ENV_VAR}={name!r}; use one of {', '.join(ATTENTION_BACKENDS)}")
    triton_installed = importlib.util.find_spec("triton") is not None
    if name == "auto":
        if device.type == "cuda":
            return "triton" if triton_installed else "torch"
        return "cpu" if dtype == torch.float32 and _cpu_kernels_build() else "torch"
    if name == "triton" and not triton_installed:
        raise ConfigError("attention_backend", "triton is not installed (pip install triton)")
    if name == "cpu":
        if device.type != "cpu" or dtype != torch.float32:
            raise ConfigError("attention_backend", f"cpu runs float32 on the CPU only, not {dtype} on {device}")
        if not _cpu_kernels_build():
            from cadenza.kernels import cpu

            raise ConfigError("attention_backend", f"the compiled CPU kernels did not build ({cpu.build_error()})")
    return name


def _cpu_kernels_build() -> bool:
    from cadenza.kernels import cpu

    return cpu.available()


def select_backend(name: str, device: torch.device, dtype: torch.dtype = torch.float32) -> KernelBackend:
    """The kernel backend for ``name`` (``auto`` | ``torch`` | ``triton`` | ``cpu``) on ``device``."""
    name = resolve_backend_name(name, device, dtype)
    if name == "torch":
        return TorchBackend()
    if name == "cpu":
        return CpuBackend()
    if device.type == "cpu":
        logger.warning("triton backend on CPU: kernels run under the Triton interpreter (slow; for testing)")
    return TritonBackend()
