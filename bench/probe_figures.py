"""The GPU probe's pure parts (:mod:`bench.gpu_probe`): its models, the bytes and FLOPs of a step,
the kernels' busy time, the streams' gaps, and the result line with its targets. No device here.

A step's bytes and FLOPs are the simulator's roofline terms (:class:`cadenza.sim.roofline.Roofline`
on a unit profile: 1 FLOP/s and 1 byte/s), so the probe's floors and ``cadenza sim`` count alike.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from cadenza.node.core.messages import StepRecord
from cadenza.sim.calibrate import MeasuredStep
from cadenza.sim.hardware import HardwareProfile
from cadenza.sim.model_dims import SHIPPED, ModelDims
from cadenza.sim.roofline import Roofline, StepComposition

RECORDED = Path(__file__).resolve().parents[1] / "data" / "gpu" / "h200"  # step tables of one H200, no graphs
RECORDED_DEVICE = "H200"
# The tests' tiny random Llama (tests/support/tiny_models.py's defaults), for a quick run on the CPU.
TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 1024, "tie_word_embeddings": False}
# name: (target, "min" | "max"): the figure must be at least / at most the target.
TARGETS = {"ratio": (0.75, "min"), "gpu_busy": (0.85, "min"), "graphs_speedup": (2.5, "min"),
           "mixed_ratio": (0.7, "max"), "stall_ratio": (0.1, "max"), "prefill_ratio": (0.95, "min")}


def model_json(name: str) -> dict:
    """The ``config.json`` of the probe's model ``name``: a shipped simulator model
    (``sim/models/NAME.json``, Hugging Face's dimensions, which the engine's ``ModelConfig``
    reads as they are) or ``tiny`` (:data:`TINY`).

    Raises:
        FileNotFoundError: no shipped model of that name.
    """
    return dict(TINY) if name == "tiny" else json.loads((SHIPPED / f"{name}.json").read_text())


def _unit_roofline(dims: ModelDims, dtype_bytes: int) -> Roofline:
    """The roofline at a peak of 1 FLOP/s and 1 byte/s: its compute terms are FLOPs, its memory
    terms bytes."""
    unit = HardwareProfile("unit", peak_flops=1.0, memory_bandwidth=1.0, memory_bytes=1.0, link_bandwidth=1.0,
                           dtype_bytes=dtype_bytes)
    return Roofline(dims, unit)


def step_bytes(dims: ModelDims, step: StepComposition, dtype_bytes: int) -> float:
    """Bytes a step must read from device memory: every layer's weights, the LM head's when a
    row samples, and the decode rows' KV (the simulator's roofline memory terms,
    :meth:`cadenza.sim.roofline.Roofline.unit_terms`; the embedding's gathered rows and the
    activations left out)."""
    u = _unit_roofline(dims, dtype_bytes).unit_terms(step)
    return u.linear_memory_s + u.lm_head_memory_s + u.decode_attention_memory_s


def step_flops(dims: ModelDims, step: StepComposition) -> float:
    """FLOPs of a step: ``2 x params x tokens`` over the layers, the LM head's for the rows that
    sample, and attention's (``4 x pairs x heads x head_dim`` per layer) — the roofline's compute
    terms."""
    u = _unit_roofline(dims, 2).unit_terms(step)
    return u.linear_compute_s + u.lm_head_compute_s + u.prefill_attention_s + u.decode_attention_compute_s


def composition(record: StepRecord) -> StepComposition:
    """A step record's composition, as the step log holds it."""
    return StepComposition(record.num_prefill_tokens, record.num_decode_tokens, record.decode_context_tokens,
                           record.prefill_attention_tokens, record.num_rows, record.num_sampled)


def floor_fraction(nbytes: float, bandwidth_gb_s: float, step_s: float) -> float:
    """The memory floor of a step (``nbytes`` at ``bandwidth_gb_s``) as a share of its measured
    ``step_s``: 1 means the step took no longer than reading its bytes once."""
    return nbytes / (bandwidth_gb_s * 1e9) / step_s


def busy_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals (overlapping kernels count once)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def kernel_intervals(events: Iterable) -> list[tuple[float, float]]:
    """``(start, end)`` seconds of the CUDA kernels among ``torch.profiler`` events
    (``FunctionEvent``: ``device_type``, ``name``, ``time_range`` in µs); copies, memsets and
    annotations projected onto the GPU's timeline are left out."""
    from torch.autograd import DeviceType

    return [(e.time_range.start * 1e-6, e.time_range.end * 1e-6) for e in events
            if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
            and not e.name.startswith(("Memcpy", "Memset"))]


def max_gap(times: Iterable[Sequence[float]]) -> float:
    """The longest gap between consecutive times of any one sequence (seconds; 0 when none has
    two): a stream's max ITL, from the times its tokens arrived."""
    return max((b - a for seq in times for a, b in zip(seq, seq[1:])), default=0.0)


def recorded_tflops(steps: Sequence[MeasuredStep], dims: ModelDims, prefill_tokens: int) -> float | None:
    """Median TFLOP/s (:func:`step_flops` over the step's seconds) of a recorded table's steps of
    at least 90 % of ``prefill_tokens`` prefill tokens; None when it has none."""
    rates = [step_flops(dims, s.composition) / s.seconds / 1e12 for s in steps
             if s.composition.prefill_tokens >= 0.9 * prefill_tokens]
    return statistics.median(rates) if rates else None


def calibration_base(device: str) -> str:
    """The simulator's hardware profile a calibration on ``device`` (a CUDA device's name, or
    ``cpu``) starts from: its data-sheet roofline, ``h100-sxm`` for a part without one."""
    for part, profile in (("H200", "h200-roofline"), ("H100", "h100-sxm"), ("A100", "a100-80g"), ("L40S", "l40s")):
        if part in device.upper():
            return profile
    return "cpu" if device == "cpu" else "h100-sxm"


def headline(sections: Mapping[str, dict]) -> dict:
    """The ratios of :data:`TARGETS` from the sections' figures (None where a section was skipped,
    failed or had nothing to compare)."""
    decode, graphs = sections.get("decode", {}), sections.get("graphs", {})
    rows = decode.get("rows") or []
    speedups = graphs.get("speedup") or {}
    return {
        "ratio": rows[0].get("floor_fraction") if rows else None,
        "gpu_busy": sections.get("gpu_busy", {}).get("share"),
        "graphs_speedup": speedups[min(speedups)] if speedups else None,
        "mixed_ratio": sections.get("mixed", {}).get("ratio"),
        "stall_ratio": sections.get("stall", {}).get("ratio"),
        "prefill_ratio": sections.get("prefill", {}).get("ratio_vs_recorded"),
    }


def result_line(sections: Mapping[str, dict], env: Mapping[str, object]) -> dict:
    """The probe's last line: ``benchmark``, each headline ratio beside its target (``ratio`` /
    ``target``, then ``NAME`` / ``NAME_target``, where ``mixed_ratio``'s target is ``mixed_target``),
    ``met`` (each ratio's verdict, None when it is missing), ``pass`` (every one met), ``env``'s
    entries and every section's figures."""
    figures = headline(sections)
    line: dict = {"benchmark": "gpu_probe"}
    met = {}
    for name, value in figures.items():
        target, kind = TARGETS[name]
        line[name] = None if value is None else round(value, 4)
        line["target" if name == "ratio" else f"{name.removesuffix('_ratio')}_target"] = target
        met[name] = None if value is None else (value >= target if kind == "min" else value <= target)
    return {**line, "met": met, "pass": all(met.values()), **env, "sections": dict(sections)}
