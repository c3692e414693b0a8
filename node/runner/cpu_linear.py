"""Linear layers for fp32 on the CPU that come closer to the machine than torch's default.

On a CPU a decode step is a chain of matrix-vector products over weights read once per step, so
its speed is how close each product comes to memory bandwidth; a prefill chunk is a matrix
product, bound by arithmetic. PyTorch's default ``linear`` (MKL sgemm) falls short of both on this
project's AMD machine: ~15 GB/s for one row where a plain read reaches ~45, and half of oneDNN's
speed for 64-256 rows. Two replacements, in order of preference:

- :class:`CompiledLinear`, with the compiled ``cpu`` kernel backend: up to ``COMPILED_MAX_ROWS``
  rows through :func:`cadenza.kernels.cpu.linear_rows`, which streams each weight row once for all
  rows (2-2.5x torch's speed for one row); more rows through oneDNN's ``_linear_pointwise`` on
  the same plain weight (as fast as a pre-packed weight here, so no second copy is kept), which
  leads from ~8 rows on.
- :class:`PackedLinear`, where the compiled kernels are unavailable: oneDNN over a weight re-laid
  out once at load (``_reorder_linear_weight``), up to ~2x faster for wide layers and slower for
  other shapes at one row. So nothing is assumed: :func:`pack_linears` times both on each distinct
  weight shape of the loaded model (over 1 MiB; smaller ones live in cache), for 1 and 8 rows, once
  per process, and packs only the shapes where the packed form wins both by at least ``MIN_GAIN``
  (the choice is logged).

fp32 on the CPU only; elsewhere nothing changes. Outputs match ``F.linear`` to float rounding.
Measured in ``docs/benchmarks.md`` (``bench/decode_speed.py``).
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

logger = logging.getLogger(__name__)

COMPILED_MAX_ROWS = 4  # measured (2 threads, weights from memory): the compiled kernel leads oneDNN
# by ~1.3x at 4 rows, ties at 8, trails beyond
MIN_GAIN = 1.15  # packed must be this much faster, for 1 and for 8 rows
_PROBE_ROWS = (1, 8)
_PROBE_BYTES = 64 * 2**20  # probe over copies this large in all: weights come from memory, not cache
MIN_WEIGHT_BYTES = 2**20  # smaller weights stay in cache anyway: never packed, never probed
_decided: dict[tuple[tuple[int, ...], torch.dtype], bool] = {}  # per process: probed once per shape


def _available() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class CompiledLinear(nn.Module):
    """``y = x @ weight.T + bias`` ([out, in] weight): few rows by the compiled kernel, more by
    oneDNN (or ``F.linear`` where this torch build lacks it)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        from cadenza.kernels import cpu

        self.out_features, self.in_features = weight.shape
        self.weight = weight.detach().contiguous()
        self.bias = None if bias is None else bias.detach().contiguous()
        self._rows = cpu.linear_rows
        self._onednn = _available()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features)
        if x.shape[0] <= COMPILED_MAX_ROWS:
            y = self._rows(x, self.weight, self.bias)
        elif self._onednn:
            y = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        else:
            y = nn.functional.linear(x, self.weight, self.bias)
        return y.reshape(*lead, self.out_features)


class PackedLinear(nn.Module):
    """``y = x @ weight.T + bias`` over a oneDNN-packed copy of ``weight`` ([out, in])."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.packed, self.bias, "none", [], "")
        return y.reshape(*lead, self.out_features)


def _seconds(fn, repeats: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def packing_pays(weight: torch.Tensor) -> bool:
    """Is the packed form at least ``MIN_GAIN`` faster than ``F.linear`` on this weight, for 1 and
    for 8 rows, on this machine? Timed over enough copies that each is read from memory, as in a
    real step."""
    copies = [weight.clone() for _ in range(max(1, _PROBE_BYTES // (weight.numel() * weight.element_size())))]
    packed = [PackedLinear(w, None) for w in copies]
    for rows in _PROBE_ROWS:
        x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
        plain = _seconds(lambda x=x: [nn.functional.linear(x, w) for w in copies])
        if plain < MIN_GAIN * _seconds(lambda x=x: [p(x) for p in packed]):
            return False
    return True


def _linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if isinstance(child, nn.Linear)]


@torch.inference_mode()
def compile_linears(model: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """Replace every ``nn.Linear`` of an fp32 CPU model by :class:`CompiledLinear` (the caller
    has checked :func:`cadenza.kernels.cpu.available`).

    Returns:
        How many layers were replaced (0 off the CPU or below fp32).
    """
    if device.type != "cpu" or dtype != torch.float32:
        return 0
    linears = _linears(model)
    for parent, name, child in linears:
        setattr(parent, name, CompiledLinear(child.weight, child.bias))
    logger.info("compiled linear layers: %d (up to %d rows; more through %s)", len(linears), COMPILED_MAX_ROWS,
                "oneDNN" if _available() else "torch's")
    return len(linears)


@torch.inference_mode()
def pack_linears(model: nn.Module, device: torch.device, dtype: torch.dtype) -> dict[tuple[int, int], bool]:
    """Replace the model's ``nn.Linear`` layers by :class:`PackedLinear` for the weight shapes
    where it pays (see the module docstring).

    Returns:
        ``{(out, in): packed?}`` for every shape probed (empty when packing does not apply).
    """
    if device.type != "cpu" or dtype != torch.float32 or not _available():
        return {}
    linears = _linears(model)
    choice: dict[tuple[int, int], bool] = {}
    for parent, name, child in linears:
        shape = tuple(child.weight.shape)
        if shape not in choice:
            key = (shape, child.weight.dtype)
            if child.weight.numel() * child.weight.element_size() < MIN_WEIGHT_BYTES:
                _decided[key] = False
            elif key not in _decided:
                try:
                    _decided[key] = packing_pays(child.weight)
                except RuntimeError as exc:  # an op this build or CPU lacks: keep the plain layer
                    logger.info("packed linear unavailable (%s); keeping torch's", exc)
                    _decided[key] = False
            choice[shape] = _decided[key]
        if choice[shape]:
            setattr(parent, name, PackedLinear(child.weight, child.bias))
    logger.info("oneDNN-packed linear layers for shapes %s; torch's for %s",
                [s for s, p in choice.items() if p] or "none", [s for s, p in choice.items() if not p] or "none")
    return choice
