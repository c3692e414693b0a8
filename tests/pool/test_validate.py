"""A ServingPool is accepted, defaulted and refused as the Kubernetes API server would do it."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from cadenza.pool.validate import (
    PoolValidationError,
    apply_defaults,
    load_crd_schema,
    load_pools,
    validate_pool,
)
from cadenza.pool.spec import Pool, PoolSpecError

EXAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "examples"
MINIMAL = {
    "apiVersion": "serving.cadenza.dev/v1alpha1",
    "kind": "ServingPool",
    "metadata": {"name": "chat", "namespace": "default"},
    "spec": {"model": {"name": "SmolLM2-135M-Instruct"}},
}


def pool(**spec) -> dict:
    """The minimal pool with ``spec`` keys replaced."""
    obj = copy.deepcopy(MINIMAL)
    obj["spec"].update(spec)
    return obj


def problems_of(obj: dict, schema: dict | None = None) -> list[str]:
    with pytest.raises(PoolValidationError) as info:
        validate_pool(obj, schema)
    assert str(info.value) == "\n".join(info.value.problems)
    return info.value.problems


# --- accepted pools and defaults ------------------------------------------------------------------


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_example_pools_validate_and_run(example):
    [pool_] = load_pools(EXAMPLES / example)
    assert pool_["kind"] == "ServingPool"
    assert Pool(pool_["metadata"]["name"], "default", pool_["spec"]).roles()  # what only the engine's rules see


def test_examples_have_the_documented_shape():
    [cpu] = load_pools(EXAMPLES / "quickstart-cpu.yaml")
    [gpu] = load_pools(EXAMPLES / "chat-gpu.yaml")
    assert cpu["metadata"]["name"] == "quickstart" and cpu["spec"]["replicas"] == 2
    assert cpu["spec"]["model"] == {"name": "SmolLM2-135M-Instruct", "source": {"embedded": True}}
    assert "nvidia.com/gpu" not in cpu["spec"]["resources"]["limits"]
    assert gpu["spec"]["mode"] == "auto" and gpu["spec"]["replicas"] == 4
    assert gpu["spec"]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert gpu["spec"]["dedicated"]["engine"]["chunkSize"] < gpu["spec"]["engine"]["chunkSize"]
    [big] = load_pools(EXAMPLES / "llama-70b-tp4.yaml")
    big_pool = Pool("llama-70b", "default", big["spec"])
    assert big_pool.mode == "colocated" and big_pool.gpus == big_pool.tensor_parallel_size == 4
    assert big_pool.hub_model == "hf://meta-llama/Llama-3.1-70B-Instruct@main"


def test_defaults_land_where_the_crd_puts_them():
    spec = validate_pool(MINIMAL)["spec"]
    assert spec["mode"] == "colocated"
    assert spec["replicas"] == 1
    assert spec["image"] == "ghcr.io/cadenza-serving/cadenza:0.1.0"
    assert spec["gateway"] == {"image": "ghcr.io/cadenza-serving/cadenza-control-plane:0.1.0"}
    assert spec["model"]["source"] == {"embedded": True}
    assert spec["engine"] == {}
    assert spec["termination"] == {"gracePeriodSeconds": 600, "drainDelaySeconds": 10}
    assert spec["dedicated"] == {"interactiveReplicas": 1, "engine": {}}  # defaulted, then defaulted inside
    assert spec["controller"] == {"windowSeconds": 300, "fastWindowSeconds": 30, "minSamples": 200, "hysteresis": 0.1,
                                  "cooldownSeconds": 600, "flapWindowSeconds": 1800, "retuneFactor": 0.5,
                                  "staleSeconds": 60, "advisory": False, "drainTimeoutSeconds": 120,
                                  "disaggregate": True}
    assert "slo" not in spec and "resources" not in spec  # no default, so absent


def test_given_values_are_kept_and_defaults_fill_only_the_gaps():
    spec = validate_pool(pool(replicas=3, dedicated={"interactiveReplicas": 2}, controller={"advisory": True}))["spec"]
    assert spec["replicas"] == 3 and spec["dedicated"]["interactiveReplicas"] == 2
    assert spec["controller"]["advisory"] is True and spec["controller"]["windowSeconds"] == 300


def test_validation_returns_a_copy_and_leaves_the_input_alone():
    obj = pool()
    assert validate_pool(obj) is not obj
    assert obj == pool()


def test_null_values_are_pruned_then_defaulted():
    spec = validate_pool(pool(replicas=None, slo=None))["spec"]
    assert spec["replicas"] == 1 and "slo" not in spec


def test_defaults_follow_additional_properties_and_items():
    schema = {
        "type": "object",
        "properties": {
            "m": {"type": "object", "additionalProperties": {"type": "object", "properties": {"w": {"type": "integer", "default": 1}}}},
            "l": {"type": "array", "items": {"type": "object", "properties": {"w": {"type": "integer", "default": 2}}}},
        },
    }
    out = apply_defaults({"m": {"a": {}, "b": {"w": 5}}, "l": [{}, {"w": 7}]}, schema)
    assert out == {"m": {"a": {"w": 1}, "b": {"w": 5}}, "l": [{"w": 2}, {"w": 7}]}


def test_int_or_string_quantities_accept_both():
    spec = validate_pool(pool(resources={"requests": {"cpu": 2, "memory": "3Gi"}, "limits": {"nvidia.com/gpu": "1"}}))["spec"]
    assert spec["resources"]["requests"]["cpu"] == 2


def test_a_number_field_written_as_an_integer_is_a_number():
    assert validate_pool(pool(engine={"kvCacheFraction": 1}, controller={"hysteresis": 0}))["spec"]["engine"]["kvCacheFraction"] == 1


def test_dedicated_mode_with_a_batch_replica_left_is_accepted():
    assert validate_pool(pool(mode="dedicated", replicas=2))["spec"]["dedicated"]["interactiveReplicas"] == 1


def test_the_crd_schema_is_a_fresh_copy():
    schema = load_crd_schema()
    schema["properties"].clear()
    assert "spec" in load_crd_schema()["properties"]


# --- refused pools ----------------------------------------------------------------------------------


def test_chunk_size_above_token_budget_is_refused():
    [problem] = problems_of(pool(engine={"chunkSize": 1024, "tokenBudget": 512}))
    assert problem == "spec.engine: engine.chunkSize must not exceed engine.tokenBudget"


@pytest.mark.parametrize("bounds, message", [
    ({"chunkSize": {"min": 512}}, "bounds.chunkSize: min 512 exceeds max 256"),  # max defaults to engine.chunkSize
    ({"tokenBudget": {"max": 128}}, "bounds.tokenBudget: min 512 exceeds max 128"),  # min defaults to the engine's
])
def test_controller_bounds_that_invert_once_defaulted_are_refused(bounds, message):
    [problem] = problems_of(pool(engine={"chunkSize": 256}, controller={"bounds": bounds}))
    assert message in problem


def test_a_chunk_bound_given_alone_keeps_the_other_default():
    from cadenza.pool.live_knobs import knob_bounds

    spec = validate_pool(pool(engine={"chunkSize": 256}, controller={"bounds": {"chunkSize": {"max": 128}}}))["spec"]
    assert knob_bounds(spec)["chunk_size"] == (32, 128)  # not (256, 128): a shrink would read as a grow
    spec = pool(controller={"bounds": {"chunkSize": {"min": 1.5, "max": 100.5}, "tokenBudget": {}}})["spec"]
    assert knob_bounds(spec) == {"chunk_size": (2, 100), "token_budget": (512, 512)}  # integers round inwards


def test_a_tenant_map_over_the_policy_limit_is_refused_by_the_schema_and_the_engine_rules():
    from cadenza.node.core.policy import MAX_TENANTS

    many = {f"t{i}": {"weight": 2} for i in range(MAX_TENANTS + 1)}
    problem, skipped = problems_of(pool(engine={"tenants": many}))
    assert problem == f"spec.engine.tenants: Too many: {MAX_TENANTS + 1}: must have at most {MAX_TENANTS} items"
    assert "rules were not checked" in skipped
    validate_pool(pool(engine={"tenants": dict(list(many.items())[:MAX_TENANTS])}))
    half = dict(list(many.items())[:MAX_TENANTS // 2 + 1])
    spec = validate_pool(pool(mode="dedicated", replicas=2, engine={"tenants": half},
                              dedicated={"engine": {"tenants": {f"x{i}": {} for i in range(MAX_TENANTS // 2)}}}))["spec"]
    with pytest.raises(PoolSpecError, match=f"at most {MAX_TENANTS} tenants"):  # each map fits, merged they do not
        Pool("chat", "default", spec).roles()


def test_the_interactive_role_engine_is_checked_too():
    [problem] = problems_of(pool(dedicated={"engine": {"chunkSize": 1024, "tokenBudget": 512}}))
    assert problem.startswith("spec.dedicated.engine: engine.chunkSize must not exceed")


def test_negative_replicas_are_refused():
    [problem] = problems_of(pool(replicas=-1))
    assert problem == "spec.replicas: Invalid value: -1: should be greater than or equal to 0"


def test_replicas_above_the_maximum_are_refused():
    [problem] = problems_of(pool(replicas=1001))
    assert problem == "spec.replicas: Invalid value: 1001: should be less than or equal to 1000"


def test_unknown_mode_is_refused_naming_the_supported_values():
    problems = problems_of(pool(mode="hybrid"))
    assert problems[0] == 'spec.mode: Unsupported value: "hybrid": supported values: "colocated", "dedicated", "disaggregated", "auto"'


def test_block_size_outside_the_enum_is_refused():
    assert "spec.engine.blockSize: Unsupported value: 12" in problems_of(pool(engine={"blockSize": 12}))[0]


@pytest.mark.parametrize("interactive, replicas", [(1, 1), (2, 2), (3, 2)])
def test_dedicated_needs_a_batch_replica(interactive, replicas):
    problems = problems_of(pool(mode="dedicated", replicas=replicas, dedicated={"interactiveReplicas": interactive}))
    assert problems == ["spec: dedicated.interactiveReplicas must be less than replicas (the batch role needs at least one)"]


def test_auto_with_one_replica_is_a_pool_it_starts_colocated():
    validate_pool(pool(mode="auto", replicas=1))  # dedicated.interactiveReplicas is not auto's


@pytest.mark.parametrize("resources, problem", [
    ({"limits": {"nvidia.com/gpu": "1.5"}}, "whole devices"), ({"requests": {"amd.com/gpu": "500m"}}, "whole devices"),
    ({"limits": {"nvidia.com/gpu": 1, "amd.com/gpu": 1}}, "one GPU vendor"),
])
def test_gpus_are_whole_devices_of_one_vendor(resources, problem):
    [message] = problems_of(pool(resources=resources))
    assert message.startswith("spec.resources: ") and problem in message


def test_an_empty_image_is_refused():
    assert any("spec.image" in p for p in problems_of(pool(image="")))


@pytest.mark.parametrize(
    "source",
    [
        {"embedded": True, "path": "/models/m"},
        {"path": "/models/m", "pvc": {"claimName": "m"}},
        {"embedded": False},
        {},
    ],
)
def test_model_source_needs_exactly_one_source(source):
    problems = problems_of(pool(model={"name": "m", "source": source}))
    assert problems == ["spec.model.source: model.source needs exactly one of path, pvc, hf or embedded: true"]


def test_missing_model_name_is_refused():
    problems = problems_of(pool(model={"source": {"path": "/models/m"}}))
    assert problems[0] == "spec.model.name: Required value"


def test_missing_spec_is_refused():
    obj = copy.deepcopy(MINIMAL)
    del obj["spec"]
    assert problems_of(obj)[0] == "spec: Required value"


def test_a_resource_quantity_that_is_a_list_is_refused():
    problems = problems_of(pool(resources={"limits": {"nvidia.com/gpu": [1]}}))
    assert problems[0] == "spec.resources.limits[nvidia.com/gpu]: Invalid value: [1]: must be of type integer or string"


@pytest.mark.parametrize("quantity", ["abc", "1.5.5", "-1", -2, "2 cores"])
def test_a_resource_quantity_that_is_not_one_is_refused(quantity):
    problems = problems_of(pool(resources={"requests": {"nvidia.com/gpu": 1, "cpu": quantity}}))
    assert problems == ["spec.resources.requests.cpu: must be a resource quantity such as 2, 500m, 1.5 or 48Gi"]


@pytest.mark.parametrize("quantity", [0, 8, "8", "500m", "1.5", "48Gi", "1e3", ".5"])
def test_resource_quantities_in_every_kubernetes_form_are_accepted(quantity):
    validate_pool(pool(resources={"limits": {"cpu": quantity}}))


def test_a_wrong_type_is_refused():
    assert problems_of(pool(replicas="two"))[0] == 'spec.replicas: Invalid value: "two": must be of type integer'


def test_a_boolean_is_not_an_integer():
    assert problems_of(pool(replicas=True))[0].startswith("spec.replicas: Invalid value: true: must be of type integer")


def test_undeclared_fields_are_refused_like_strict_field_validation():
    problems = problems_of(pool(replica=3, engine={"chunk_size": 64}))
    assert sorted(problems) == ["spec.engine.chunk_size: field not declared in schema", "spec.replica: field not declared in schema"]


def test_status_and_metadata_may_hold_fields_the_schema_does_not_list():
    obj = pool()
    obj["metadata"]["annotations"] = {"kopf.zalando.org/last-handled-configuration": "{}"}
    obj["status"] = {"mode": "colocated", "kopf": {"progress": {}}}
    assert validate_pool(obj)["status"]["kopf"] == {"progress": {}}


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("kind", "Deployment", 'kind: Unsupported value: "Deployment": must be ServingPool'),
        ("apiVersion", "serving.cadenza.dev/v1", 'apiVersion: Unsupported value: "serving.cadenza.dev/v1": must be serving.cadenza.dev/v1alpha1'),
        ("apiVersion", None, "apiVersion: Unsupported value: null: must be serving.cadenza.dev/v1alpha1"),
    ],
)
def test_wrong_kind_or_api_version_is_refused(field, value, expected):
    obj = pool()
    obj[field] = value
    assert problems_of(obj) == [expected]


@pytest.mark.parametrize("name", ["Chat", "1chat", "chat-", "chat_pool", "chat.pool", "a" * 46, ""])
def test_invalid_or_too_long_names_are_refused(name):
    obj = pool()
    obj["metadata"]["name"] = name
    [problem] = problems_of(obj)
    assert problem.startswith("metadata.name: ")


@pytest.mark.parametrize("name", ["a", "chat", "llama-3-8b", "a" * 45])
def test_dns_1035_names_up_to_45_characters_are_accepted(name):
    obj = pool()
    obj["metadata"]["name"] = name
    assert validate_pool(obj)["metadata"]["name"] == name


def test_missing_metadata_name_is_refused():
    obj = pool()
    del obj["metadata"]
    assert problems_of(obj) == ["metadata.name: Required value"]


def test_an_invalid_namespace_is_refused():
    obj = pool()
    obj["metadata"]["namespace"] = "Team_A"
    assert problems_of(obj)[0].startswith('metadata.namespace: Invalid value: "Team_A"')


def test_a_document_that_is_not_an_object_is_refused():
    assert problems_of(["not", "a", "pool"]) == ["<root>: Invalid value: must be an object, got list"]


def test_several_problems_are_reported_at_once():
    obj = pool(replicas=-1, engine={"chunkSize": 1024, "tokenBudget": 512, "kvCacheFraction": 2})
    obj["kind"] = "Pool"
    obj["metadata"]["name"] = "Bad_Name"
    problems = problems_of(obj)
    assert len(problems) == 5
    assert {p.split(":")[0] for p in problems} == {"kind", "metadata.name", "spec.replicas", "spec.engine.kvCacheFraction", "spec.engine"}


def test_rules_are_not_evaluated_once_the_object_has_the_wrong_shape():
    # As the API server: an enum/type/required violation skips the CEL rules, and says so.
    problems = problems_of(pool(mode="hybrid", engine={"chunkSize": 1024, "tokenBudget": 512}))
    assert problems[0].startswith("spec.mode: Unsupported value")
    assert problems[1].startswith("<root>: some validation rules were not checked")
    assert len(problems) == 2


# --- CEL rules that cannot be evaluated ---------------------------------------------------------------


def schema_with_rule(rule: str) -> dict:
    schema = load_crd_schema()
    schema["properties"]["spec"]["x-kubernetes-validations"].append({"rule": rule, "message": "never shown"})
    return schema


@pytest.mark.parametrize(
    "rule",
    [
        "self.replicas < 'many'",  # no such overload
        "self.noSuchField == 1",  # no such key
        "self.replicas <",  # does not parse
        "self.replicas",  # not a boolean
    ],
)
def test_a_rule_that_cannot_be_evaluated_is_reported(rule):
    [problem] = problems_of(pool(), schema_with_rule(rule))
    assert problem.startswith(f"spec: rule {rule!r} could not be evaluated")


def test_rules_on_nodes_absent_from_the_data_are_skipped():
    schema = load_crd_schema()
    schema["properties"]["spec"]["properties"]["slo"]["x-kubernetes-validations"] = [{"rule": "false", "message": "m"}]
    validate_pool(pool(), schema)
    assert problems_of(pool(slo={}), schema) == ["spec.slo: m"]


def test_a_rule_without_a_message_names_itself():
    schema = load_crd_schema()
    schema["properties"]["spec"]["x-kubernetes-validations"].append({"rule": "self.replicas > 1"})
    assert problems_of(pool(), schema) == ["spec: failed rule: self.replicas > 1"]


def test_a_number_is_a_cel_double_even_when_written_as_an_integer():
    schema = load_crd_schema()
    schema["properties"]["spec"]["properties"]["controller"]["x-kubernetes-validations"] = [
        {"rule": "self.hysteresis < 0.5", "message": "too much hysteresis"}
    ]
    validate_pool(pool(controller={"hysteresis": 0}), schema)
    assert problems_of(pool(controller={"hysteresis": 1}), schema) == ["spec.controller: too much hysteresis"]


# --- files ------------------------------------------------------------------------------------------


def test_multi_document_files_yield_only_the_serving_pools(tmp_path):
    path = tmp_path / "pools.yaml"
    path.write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: extra}\ndata: {a: b}\n"
        "---\n"
        "apiVersion: serving.cadenza.dev/v1alpha1\nkind: ServingPool\nmetadata: {name: one}\n"
        "spec: {model: {name: m}}\n"
        "---\n"
        "---\n"
        "apiVersion: serving.cadenza.dev/v1alpha1\nkind: ServingPool\nmetadata: {name: two}\n"
        "spec: {model: {name: m}, replicas: 2}\n"
    )
    pools = load_pools(path)
    assert [p["metadata"]["name"] for p in pools] == ["one", "two"]
    assert pools[0]["spec"]["mode"] == "colocated" and pools[1]["spec"]["replicas"] == 2


def test_an_invalid_document_is_named_in_the_error(tmp_path):
    path = tmp_path / "pools.yaml"
    path.write_text(
        "apiVersion: v1\nkind: Service\nmetadata: {name: s}\n"
        "---\n"
        "apiVersion: serving.cadenza.dev/v1alpha1\nkind: ServingPool\nmetadata: {name: bad}\n"
        "spec: {model: {name: m}, replicas: -3}\n"
    )
    with pytest.raises(PoolValidationError) as info:
        load_pools(path)
    message = str(info.value)
    assert str(path) in message
    assert "document 2 (ServingPool bad): spec.replicas: Invalid value: -3" in message


def test_two_pools_with_one_name_in_one_namespace_are_refused(tmp_path):
    path = tmp_path / "pools.yaml"
    doc = "apiVersion: serving.cadenza.dev/v1alpha1\nkind: ServingPool\nmetadata: {name: same}\nspec: {model: {name: m}}\n"
    path.write_text(doc + "---\n" + doc)
    with pytest.raises(PoolValidationError, match="document 2 .*Duplicate value"):
        load_pools(path)


def test_a_file_that_is_not_yaml_is_refused(tmp_path):
    path = tmp_path / "pools.yaml"
    path.write_text("spec: [unclosed\n")
    with pytest.raises(PoolValidationError, match="not valid YAML"):
        load_pools(path)


@pytest.mark.parametrize(("controller", "expected"), [
    ({"fastWindowSeconds": 300, "windowSeconds": 300}, "fastWindowSeconds must be shorter"),
    ({"bounds": {"chunkSize": {"min": 128, "max": 64}}}, "min must not exceed its max"),
    ({"retuneFactor": 1.0}, "retuneFactor"),
    ({"minSamples": 0}, "minSamples"),
])
def test_controller_settings_are_checked(controller, expected):
    with pytest.raises(PoolValidationError, match=expected):
        validate_pool(pool(mode="auto", controller=controller))


def test_dedicated_engine_holds_only_live_settings():
    validate_pool(pool(mode="auto", replicas=2, dedicated={"engine": {"chunkSize": 32, "stepTimeTargetMs": 50}}))
    with pytest.raises(PoolValidationError, match="can change"):
        validate_pool(pool(mode="auto", replicas=2, dedicated={"engine": {"maxModelLen": 1024}}))


def test_termination_needs_room_for_the_drain_delay():
    with pytest.raises(PoolValidationError, match="must exceed drainDelaySeconds"):
        validate_pool(pool(termination={"gracePeriodSeconds": 12, "drainDelaySeconds": 10}))


def test_a_disaggregated_pool_is_defaulted_and_keeps_a_decode_replica():
    spec = validate_pool(pool(mode="disaggregated", replicas=3))["spec"]
    assert spec["disaggregated"] == {"prefillReplicas": 1, "prefillEngine": {}, "decodeEngine": {}}  # threshold: computed
    assert problems_of(pool(mode="disaggregated", replicas=2, disaggregated={"prefillReplicas": 2})) == [
        "spec: disaggregated.prefillReplicas must be less than replicas (the decode role needs at least one)"]
    # the other modes ignore the section; dedicated's rule does not bind a disaggregated pool
    validate_pool(pool(mode="disaggregated", replicas=2, dedicated={"interactiveReplicas": 2}))


@pytest.mark.parametrize("role", ["prefillEngine", "decodeEngine"])
@pytest.mark.parametrize("key, value", [("blockSize", 32), ("maxModelLen", 4096)])
def test_a_role_of_a_disaggregated_pool_may_not_change_the_kv_layout(role, key, value):
    problems = problems_of(pool(mode="disaggregated", replicas=2, disaggregated={role: {key: value}}))
    assert problems == ["spec.disaggregated: disaggregated.prefillEngine and decodeEngine take only tokenBudget, "
                        "chunkSize, maxNumSeqs, prefixCaching, stepTimeTargetMs, kvCacheFraction, classes and tenants: "
                        "a decode replica takes the prefill replica's KV blocks as they are, so the KV layout and the "
                        "model length (blockSize, maxModelLen) stay the pool's, and prefill and decode replicas must "
                        "have the same tensor-parallel size (tensorParallelSize)"]
    validate_pool(pool(mode="disaggregated", replicas=2, disaggregated={role: {"chunkSize": 64}}))


@pytest.mark.parametrize("role", ["prefillEngine", "decodeEngine"])
def test_a_key_no_engine_has_is_named_as_undeclared_in_a_role_override(role):
    problems = problems_of(pool(mode="disaggregated", replicas=2, disaggregated={role: {"numKvBlocks": 100}}))
    assert f"spec.disaggregated.{role}.numKvBlocks: field not declared in schema" in problems
    with pytest.raises(PoolSpecError, match=rf"spec.disaggregated.{role}.numKvBlocks: unknown engine setting "
                                            r"\(allowed here: chunkSize, classes,"):
        obj = apply_defaults(pool(mode="disaggregated", replicas=2, disaggregated={role: {"numKvBlocks": 100}}),
                             load_crd_schema())
        Pool("p", "default", obj["spec"]).roles()


def test_the_crd_and_the_pool_allow_the_same_role_overrides_in_a_disaggregated_pool():
    import re

    from cadenza.pool.spec import KV_ROLE_KEYS

    section = load_crd_schema()["properties"]["spec"]["properties"]["disaggregated"]
    (rule,) = [r["rule"] for r in section["x-kubernetes-validations"]]
    assert set(re.search(r"k in \[([^\]]*)\]", rule).group(1).replace("'", "").replace(" ", "").split(",")) == KV_ROLE_KEYS


def test_autoscaling_bounds_keep_every_role_populated():
    assert validate_pool(pool(autoscaling={"maxReplicas": 4}))["spec"]["autoscaling"]["minReplicas"] == 1
    assert problems_of(pool(autoscaling={"minReplicas": 5, "maxReplicas": 4})) == [
        "spec.autoscaling: autoscaling.minReplicas must not exceed maxReplicas"]
    assert problems_of(pool(mode="dedicated", replicas=3, dedicated={"interactiveReplicas": 1},
                            autoscaling={"minReplicas": 1, "maxReplicas": 4})) == [
        "spec: autoscaling.minReplicas must exceed dedicated.interactiveReplicas (the batch role needs at least one "
        "at the fewest)"]
    assert any("maxReplicas" in p for p in problems_of(pool(autoscaling={"minReplicas": 1})))


def test_a_hub_source_names_a_repo_and_defaults_to_main():
    spec = validate_pool(pool(model={"name": "m", "source": {"hf": {"repo": "org/name", "tokenSecret": {"name": "s"}}}}))
    assert spec["spec"]["model"]["source"]["hf"] == {"repo": "org/name", "revision": "main",
                                                     "tokenSecret": {"name": "s", "key": "token"}}
    assert any("repo" in p for p in problems_of(pool(model={"name": "m", "source": {"hf": {"repo": "../etc"}}})))
    assert problems_of(pool(model={"name": "m", "source": {"hf": {"repo": "a/b"}, "path": "/m"}})) == [
        "spec.model.source: model.source needs exactly one of path, pvc, hf or embedded: true"]


def test_the_controller_moves_only_live_knobs_of_the_registry():
    from cadenza.node.core.knobs import BY_CRD
    from cadenza.pool.live_knobs import KNOBS

    assert KNOBS and all(BY_CRD[crd].live and BY_CRD[crd].name == name for crd, name in KNOBS.items())
