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

Three profiles of one H200, each marked in :data:`PROFILE_BASIS`:

- ``h200`` (**measured**): cadenza as it ran on one H200 without CUDA graphs, the data-sheet
  device plus its eager runner's host dispatch fitted from measured steps
  (:mod:`cadenza.sim.dispatch`; a decode step takes ~12 ms at any batch up to 64).
- ``h200-roofline`` (**roofline**): the same device with no host time in the runner at all, the
  ideal "what if".
- ``h200-graphs`` (**projection**): the same device with the runner replaying CUDA graphs for
  decode steps and for steps that add one prefill chunk of at most
  :data:`GRAPH_MAX_PREFILL_TOKENS` tokens (every other step stays eager and keeps ``h200``'s
  dispatch). A graphed step's host time is estimated, not measured: see
  :data:`H200_GRAPH_PER_STEP_S`. ``cadenza sim calibrate --dispatch-only --base h200-graphs``
  fits it once a table measured with graphs on exists.

The other profiles are **roofline**-only until a table measured on them gives their dispatch.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from cadenza.node.core.config import CUDA_GRAPH_MAX_CHUNK

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
        dispatch_per_step_s, dispatch_per_row_s: the runner's host time to issue an eager step
            (dispatch of every kernel, input building, sampling's synchronisation), per step and
            per row; an eager step takes the longer of it and the device's time. 0 in the roofline
            profiles (an engine whose launches hide behind the device); fitted from a measured
            table by :func:`cadenza.sim.dispatch.fit_dispatch`.
        cuda_graphs: the runner replays CUDA graphs for the steps it captured: decode-only steps
            and steps whose prefill is one chunk of at most ``graph_max_prefill_tokens`` tokens
            (:func:`cadenza.sim.roofline.replays_graph`); other steps run eagerly. False: every
            step is eager.
        graph_max_prefill_tokens: the longest prefill chunk a graphed step takes (tokens; 0:
            decode-only steps alone).
        graph_per_step_s, graph_per_row_s: a graphed step's runner host time, per step and per
            row (inputs built and copied before the launch, the launch, the sampled tokens read
            after it): it does not overlap the device and adds to its time. Fitted from a table
            measured with graphs on by :func:`cadenza.sim.dispatch.fit_graph_replay`.
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
    cuda_graphs: bool = False
    graph_max_prefill_tokens: int = 0
    graph_per_step_s: float = 0.0
    graph_per_row_s: float = 0.0
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
        for f in ("overlap", "cuda_graphs"):
            if not isinstance(getattr(self, f), bool):
                raise ProfileError(f"{self.name}: {f} must be true or false, got {getattr(self, f)!r}")
        if isinstance(self.graph_max_prefill_tokens, bool) or not isinstance(self.graph_max_prefill_tokens, int) \
                or self.graph_max_prefill_tokens < 0:
            raise ProfileError(f"{self.name}: graph_max_prefill_tokens must be a whole number >= 0, "
                               f"got {self.graph_max_prefill_tokens!r}")
        for f in ("peak_flops", "memory_bandwidth", "memory_bytes", "link_bandwidth"):
            if not 0 < getattr(self, f) < math.inf:
                raise ProfileError(f"{self.name}: {f} must be positive and finite, got {getattr(self, f)!r}")
        for f in ("gemm_efficiency", "attention_efficiency", "memory_efficiency"):
            if not 0 < getattr(self, f) <= 1:
                raise ProfileError(f"{self.name}: {f} must be in (0, 1], got {getattr(self, f)!r}")
        for f in ("link_latency_s", "step_overhead_s", "device_per_row_s", "dispatch_per_step_s", "dispatch_per_row_s",
                  "graph_per_step_s", "graph_per_row_s", "host_per_step_s", "host_per_row_s"):
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

# The graphed steps of h200-graphs: decode-only steps and steps with one prefill chunk of at most this
# many tokens, the engine's own bound. Every other step is eager and keeps the eager dispatch above.
GRAPH_MAX_PREFILL_TOKENS = CUDA_GRAPH_MAX_CHUNK  # the engine's own bound (node/runner/cuda_graphs.py)

# A graphed step's runner host time on the H200 machine: a PROJECTION, not a measurement (no table was
# taken with graphs on yet). What replay leaves on the host, serial with the device:
# - the runner's own Python and numpy per step (the step's arrays, the pinned buffers filled): taken as
#   the scheduler's measured per-step time on the same host, work of the same kind and size: 86 us, the
#   intercept of host_seconds fitted on rows over the 8B table's decode steps (tests/sim/test_graphs.py
#   refits it);
# - the graph launch (torch's CUDAGraph.replay, one cudaGraphLaunch): 20 us. Published: CUDA.jl's
#   documentation measures 3.5 us of CPU time to launch an 80-kernel graph; NVIDIA's "Constant Time
#   Launch for Straight-Line CUDA Graphs" (CUDA 12.6, 2024) makes a straight-line graph's launch
#   independent of its node count, which grew with it before. A decode graph of Llama-3.1-8B holds a few
#   hundred kernels (32 layers of ~12); 20 us leaves room for an older driver, where it grows with them;
# - one H2D copy of the pinned inputs (a few KiB): 10 us; sampling's one synchronisation (the sampled
#   tokens read back): 20 us;
# - per row: the eager fit's per-row term, 15.8 us (the rows' arrays are built as before; replay removes
#   per-kernel launches, which do not grow with rows).
H200_RUNNER_PYTHON_PER_STEP_S = 86e-6
GRAPH_LAUNCH_S = 20e-6
GRAPH_INPUT_COPY_S = 10e-6
GRAPH_SAMPLING_SYNC_S = 20e-6
H200_GRAPH_PER_STEP_S = H200_RUNNER_PYTHON_PER_STEP_S + GRAPH_LAUNCH_S + GRAPH_INPUT_COPY_S + GRAPH_SAMPLING_SYNC_S
H200_GRAPH_PER_ROW_S = H200_EAGER_DISPATCH_PER_ROW_S

_H200 = HardwareProfile("h200-roofline", 989 * TFLOPS, 4800 * GB, 141 * GB, 450 * GB)
_H200_EAGER = replace(_H200, name="h200", dispatch_per_step_s=H200_EAGER_DISPATCH_PER_STEP_S,
                      dispatch_per_row_s=H200_EAGER_DISPATCH_PER_ROW_S)
PROFILES: dict[str, HardwareProfile] = {
    p.name: p
    for p in (
        HardwareProfile("a100-80g", 312 * TFLOPS, 2039 * GB, 80 * GB, 300 * GB),
        HardwareProfile("h100-sxm", 989 * TFLOPS, 3350 * GB, 80 * GB, 450 * GB),
        _H200_EAGER,
        _H200,
        replace(_H200_EAGER, name="h200-graphs", cuda_graphs=True, graph_max_prefill_tokens=GRAPH_MAX_PREFILL_TOKENS,
                graph_per_step_s=H200_GRAPH_PER_STEP_S, graph_per_row_s=H200_GRAPH_PER_ROW_S),
        HardwareProfile("l40s", 362 * TFLOPS, 864 * GB, 48 * GB, 32 * GB, link_latency_s=25e-6),
    )
}

# What each built-in profile's runner time rests on: "measured" (fitted from a step table taken on the
# part), "roofline" (data-sheet peaks and round efficiencies, no host time in the runner), "projection"
# (a host time estimated from measured parts and published figures, not yet measured whole).
PROFILE_BASIS: dict[str, str] = {
    "a100-80g": "roofline", "h100-sxm": "roofline", "l40s": "roofline", "h200-roofline": "roofline",
    "h200": "measured: eager runner, data/gpu/h200",
    "h200-graphs": "projection: CUDA graphs, not yet measured",
}


def describe_profiles() -> str:
    """The built-in profiles with what each rests on, for ``--hardware``'s help:
    ``"a100-80g (roofline), ..., h200 (measured: ...), ..."``."""
    return ", ".join(f"{name} ({PROFILE_BASIS[name]})" for name in PROFILES)


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
