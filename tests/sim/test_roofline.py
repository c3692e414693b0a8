"""The simulator's step-time model: shipped model dims, hardware profiles, the roofline terms."""

from __future__ import annotations

import json

import pytest

from cadenza.sim.hardware import GB, PROFILES, TFLOPS, HardwareProfile, ProfileError, load_profile
from cadenza.sim.model_dims import ModelDimsError, load_model_dims
from cadenza.sim.roofline import Roofline, StepComposition


@pytest.mark.parametrize("name, billions", [("llama-3.1-8b", 8.03), ("llama-3.1-70b", 70.55), ("mistral-7b", 7.24),
                                            ("qwen2.5-7b", 7.62), ("smollm2-135m", 0.135)])
def test_shipped_configs_give_the_published_parameter_counts(name, billions):
    assert load_model_dims(name).num_params / 1e9 == pytest.approx(billions, rel=0.01)


def test_a_config_json_folder_loads_and_an_unknown_model_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "intermediate_size": 128,
                                                      "num_hidden_layers": 2, "num_attention_heads": 4,
                                                      "vocab_size": 100}))
    dims = load_model_dims(tmp_path)
    assert (dims.num_kv_heads, dims.head_dim) == (4, 16)  # defaults: MHA, hidden / heads
    with pytest.raises(ModelDimsError, match="unknown model"):
        load_model_dims("gpt-5")
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(ModelDimsError, match="missing or bad dimension"):
        load_model_dims(tmp_path)


def decode_step(rows: int, context: int) -> StepComposition:
    return StepComposition(decode_tokens=rows, decode_context_tokens=rows * context, num_rows=rows, num_sampled=rows)


def test_a_decode_step_is_the_roofline_figure_worked_by_hand():
    # Llama-3.1-8B, 8 decode rows of 1,000 tokens on one H100: everything weight- or KV-bandwidth-bound.
    hw, dims = PROFILES["h100-sxm"], load_model_dims("llama-3.1-8b")
    t = Roofline(dims, hw).step_time(decode_step(8, 1000))
    bw = 3350 * GB * 0.8
    layers_bytes = 32 * (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336) * 2
    assert t.linear_s == pytest.approx(layers_bytes / bw)
    assert t.lm_head_s == pytest.approx(4096 * 128256 * 2 / bw)
    assert t.decode_attention_s == pytest.approx(8 * 1000 * 2 * 8 * 128 * 2 * 32 / bw)  # the KV read
    assert t.prefill_attention_s == 0 and t.allreduce_s == 0
    assert t.fixed_s == pytest.approx(1.5e-3) and t.host_s == pytest.approx(50e-6 + 8 * 0.5e-6)
    assert t.dispatch_s == 0  # a roofline profile: the launches hide behind the device
    assert t.total_s == pytest.approx(7.3e-3, rel=0.05)  # ~7 ms: what a bf16 8B decodes at on an H100


def test_linear_layers_turn_compute_bound_past_the_devices_flop_per_byte_ratio():
    hw, dims = PROFILES["a100-80g"], load_model_dims("mistral-7b")
    model = Roofline(dims, hw)
    few = model.step_time(decode_step(16, 100)).linear_s
    assert few == pytest.approx(model.step_time(decode_step(1, 100)).linear_s)  # bandwidth-bound: flat
    chunk = StepComposition(prefill_tokens=4096, prefill_attention_tokens=4096 * 2048, num_rows=1, num_sampled=1)
    flops = 2 * 4096 * dims.num_layers * dims.layer_params
    assert model.step_time(chunk).linear_s == pytest.approx(flops / (312 * TFLOPS * 0.7))
    assert model.step_time(chunk).prefill_attention_s == pytest.approx(
        4 * 4096 * 2048 * 32 * 128 * 32 / (312 * TFLOPS * 0.5))


def test_tensor_parallelism_splits_the_work_and_adds_two_all_reduces_a_layer():
    hw, dims = PROFILES["h100-sxm"], load_model_dims("llama-3.1-70b")
    one, eight = Roofline(dims, hw, tp=1).step_time(decode_step(32, 500)), Roofline(dims, hw, tp=8).step_time(decode_step(32, 500))
    assert eight.linear_s == pytest.approx(one.linear_s / 8)
    assert one.allreduce_s == 0
    message = 32 * 8192 * 2
    assert eight.allreduce_s == pytest.approx(2 * 80 * (2 * 7 / 8 * message / (450 * GB) + 10e-6))
    with pytest.raises(ValueError, match="3 does not divide .* attention heads"):
        Roofline(dims, hw, tp=3)


def test_kv_capacity_is_the_memory_left_after_the_weights_and_refuses_a_model_that_does_not_fit():
    dims = load_model_dims("llama-3.1-8b")
    tokens = Roofline(dims, PROFILES["h100-sxm"]).kv_capacity_tokens(memory_utilization=0.9)
    free = 80 * GB * 0.85 - dims.num_params * 2
    assert tokens == int(free // (2 * 32 * 8 * 128 * 2))
    with pytest.raises(ValueError, match="do not fit"):
        Roofline(load_model_dims("llama-3.1-70b"), PROFILES["l40s"]).kv_capacity_tokens()


def test_an_empty_step_costs_nothing():
    assert Roofline(load_model_dims("smollm2-135m"), PROFILES["l40s"]).step_time(StepComposition()).total_s == 0


def test_profiles_check_their_values_and_load_from_a_calibrated_file(tmp_path):
    with pytest.raises(ProfileError, match="gemm_efficiency"):
        PROFILES["h200"].with_factors(gemm_efficiency=1.5)
    with pytest.raises(ProfileError, match="unknown profile fields"):
        PROFILES["h200"].with_factors(warp_speed=9.0)
    calibrated = PROFILES["h200"].with_factors(name="h200-measured", gemm_efficiency=0.62)
    path = tmp_path / "h200.json"
    path.write_text(json.dumps(calibrated.to_dict()))
    assert load_profile(path) == calibrated
    assert load_profile("h200") is PROFILES["h200"]
    with pytest.raises(ProfileError, match="unknown hardware profile"):
        load_profile("tpu-v5")
    path.write_text(json.dumps({"name": "x"}))
    with pytest.raises(ProfileError, match="not a hardware profile"):
        load_profile(path)
    with pytest.raises(ProfileError, match="peak_flops"):
        HardwareProfile("broken", 0, 1, 1, 1)
