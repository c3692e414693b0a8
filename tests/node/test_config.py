"""Configuration is checked at start-up, with messages that name the field."""

from __future__ import annotations

import pickle

import pytest

from cadenza.node.core.config import CacheConfig, ConfigError, EngineConfig, SchedulerConfig, resolve_max_model_len
from cadenza.node.core.policy import Policy, PolicyError
from cadenza.node.frontend.llm import Engine


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: SchedulerConfig(token_budget=0), "token_budget"),
        (lambda: SchedulerConfig(chunk_size=0), "chunk_size"),
        (lambda: SchedulerConfig(max_num_seqs=-1), "max_num_seqs"),
        (lambda: SchedulerConfig(max_model_len=0), "max_model_len"),
        (lambda: SchedulerConfig(token_budget=8.5), "token_budget"),
        (lambda: CacheConfig(block_size=12), "block_size"),
        (lambda: CacheConfig(num_kv_blocks=0), "num_kv_blocks"),
        (lambda: CacheConfig(num_kv_blocks=10, kv_cache_bytes=2**20), "num_kv_blocks"),
        (lambda: CacheConfig(kv_cache_fraction=1.5), "kv_cache_fraction"),
        (lambda: EngineConfig(model="m", dtype="float8"), "dtype"),
        (lambda: EngineConfig(model="m", device="tpu"), "device"),
        (lambda: EngineConfig(model="m", attention_backend="magic"), "attention_backend"),
        (lambda: EngineConfig(model=""), "model"),
    ],
)
def test_invalid_values_raise_naming_the_field(make, field):
    with pytest.raises(ConfigError, match=f"^{field}:"):
        make()


def test_a_config_error_carries_its_field_and_reason_apart_and_survives_pickling():
    with pytest.raises(ConfigError) as refused:
        SchedulerConfig(token_budget=0)
    assert (refused.value.field, refused.value.reason) == ("token_budget", "must be >= 1, got 0")
    assert str(refused.value) == "token_budget: must be >= 1, got 0"
    copy = pickle.loads(pickle.dumps(refused.value))
    assert type(copy) is ConfigError and (copy.field, copy.reason, str(copy)) == (
        "token_budget", "must be >= 1, got 0", str(refused.value))


def test_a_policy_error_names_the_setting_s_path_as_its_field():
    with pytest.raises(PolicyError) as refused:
        Policy().updated({"tenants": {"acme": {"weight": 0}}})
    assert refused.value.field == "tenants.acme.weight"
    assert str(refused.value) == f"tenants.acme.weight: {refused.value.reason}"
    with pytest.raises(PolicyError) as bad_class:
        Policy().updated({"classes": {"urgent": {}}})
    assert bad_class.value.field == "classes" and bad_class.value.reason.startswith("must be one of")


def test_configs_are_frozen():
    config = SchedulerConfig()
    with pytest.raises(AttributeError):
        config.token_budget = 1  # type: ignore[misc]


def test_a_chunk_larger_than_the_budget_is_capped_by_the_budget_not_refused():
    assert SchedulerConfig(token_budget=64, chunk_size=1000).effective_chunk_size == 64
    assert SchedulerConfig(token_budget=64, chunk_size=None).effective_chunk_size == 64


def test_running_requests_are_capped_by_the_budget_so_every_decode_fits():
    assert SchedulerConfig(token_budget=16, max_num_seqs=64).max_running == 16


def test_max_model_len_defaults_to_the_model_capped_by_the_kv_cache():
    assert resolve_max_model_len(None, model_max=8192, kv_capacity_tokens=4096) == 4096
    assert resolve_max_model_len(None, model_max=2048, kv_capacity_tokens=4096) == 2048


def test_explicit_max_model_len_beyond_the_model_or_the_kv_cache_is_refused():
    with pytest.raises(ConfigError, match="^max_model_len:"):
        resolve_max_model_len(10_000, model_max=8192, kv_capacity_tokens=100_000)
    with pytest.raises(ConfigError, match="^num_kv_blocks:.*lower max_model_len"):
        resolve_max_model_len(4096, model_max=8192, kv_capacity_tokens=1024)


def test_engine_refuses_a_kv_cache_that_cannot_hold_one_request(tiny_llama_dir):
    with pytest.raises(ConfigError, match="^num_kv_blocks:"):
        Engine.from_model(tiny_llama_dir, max_model_len=512, block_size=16, num_kv_blocks=8)


def test_prompt_longer_than_the_token_budget_is_served(tiny_llama_dir):
    engine = Engine.from_model(tiny_llama_dir, token_budget=8, chunk_size=None, max_model_len=256)
    from cadenza.node.core.request import SamplingParams

    (out,) = engine.generate([[5] * 100], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out) == 3
