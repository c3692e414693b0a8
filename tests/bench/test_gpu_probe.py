"""The GPU probe's pure parts (``bench/probe_figures.py``): its models, the memory floor and FLOP
arithmetic, the kernel-busy union, the ITL gaps and the result line. Its quick run is smoke-tested
in ``test_quick.py``, its CUDA-only parts in ``test_gpu_probe_cuda.py``."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from bench_scripts import ROOT

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.probe_figures import (  # noqa: E402
    RECORDED,
    TARGETS,
    busy_seconds,
    calibration_base,
    floor_fraction,
    kernel_intervals,
    max_gap,
    model_json,
    recorded_tflops,
    result_line,
    step_bytes,
    step_flops,
)
from cadenza.node.runner.models.config import ModelConfig  # noqa: E402
from cadenza.sim.calibrate import load_step_table  # noqa: E402
from cadenza.sim.model_dims import load_model_dims  # noqa: E402
from cadenza.sim.roofline import StepComposition  # noqa: E402

LLAMA_8B_LAYER = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336  # q, k, v, o, gate, up, down
LLAMA_8B_HEAD = 4096 * 128256


@pytest.mark.parametrize("name", ["llama-3.1-8b", "smollm2-135m", "tiny"])
def test_the_engine_reads_the_simulators_dimensions_of_each_probe_model(name, tmp_path):
    engine = ModelConfig.from_dict(model_json(name))
    if name == "tiny":
        (tmp_path / "config.json").write_text(json.dumps(model_json(name)))
        sim = load_model_dims(tmp_path)
    else:
        sim = load_model_dims(name)
    assert (engine.hidden_size, engine.intermediate_size, engine.num_hidden_layers, engine.num_attention_heads,
            engine.num_key_value_heads, engine.head_dim, engine.vocab_size, engine.tie_word_embeddings) == (
        sim.hidden_size, sim.intermediate_size, sim.num_layers, sim.num_heads, sim.num_kv_heads, sim.head_dim,
        sim.vocab_size, sim.tie_word_embeddings)


def test_a_decode_step_reads_every_layer_the_lm_head_and_its_kv_but_not_the_embedding():
    dims = load_model_dims("llama-3.1-8b")
    kv_per_token = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads of 128, bf16
    one = step_bytes(dims, StepComposition(0, 1, 512, 0.0, 1, 1), 2)
    assert one == (32 * LLAMA_8B_LAYER + LLAMA_8B_HEAD) * 2 + 512 * kv_per_token
    many = step_bytes(dims, StepComposition(0, 32, 32 * 512, 0.0, 32, 32), 2)
    assert many - one == 31 * 512 * kv_per_token  # the weights are read once whatever the batch
    # On the recorded H200's copy bandwidth (4,245 GB/s) the batch-1 floor is ~3.55 ms.
    assert floor_fraction(one, 4245.0, 3.55e-3) == pytest.approx(1.0, abs=0.01)


def test_a_prefill_chunk_costs_two_flops_per_parameter_per_token_plus_attention():
    dims = load_model_dims("llama-3.1-8b")
    pairs = 2048 * (0 + 2048 / 2)  # a chunk from an empty context: sum n (start + n/2)
    chunk = StepComposition(2048, 0, 0, pairs, 1, 1)
    expected = 2 * 32 * LLAMA_8B_LAYER * 2048 + 2 * LLAMA_8B_HEAD * 1 + 4 * pairs * 32 * 128 * 32
    assert step_flops(dims, chunk) == pytest.approx(expected, rel=1e-12)


def test_overlapping_kernels_count_once_in_the_busy_time():
    assert busy_seconds([]) == 0.0
    assert busy_seconds([(3.0, 4.0), (0.0, 1.0), (0.5, 2.0)]) == pytest.approx(3.0)
    assert busy_seconds([(0.0, 10.0), (1.0, 2.0), (3.0, 4.0)]) == pytest.approx(10.0)  # nested


def _event(name: str, start_us: float, end_us: float, device=DeviceType.CUDA, annotation=False):
    return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation,
                           time_range=SimpleNamespace(start=start_us, end=end_us))


def test_only_cuda_kernels_count_as_busy():
    events = [_event("ampere_bf16_gemm", 0, 10), _event("aten::mm", 0, 50, device=DeviceType.CPU),
              _event("Memcpy HtoD (Pageable -> Device)", 10, 20), _event("Memset (Device)", 20, 21),
              _event("decode_step", 0, 100, annotation=True), _event("_paged_attn_fwd", 30, 35)]
    assert kernel_intervals(events) == [pytest.approx((0.0, 1e-5)), pytest.approx((3e-5, 3.5e-5))]


def test_the_max_itl_is_the_longest_gap_of_any_one_stream():
    assert max_gap([[0.0, 0.1, 0.2], [0.05, 0.55, 0.6]]) == pytest.approx(0.5)
    assert max_gap([[1.0], []]) == 0.0


def test_the_recorded_h200_prefill_rate_comes_from_its_2k_token_steps():
    dims = load_model_dims("llama-3.1-8b")
    steps = load_step_table(RECORDED / "steps-llama-3.1-8b.jsonl")
    rate = recorded_tflops(steps, dims, 2048)
    assert 300 < rate < 989  # below the H200's bf16 peak, and a prefill rate, not a decode one
    assert recorded_tflops(steps, dims, 100_000) is None


def test_each_device_calibrates_from_its_data_sheet_profile():
    assert calibration_base("NVIDIA H200") == "h200-roofline"
    assert calibration_base("NVIDIA H100 80GB HBM3") == "h100-sxm"
    assert calibration_base("cpu") == "cpu"
    assert calibration_base("NVIDIA GeForce RTX 4090") == "h100-sxm"


def _sections(**overrides) -> dict:
    sections = {
        "decode": {"rows": [{"batch": 1, "floor_fraction": 0.8}, {"batch": 32, "floor_fraction": 0.5}]},
        "gpu_busy": {"share": 0.9},
        "graphs": {"speedup": {32: 1.5, 1: 3.0}},
        "mixed": {"ratio": 0.6},
        "stall": {"ratio": 0.05},
        "prefill": {"ratio_vs_recorded": 1.02},
    }
    return {**sections, **overrides}


def test_the_result_line_puts_each_ratio_beside_its_target():
    line = result_line(_sections(), {"device": "NVIDIA H200", "torch": "2.11"})
    assert line["benchmark"] == "gpu_probe" and line["device"] == "NVIDIA H200"
    assert (line["ratio"], line["target"]) == (0.8, 0.75)
    assert line["graphs_speedup"] == 3.0  # batch 1's, the smallest batch
    assert (line["mixed_ratio"], line["mixed_target"], line["stall_target"], line["prefill_target"]) == (
        0.6, 0.7, 0.1, 0.95)
    assert line["gpu_busy_target"] == 0.85 and line["graphs_speedup_target"] == 2.5
    assert line["met"] == dict.fromkeys(TARGETS, True) and line["pass"] is True
    assert line["sections"]["stall"] == {"ratio": 0.05}


def test_a_missed_or_missing_ratio_fails_the_line():
    missed = result_line(_sections(mixed={"ratio": 0.71}), {})
    assert missed["met"]["mixed_ratio"] is False and missed["pass"] is False
    skipped = result_line(_sections(gpu_busy={"skipped": "needs CUDA"}, graphs={"error": "boom"}), {})
    assert skipped["gpu_busy"] is None and skipped["graphs_speedup"] is None
    assert skipped["met"]["gpu_busy"] is None and skipped["pass"] is False
    assert result_line({}, {})["ratio"] is None
