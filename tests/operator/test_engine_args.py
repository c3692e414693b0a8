"""A pool's spec.engine becomes the same engine configuration a replica validates."""

from __future__ import annotations

import pytest

from cadenza.node.cli import build_parser, engine_config_from_args
from cadenza.node.config import ConfigError
from cadenza.operator.engine_args import engine_config, serve_args

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
