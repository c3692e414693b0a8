"""A pool's tensor-parallel size: defaulted from its GPUs, rendered as the engine's flag, and refused
where it cannot run (more ranks than GPUs, KV moved between replicas, heads that do not split)."""

from __future__ import annotations

import copy
import json

import pytest

from cadenza.node.embedded import (
    EMBEDDED_MODEL_HEADS,
    EMBEDDED_MODEL_INTERMEDIATE_SIZE,
    EMBEDDED_MODEL_KV_HEADS,
)
from cadenza.pool.spec import Pool, PoolSpecError
from cadenza.pool.validate import PoolValidationError, validate_pool

MINIMAL = {
    "apiVersion": "serving.cadenza.dev/v1alpha1",
    "kind": "ServingPool",
    "metadata": {"name": "big", "namespace": "default"},
    "spec": {"model": {"name": "Llama-3.1-70B-Instruct", "source": {"hf": {"repo": "meta-llama/Llama-3.1-70B-Instruct"}}},
             "replicas": 2},
}


def gpus(n: int) -> dict:
    return {"limits": {"nvidia.com/gpu": n}}


def read(engine: dict | None = None, **spec) -> Pool:
    """The pool validated as the API server would (defaults applied), read."""
    obj = copy.deepcopy(MINIMAL)
    obj["spec"].update(spec)
    if engine is not None:
        obj["spec"]["engine"] = engine
    return Pool("big", "default", validate_pool(obj)["spec"])


def flag(pool: Pool) -> str | None:
    args = pool.roles()[0].serve_args(pool.model_args())
    return args[args.index("--tensor-parallel-size") + 1] if "--tensor-parallel-size" in args else None


def refusal(pool: Pool) -> str:
    with pytest.raises(PoolSpecError) as info:
        pool.roles()
    return str(info.value)


# --- defaults and rendering -----------------------------------------------------------------------


def test_the_size_defaults_to_the_gpus_per_replica_and_is_rendered_as_the_engines_flag():
    pool = read(resources=gpus(4))
    assert pool.tensor_parallel_size == 4 and flag(pool) == "4"


@pytest.mark.parametrize("resources", [{}, gpus(1)])
def test_one_gpu_or_none_runs_the_engines_default_with_no_flag(resources):
    pool = read(resources=resources)
    assert pool.tensor_parallel_size == 1 and flag(pool) is None  # pools from before the field do not roll


def test_an_explicit_size_is_rendered_as_given():
    assert flag(read({"tensorParallelSize": 2}, resources=gpus(4))) == "2"
    assert flag(read({"tensorParallelSize": 1}, resources=gpus(4))) == "1"  # one rank, three idle GPUs: asked for
    assert flag(read({"tensorParallelSize": 4})) == "4"  # no GPUs: every rank on the pod's CPUs


def test_every_role_of_a_dedicated_pool_runs_the_pools_size():
    pool = read(resources=gpus(2), mode="dedicated", replicas=3)
    assert [r.engine["tensorParallelSize"] for r in pool.roles()] == [2, 2]


def test_the_schema_bounds_the_size_as_the_knob_does():
    for value in (0, 17):
        with pytest.raises(PoolValidationError, match=r"spec.engine.tensorParallelSize: Invalid value"):
            read({"tensorParallelSize": value})


# --- refused, with the reason ---------------------------------------------------------------------


def test_more_ranks_than_gpus_per_replica_is_refused():
    message = refusal(read({"tensorParallelSize": 8}, resources=gpus(4)))
    assert message.startswith("spec.engine.tensorParallelSize: 8 ranks need 8 GPUs per replica, but "
                              "spec.resources asks for 4")


def test_a_size_that_does_not_split_the_embedded_models_heads_is_refused():
    embedded = {"name": "SmolLM2-135M-Instruct", "source": {"embedded": True}}
    message = refusal(read({"tensorParallelSize": 2}, model=embedded))
    assert message == ("spec.engine.tensorParallelSize (2): 2 does not divide SmolLM2-135M-Instruct's 9 attention "
                       "heads")
    read({"tensorParallelSize": 3}, model=embedded).roles()  # 9 heads, 3 KV heads, 1536 MLP: 3 splits all


def test_the_embedded_models_shape_is_its_config_json(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["intermediate_size"]) == (
        EMBEDDED_MODEL_HEADS, EMBEDDED_MODEL_KV_HEADS, EMBEDDED_MODEL_INTERMEDIATE_SIZE)


def test_a_path_models_config_json_is_read_when_it_is_here(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 12, "num_key_value_heads": 4,
                                                      "intermediate_size": 4096}))
    model = {"name": "mid", "source": {"path": str(tmp_path)}}
    message = refusal(read({"tensorParallelSize": 8}, model=model))
    assert message == (f"spec.engine.tensorParallelSize (8): 8 does not divide mid ({tmp_path / 'config.json'})'s "
                       "12 attention heads")
    read({"tensorParallelSize": 4}, model=model).roles()
    # a path that is not here (inside an image): the engine checks at start
    read({"tensorParallelSize": 8}, model={"name": "mid", "source": {"path": str(tmp_path / "absent")}}).roles()


@pytest.mark.parametrize("mode", ["disaggregated", "auto"])
def test_pools_that_move_kv_between_replicas_run_at_any_size_the_same_on_every_role(mode):
    # KV moves between tensor-parallel replicas of the same size (the engine gathers every rank's heads)
    roles = read(resources=gpus(4), mode=mode).roles()
    assert {(r.engine["tensorParallelSize"], r.kv_transfer) for r in roles} == {(4, True)}


@pytest.mark.parametrize("role", ["prefillEngine", "decodeEngine"])
def test_a_prefill_or_decode_override_may_not_change_the_size(role):
    obj = copy.deepcopy(MINIMAL)
    obj["spec"].update(mode="disaggregated", disaggregated={role: {"tensorParallelSize": 2}})
    with pytest.raises(PoolValidationError, match="prefill and decode replicas must have the same tensor-parallel "
                                                  r"size \(tensorParallelSize\)"):
        validate_pool(obj)
    # without an API server (a spec read as it is), the pool says the same
    spec = {**obj["spec"], "disaggregated": {"prefillReplicas": 1, role: {"tensorParallelSize": 2}}}
    with pytest.raises(PoolSpecError, match=rf"spec.disaggregated.{role} may not set tensorParallelSize: a decode "
                                            "replica takes the prefill replica's KV blocks as they are, so prefill "
                                            "and decode replicas must have the same tensor-parallel size"):
        Pool("big", "default", spec).roles()
