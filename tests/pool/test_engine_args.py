"""A pool's spec.engine becomes the same engine configuration a replica validates."""

from __future__ import annotations

import pytest

from cadenza.node.cli import build_parser, engine_config_from_args
from cadenza.node.core.config import ConfigError
from cadenza.pool.engine_args import engine_config, serve_args

SPEC = {"tokenBudget": 256, "chunkSize": 128, "maxNumSeqs": 32, "maxModelLen": 4096, "blockSize": 16, "kvCacheFraction": 0.8}


def test_spec_engine_maps_onto_the_engine_config():
    config = engine_config("/models/m", SPEC, served_model_name="chat")
    assert config.scheduler.token_budget == 256 and config.scheduler.chunk_size == 128
    assert config.scheduler.max_model_len == 4096 and config.cache.kv_cache_fraction == 0.8
    assert config.model_name == "chat"


def test_serve_args_round_trip_through_the_cli_parser():
    args = build_parser().parse_args(["serve", "--model", "/models/m", *serve_args(SPEC)])
    assert engine_config_from_args(args) == engine_config("/models/m", SPEC)


def test_unlimited_chunk_size_renders_as_none():
    assert serve_args({"chunkSize": None}) == ["--chunk-size", "none"]


def test_invalid_values_are_refused_naming_the_crd_key():
    with pytest.raises(ConfigError, match=r"^spec\.engine\.tokenBudget:"):
        engine_config("/m", {"tokenBudget": 0})
    with pytest.raises(ConfigError, match=r"^spec\.engine\.blockSize:"):
        serve_args({"blockSize": 24})


def test_unknown_knobs_are_refused():
    with pytest.raises(ConfigError, match=r"^spec\.engine\.turbo:"):
        engine_config("/m", {"turbo": True})


def test_policy_knobs_become_a_policy_document_the_engine_accepts():
    engine = {"tokenBudget": 512, "prefixCaching": False, "stepTimeTargetMs": 150,
              "classes": {"batch": {"maxPrefillTokens": 64, "minShare": 0.2}},
              "tenants": {"gold": {"weight": 3, "maxConcurrent": 8}}}
    config = engine_config("/m", engine)
    policy = config.scheduler.policy
    assert policy.step_time_target_ms == 150 and policy.classes["batch"].max_prefill_tokens == 64
    assert policy.tenant("gold").weight == 3 and policy.tenant("gold").max_concurrent == 8
    assert not config.scheduler.prefix_caching
    assert serve_args(engine) == ["--token-budget", "512", "--no-prefix-caching"]
    from cadenza.pool.engine_args import policy_document

    assert policy_document(engine) == {"step_time_target_ms": 150,
                                       "classes": {"batch": {"max_prefill_tokens": 64, "min_share": 0.2}},
                                       "tenants": {"gold": {"weight": 3, "max_concurrent": 8}}}


def test_invalid_policy_values_are_refused_naming_the_setting():
    with pytest.raises(ConfigError, match=r"classes\.batch\.min_share"):
        engine_config("/m", {"classes": {"batch": {"minShare": 2}}})
    with pytest.raises(ConfigError, match=r"spec\.engine\.classes\.batch\.speed"):
        engine_config("/m", {"classes": {"batch": {"speed": 2}}})


def test_text_special_tokens_in_spec_engine_becomes_the_serve_flag_of_every_engine_pod():
    """Issue 28, point 10: the safe encoding of special-token text is a pool setting too."""
    from cadenza.pool.spec import Pool
    from cadenza.operator.render import render_all
    from cadenza.pool.validate import PoolValidationError, validate_pool

    spec = {"model": {"name": "llama", "source": {"path": "/models/llama"}}, "image": "cadenza:test",
            "engine": {**SPEC, "textSpecialTokens": "plain"}}
    pool = validate_pool({"apiVersion": "serving.cadenza.dev/v1alpha1", "kind": "ServingPool",
                          "metadata": {"name": "chat", "namespace": "prod"}, "spec": spec})
    (deployment,) = [o for o in render_all(Pool("chat", "prod", pool["spec"]), {"name": "chat", "uid": "u"})
                     if o["kind"] == "Deployment" and o["metadata"]["name"] == "chat-colocated"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--text-special-tokens") + 1] == "plain"
    parsed = build_parser().parse_args(["serve", "--model", "/models/m", *serve_args(spec["engine"])])
    assert engine_config_from_args(parsed).text_special_tokens == "plain"
    assert "--text-special-tokens" not in serve_args(SPEC)  # unset: the engine's default, control
    assert engine_config("/m", SPEC).text_special_tokens == "control"
    with pytest.raises(ConfigError, match=r"^spec\.engine\.textSpecialTokens: must be one of control, plain"):
        engine_config("/m", {"textSpecialTokens": "html"})
    with pytest.raises(PoolValidationError, match="textSpecialTokens"):
        validate_pool({"apiVersion": "serving.cadenza.dev/v1alpha1", "kind": "ServingPool",
                       "metadata": {"name": "chat", "namespace": "prod"},
                       "spec": {**spec, "engine": {"textSpecialTokens": "html"}}})
