"""Accelerator profiles for the simulator's step-time model: peaks from the vendors' data sheets,
and the efficiency factors that turn a peak into what serving kernels reach.

A profile is what the roofline in :mod:`cadenza.sim.roofline` needs: dense matrix throughput for
the model's dtype (FLOP/s), memory bandwidth (bytes/s) and capacity (bytes), the link tensor
parallelism all-reduces over (bytes/s per direction, and a per-collective latency), and fixed
per-step costs. Efficiency factors are stated, not hidden: ``gemm_efficiency`` is the share of the
peak a large bf16 GEMM sustains (0.6-0.75 is what cuBLAS reaches on these parts at serving shapes),
``attention_efficiency`` the share an attention kernel reaches in its compute-bound (prefill)
regime, ``memory_efficiency`` the share of the bandwidth a weight or KV stream reaches. They are
the knobs a calibration from measured steps fits; the defaults below are round figures,
documented as such, until a measured table replaces them.

Sources (dense, no sparsity): NVIDIA A100 data sheet (312 TFLOP/s bf16, 2,039 GB/s HBM2e,
NVLink 600 GB/s total), H100 SXM data sheet (989 TFLOP/s bf16, 3.35 TB/s HBM3, NVLink 900 GB/s
total), H200 data sheet (989 TFLOP/s, 4.8 TB/s HBM3e, 141 GB), L40S data sheet (362 TFLOP/s bf16
dense, 864 GB/s GDDR6, 48 GB, PCIe Gen4 x16).

``h200`` is cadenza as it runs on one H200 today: the data-sheet device plus the host dispatch of
its eager runner, fitted from measured steps (:mod:`cadenza.sim.dispatch`; a decode step takes
~12 ms at any batch up to 64). ``h200-roofline`` is the same device with no dispatch: an engine
whose launches hide behind the device (CUDA graphs), for "what if". The other profiles are
roofline-only until a table measured on them gives their dispatch.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

GB = 1e9
TFLOPS = 1e12


class ProfileError(ValueError):
    """A hardware profile that names no known part or holds an impossible value."""


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    """One accelerator as the step-time model sees it.

    Attributes:
        name: the profile's name (``h100-sxm``, ``a100-80g``, ...).
        peak_flops: dense matrix FLOP/s in the serving dtype.
        memory_bandwidth: bytes/s of device memory.
        memory_bytes: device memory capacity, bytes.
        link_bandwidth: bytes/s per direction between two devices of a tensor-parallel group.
        link_latency_s: fixed seconds per collective (launch and synchronisation).
        gemm_efficiency, attention_efficiency, memory_efficiency: shares of the peaks reached (0, 1].
        step_overhead_s: fixed seconds per step on the device (launches not hidden by graphs,
            sampling kernels).
        device_per_row_s: device seconds per row of the batch beyond its tokens (per-sequence
            metadata, sampling); 0 in the data-sheet profiles, fitted by a calibration.
        dispatch_per_step_s, dispatch_per_row_s: the runner's host time to issue a step (eager
            dispatch of every kernel, input building, sampling's synchronisation), per step and
            per row; a step takes the longer of it and the device's time. 0 in the roofline
            profiles (an engine whose launches hide behind the device); fitted from a measured
            table by :func:`cadenza.sim.dispatch.fit_dispatch`.
        host_per_step_s, host_per_row_s: the scheduler's CPU time per step and per row
            (``schedule()`` + ``update_from_output()``; :mod:`bench.scheduler_overhead` measures it).
        dtype_bytes: bytes per weight and per KV element (2: bf16).
        overlap: a kernel's compute and memory traffic overlap, so a term costs the slower of the
            two (a GPU's roofline); False: they add (a CPU core streaming weights between its
            FMAs, as calibrations on this project's CPU runner find).
        gemm_curve: ``((tokens, efficiency), ...)``, tokens increasing: the GEMM efficiency at a
            step of that many rows (a GEMM's ``M``), linear between knots and level beyond the
            ends; empty: ``gemm_efficiency`` at every size. Small-``M`` GEMMs use other kernels
            and reach less of the peak; a calibration fits one knot per power of two it has data at.
    """

    name: str
    peak_flops: float
    memory_bandwidth: float
    memory_bytes: float
    link_bandwidth: float
    link_latency_s: float = 10e-6
    gemm_efficiency: float = 0.7
    attention_efficiency: float = 0.5
    memory_efficiency: float = 0.8
    step_overhead_s: float = 1.5e-3
    device_per_row_s: float = 0.0
    dispatch_per_step_s: float = 0.0
    dispatch_per_row_s: float = 0.0
    host_per_step_s: float = 50e-6
    host_per_row_s: float = 0.5e-6
    dtype_bytes: int = 2
    overlap: bool = True
    gemm_curve: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        try:
            curve = tuple((float(t), float(e)) for t, e in self.gemm_curve)
        except (TypeError, ValueError):
            raise ProfileError(f"{self.name}: gemm_curve must be a list of [tokens, efficiency] pairs, "
                               f"got {self.gemm_curve!r}") from None
        object.__setattr__(self, "gemm_curve", curve)
        if (any(not (0 < t < math.inf and 0 < e <= 1) for t, e in curve)
                or any(b[0] <= a[0] for a, b in zip(curve, curve[1:]))):
            raise ProfileError(f"{self.name}: gemm_curve needs increasing finite token counts above 0 and "
                               "efficiencies in (0, 1]")
        if not isinstance(self.overlap, bool):
            raise ProfileError(f"{self.name}: overlap must be true or false, got {self.overlap!r}")
        for f in ("peak_flops", "memory_bandwidth", "memory_bytes", "link_bandwidth"):
            if not 0 < getattr(self, f) < math.inf:
                raise ProfileError(f"{self.name}: {f} must be positive and finite, got {getattr(self, f)!r}")
        for f in ("gemm_efficiency", "attention_efficiency", "memory_efficiency"):
            if not 0 < getattr(self, f) <= 1:
                raise ProfileError(f"{self.name}: {f} must be in (0, 1], got {getattr(self, f)!r}")
        for f in ("link_latency_s", "step_overhead_s", "device_per_row_s", "dispatch_per_step_s", "dispatch_per_row_s",
                  "host_per_step_s", "host_per_row_s"):
            if not 0 <= getattr(self, f) < math.inf:
                raise ProfileError(f"{self.name}: {f} must be finite and >= 0, got {getattr(self, f)!r}")
        if self.dtype_bytes not in (1, 2, 4):
            raise ProfileError(f"{self.name}: dtype_bytes must be 1, 2 or 4, got {self.dtype_bytes!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    def gemm_efficiency_at(self, tokens: float) -> float:
        """The GEMM efficiency at a step of ``tokens`` rows (see ``gemm_curve``)."""
        curve = self.gemm_curve
        if not curve:
            return self.gemm_efficiency
        if tokens <= curve[0][0]:
            return curve[0][1]
        for (t0, e0), (t1, e1) in zip(curve, curve[1:]):
            if tokens <= t1:
                return e0 + (e1 - e0) * (tokens - t0) / (t1 - t0)
        return curve[-1][1]

    def with_factors(self, **factors: float) -> HardwareProfile:
        """A copy with some fields replaced (calibrated factors); unknown names raise ProfileError."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(factors) - known)
        if unknown:
            raise ProfileError(f"{self.name}: unknown profile fields {unknown}")
        return replace(self, **factors)


# cadenza's eager runner on one H200 (data/gpu/h200/steps-llama-3.1-8b.jsonl, no CUDA graphs):
# :func:`cadenza.sim.dispatch.fit_dispatch` over the h200 roofline; tests/sim/test_dispatch.py refits it.
H200_EAGER_DISPATCH_PER_STEP_S = 12.27e-3
H200_EAGER_DISPATCH_PER_ROW_S = 15.8e-6

_H200 = HardwareProfile("h200-roofline", 989 * TFLOPS, 4800 * GB, 141 * GB, 450 * GB)
PROFILES: dict[str, HardwareProfile] = {
    p.name: p
    for p in (
        HardwareProfile("a100-80g", 312 * TFLOPS, 2039 * GB, 80 * GB, 300 * GB),
        HardwareProfile("h100-sxm", 989 * TFLOPS, 3350 * GB, 80 * GB, 450 * GB),
        replace(_H200, name="h200", dispatch_per_step_s=H200_EAGER_DISPATCH_PER_STEP_S,
                dispatch_per_row_s=H200_EAGER_DISPATCH_PER_ROW_S),
        _H200,
        HardwareProfile("l40s", 362 * TFLOPS, 864 * GB, 48 * GB, 32 * GB, link_latency_s=25e-6),
    )
}


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """A built-in profile by name, or one written to a JSON file (e.g. by ``cadenza sim calibrate``).

    Raises:
        ProfileError: an unknown name, or a file whose fields are missing, unknown or out of range.
        OSError: the file cannot be read.
    """
    key = str(name_or_path)
    if key in PROFILES:
        return PROFILES[key]
    path = Path(key)
    if not path.suffix == ".json":
        raise ProfileError(f"unknown hardware profile {key!r}: one of {sorted(PROFILES)} or a .json file")
    try:
        data = json.loads(path.read_text())
        return HardwareProfile(**data)
    except ProfileError as exc:
        raise ProfileError(f"{path}: {exc}") from None
    except (TypeError, json.JSONDecodeError) as exc:
        raise ProfileError(f"{path}: not a hardware profile ({exc})") from exc
