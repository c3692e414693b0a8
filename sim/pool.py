"""A ServingPool as a simulated fleet: the same (validated, defaulted) spec ``kubectl apply`` and
``cadenza up`` take, turned into replica names by role, each role's scheduler knobs, and — for
``mode: auto`` — the controller.

Replica names follow the roles: ``colocated-0`` ... (in both gateway roles), ``interactive-0`` ...
and ``batch-0`` ... for a dedicated split; an ``auto`` pool starts colocated and its controller
moves replicas between roles at run time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cadenza.node.core.config import SchedulerConfig, resolve_max_model_len
from cadenza.node.core.knobs import BY_CRD
from cadenza.control.spec import ControllerSpec, spec_knobs
from cadenza.pool.engine_args import engine_config
from cadenza.pool.spec import Pool
from cadenza.sim.roofline import Roofline


@dataclass(frozen=True, slots=True)
class FleetLayout:
    """What a pool runs as in the simulator.

    Attributes:
        roles: gateway role (``interactive`` / ``batch``, ``prefill`` when disaggregated) -> replica names.
        configs: replica name -> its scheduler knobs (``max_model_len`` resolved).
        controller: the ``auto`` pool's controller settings; None for a static shape.
        block_size: tokens per KV block (``spec.engine.blockSize``).
        num_blocks: KV blocks per replica when the engine settings fix them (``numKvBlocks``,
            ``kvCacheGiB``); None: what fits the device.
        slo: class -> targets (``spec.slo``: ``ttftP99Ms``, ``itlP99Ms``).
        min_prompt_tokens: a disaggregated pool's pinned threshold (None: computed).
        prefill_knobs: the live knobs an ``auto`` pool's replica takes in the prefill role (its
            ``spec.engine`` with ``spec.disaggregated.prefillEngine`` on top; None: not ``auto``).
    """

    roles: dict[str, list[str]]
    configs: dict[str, SchedulerConfig]
    controller: ControllerSpec | None
    block_size: int = BY_CRD["blockSize"].default
    num_blocks: int | None = None
    slo: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    min_prompt_tokens: int | None = None
    prefill_knobs: dict[str, float | None] | None = None


def pool_tensor_parallel_size(pool: Mapping[str, Any], given: int | None = None) -> int:
    """The devices per replica to simulate: the pool's tensor-parallel size when it says one
    (``spec.engine.tensorParallelSize``, else the GPUs per replica it asks for:
    :attr:`~cadenza.pool.spec.Pool.tensor_parallel_size`), else ``given`` (``--tp``), else 1.

    Raises:
        ValueError: ``given`` and the pool's size differ (naming both).
        PoolSpecError: a GPU count that is not a whole number.
    """
    spec = pool["spec"]
    p = Pool(pool["metadata"]["name"], pool["metadata"].get("namespace", "default"), spec)
    explicit = "tensorParallelSize" in (spec.get("engine") or {})
    if not explicit and not p.gpus:
        return 1 if given is None else given
    size = p.tensor_parallel_size
    if given is not None and given != size:
        said = "spec.engine.tensorParallelSize" if explicit else f"its {p.gpus} GPUs per replica"
        raise ValueError(f"--tp {given} differs from the pool's tensor-parallel size {size} ({said}): "
                         "leave --tp out, or change the pool")
    return size


def fleet_layout(pool: Mapping[str, Any], roofline: Roofline, model_max_len: int = 131072) -> FleetLayout:
    """The layout of one validated ServingPool document on ``roofline``'s hardware.

    Raises:
        PoolSpecError: a spec the engine refuses (as ``cadenza up`` would).
        ValueError: the model does not fit the device.
    """
    spec = pool["spec"]
    p = Pool(pool["metadata"]["name"], pool["metadata"].get("namespace", "default"), spec)
    capacity = roofline.kv_capacity_tokens()
    roles: dict[str, list[str]] = {"interactive": [], "batch": []}
    configs: dict[str, SchedulerConfig] = {}
    block_size, num_blocks = BY_CRD["blockSize"].default, None
    routes_of: dict[str, list[str]] = {}  # role -> the gateway routes its replicas serve
    for route, role_name in p.routes().items():
        routes_of.setdefault(role_name, []).append(route)
    for role in p.roles():
        engine = engine_config("/model", role.engine, p.model_name)
        sched, block_size = engine.scheduler, engine.cache.block_size
        if engine.cache.num_kv_blocks is not None:
            num_blocks = engine.cache.num_kv_blocks
        elif engine.cache.kv_cache_bytes is not None:
            num_blocks = max(1, engine.cache.kv_cache_bytes // (roofline.kv_bytes_per_token() * block_size))
        sched = dataclasses.replace(sched, max_model_len=resolve_max_model_len(sched.max_model_len, model_max_len,
                                                                                capacity))
        kind = "colocated" if role.name in ("colocated", "auto") else role.name
        for i in range(role.replicas):
            name = f"{kind}-{i}"
            configs[name] = sched
            for route in routes_of[role.name]:
                roles.setdefault(route, []).append(name)
    controller = ControllerSpec.from_pool_spec(spec) if p.mode == "auto" else None
    slo = {cls: {k: float(v) for k, v in targets.items() if v} for cls, targets in (spec.get("slo") or {}).items()
           if targets}
    prefill_knobs = spec_knobs({"engine": p.role_settings("prefill").engine}) if controller is not None else None
    return FleetLayout(roles, configs, controller, block_size, num_blocks, slo, p.min_prompt_tokens, prefill_knobs)
