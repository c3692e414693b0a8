"""The knob registry: every door to an engine knob derives from one table."""

from __future__ import annotations

import argparse

import pytest

from cadenza.node.cli import add_engine_arguments, engine_config_from_args
from cadenza.node.core.config import ConfigError, SchedulerConfig
from cadenza.node.core.knobs import BY_CRD, KNOBS, LIVE, config_view, policy_from_view, reconfigured
from cadenza.node.core.policy import Policy
from cadenza.pool.engine_args import ENGINE_KNOBS, LIVE_KEYS, serve_args
from cadenza.pool.validate import load_crd_schema

_JSON_TYPES = {int: "integer", float: "number", bool: "boolean", dict: "object", str: "string"}


def crd_engine_schema() -> dict:
    return load_crd_schema()["properties"]["spec"]["properties"]["engine"]


def test_the_crds_engine_fields_are_exactly_the_registrys_pool_knobs_with_its_types_and_bounds():
    props = crd_engine_schema()["properties"]
    assert set(props) == set(BY_CRD)
    for crd, knob in BY_CRD.items():
        field = props[crd]
        assert field["type"] == _JSON_TYPES[knob.kind], crd
        if knob.minimum is not None or "minimum" in field:
            assert field.get("minimum") == knob.minimum, crd
        if knob.maximum is not None or "maximum" in field:
            assert field.get("maximum") == knob.maximum, crd
        if knob.choices and knob.kind is not str:
            assert field["enum"] == list(knob.choices), crd


def test_a_dedicated_roles_engine_may_hold_exactly_the_live_pool_knobs():
    dedicated = load_crd_schema()["properties"]["spec"]["properties"]["dedicated"]
    (rule,) = [r["rule"] for r in dedicated["x-kubernetes-validations"] if "self.engine.all" in r["rule"]]
    listed = rule.split("[", 1)[1].split("]", 1)[0]
    assert {k.strip(" '") for k in listed.split(",")} == set(LIVE_KEYS) == {c for c, k in BY_CRD.items() if k.live}


def test_every_knob_with_a_flag_is_a_cadenza_serve_option_with_the_registrys_default():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    options = {o for action in parser._actions for o in action.option_strings}
    defaults = vars(parser.parse_args([]))
    for knob in KNOBS:
        if knob.cli:
            assert knob.cli in options
            assert defaults[knob.name] == knob.default, knob.name


def test_the_cli_builds_the_configuration_from_the_registry(tiny_llama_dir):
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--model", str(tiny_llama_dir), "--token-budget", "96", "--chunk-size", "none",
                              "--no-prefix-caching", "--step-time-target-ms", "150", "--block-size", "32"])
    config = engine_config_from_args(args)
    assert (config.scheduler.token_budget, config.scheduler.chunk_size, config.scheduler.prefix_caching) == (96, None, False)
    assert config.scheduler.policy.step_time_target_ms == 150 and config.cache.block_size == 32


def test_the_operator_renders_the_registrys_flags():
    # plain knobs become flags; the policy ones (step-time target, classes, tenants) a --policy document
    assert {flag for _section, _name, flag in ENGINE_KNOBS.values()} == {
        k.cli for k in KNOBS if k.crd and k.cli and k.section != "policy"}
    assert serve_args({"tokenBudget": 64, "chunkSize": 32, "prefixCaching": False}) == [
        "--token-budget", "64", "--chunk-size", "32", "--no-prefix-caching"]


def test_the_admin_view_shows_every_scheduling_knob_and_reconfigure_takes_exactly_the_live_ones():
    config = SchedulerConfig(max_model_len=512)
    view = config_view(config)
    assert set(view) >= set(LIVE) | {"max_model_len"}
    assert policy_from_view(view) == config.policy == Policy()
    changed = reconfigured(config, {"token_budget": 64, "chunk_size": None, "watermark": 0.05,
                                    "classes": {"batch": {"min_share": 0.3}}})
    assert (changed.token_budget, changed.chunk_size, changed.policy.watermark) == (64, None, 0.05)
    assert changed.policy.classes["batch"].min_share == 0.3 and changed.max_model_len == 512


@pytest.mark.parametrize("changes, message", [
    ({"max_model_len": 9}, "max_model_len: cannot change on a running engine"),
    ({"block_size": 32}, "block_size: cannot change on a running engine"),
    ({"cuda_graphs": False}, "cuda_graphs: cannot change on a running engine"),
    ({"nonsense": 1}, "nonsense: unknown setting"),
    ({"token_budget": 0}, "token_budget: must be >= 1"),
])
def test_reconfigure_refuses_what_is_not_live_or_not_valid_naming_it(changes, message):
    with pytest.raises(ConfigError, match=message):
        reconfigured(SchedulerConfig(max_model_len=512), changes)


@pytest.mark.parametrize("engine, changes", [
    ({"tokenBudget": 512, "chunkSize": 100000}, {"chunk_size": 100000}),
    ({"tokenBudget": 128}, {"token_budget": 128}),  # the default chunk (256) over a smaller budget
])
def test_a_chunk_over_the_budget_is_refused_alike_by_a_pool_the_flags_and_a_live_change(engine, changes):
    """One rule, one message, from every door that takes settings (issue 28, point 8)."""
    from cadenza.pool.engine_args import engine_config

    with pytest.raises(ConfigError) as from_pool:
        engine_config("/model", engine)
    with pytest.raises(ConfigError) as live:
        reconfigured(SchedulerConfig(token_budget=512, chunk_size=256), changes)
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    flags = parser.parse_args(["--model", "/model", *(a for crd, v in engine.items() for a in (BY_CRD[crd].cli, str(v)))])
    with pytest.raises(ConfigError) as from_flags:
        engine_config_from_args(flags)
    message = str(live.value).partition(": ")[2]
    assert str(live.value).startswith("chunk_size: ") and "over the token budget" in message
    assert str(from_pool.value) == f"spec.engine.chunkSize: {message}"
    assert str(from_flags.value) == str(live.value)


def test_a_live_change_that_leaves_the_chunk_and_budget_alone_is_not_held_to_the_rule():
    """A replica started with a chunk over its budget (capped, as the engine always did) can still
    take other changes."""
    config = SchedulerConfig(token_budget=64, chunk_size=256)
    assert reconfigured(config, {"max_num_seqs": 4}).max_num_seqs == 4
    assert reconfigured(config, {"token_budget": 256}).token_budget == 256


def test_a_policy_file_over_the_tenant_limit_is_refused_as_a_pool_and_a_live_change_are(tmp_path):
    from cadenza.node.core.policy import MAX_TENANTS

    many = {f"t{i}": {"weight": 2} for i in range(MAX_TENANTS + 1)}
    policy = tmp_path / "policy.json"
    policy.write_text(__import__("json").dumps({"tenants": many}))
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    with pytest.raises(ValueError, match=f"^tenants: at most {MAX_TENANTS} tenants"):
        engine_config_from_args(parser.parse_args(["--model", "/model", "--policy", str(policy)]))
    with pytest.raises(ValueError, match=f"at most {MAX_TENANTS} tenants"):
        reconfigured(SchedulerConfig(), {"tenants": many})
