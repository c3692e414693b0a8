"""Translate a ServingPool's ``spec.engine`` into the engine configuration a replica runs.

The operator renders replicas as ``cadenza serve`` processes (pods in a cluster, processes in
``cadenza up``); this module is the one place where the CRD's camelCase engine knobs meet the
engine's own configuration, so both agree on it. Plain knobs become ``cadenza serve`` flags;
the step-time target and the class and tenant policies become a ``--policy`` document. Validation
is the engine's own (:mod:`cadenza.node.core.config`, :mod:`cadenza.node.core.policy`): a pool is refused
with the message the engine would give, naming the CRD key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cadenza.node.core.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    SchedulerConfig,
    check_chunk_within_budget,
)
from cadenza.node.core.knobs import BY_CRD, BY_NAME
from cadenza.node.core.policy import Policy, PolicyError

# spec.engine key -> (config section, field, `cadenza serve` flag): the plain knobs of the registry
ENGINE_KNOBS: dict[str, tuple[str, str, str]] = {
    crd: (k.section, k.name, k.cli) for crd, k in BY_CRD.items() if k.section in ("engine", "scheduler", "cache")
    and k.cli}
POLICY_KEYS = tuple(crd for crd, k in BY_CRD.items() if k.section == "policy")
_CLASS_FIELDS = {"maxPrefillTokens": "max_prefill_tokens", "minShare": "min_share",
                 "maxQueueAgeS": "max_queue_age_s", "maxQueueDepth": "max_queue_depth"}
_TENANT_FIELDS = {"weight": "weight", "maxConcurrent": "max_concurrent",
                  "maxQueuedPromptTokens": "max_queued_prompt_tokens"}


def _snake(mapping: Mapping[str, Any], fields: Mapping[str, str], path: str) -> dict[str, Any]:
    out = {}
    for key, value in mapping.items():
        if key not in fields:
            raise ConfigError(f"{path}.{key}", f"unknown setting (known: {', '.join(fields)})")
        out[fields[key]] = value
    return out


def policy_document(engine: Mapping[str, Any]) -> dict[str, Any]:
    """The ``--policy`` document (the shape of ``GET /admin/config``) for ``spec.engine``."""
    doc: dict[str, Any] = {}
    if "stepTimeTargetMs" in engine:
        doc["step_time_target_ms"] = engine["stepTimeTargetMs"]
    if classes := engine.get("classes"):
        doc["classes"] = {cls: _snake(p, _CLASS_FIELDS, f"spec.engine.classes.{cls}") for cls, p in classes.items()}
    if tenants := engine.get("tenants"):
        doc["tenants"] = {t: _snake(p, _TENANT_FIELDS, f"spec.engine.tenants.{t}") for t, p in tenants.items()}
    return doc


def engine_config(model: str, engine: Mapping[str, Any], served_model_name: str | None = None) -> EngineConfig:
    """Build (and so validate) the engine configuration of a pool role.

    Args:
        model: the model folder path inside the replica.
        engine: the role's ``spec.engine`` (camelCase keys; absent keys take engine defaults).
        served_model_name: the ``model`` id clients send.

    Raises:
        ConfigError: an unknown knob, or a value the engine refuses (message names the CRD key).
    """
    sections: dict[str, dict[str, Any]] = {"engine": {}, "scheduler": {}, "cache": {}}
    for key, value in engine.items():
        if key in POLICY_KEYS:
            continue
        if key not in ENGINE_KNOBS:
            raise ConfigError(f"spec.engine.{key}", f"unknown engine setting (known: {', '.join([*ENGINE_KNOBS, *POLICY_KEYS])})")
        section, name, _flag = ENGINE_KNOBS[key]
        sections[section][name] = value
    try:
        policy = Policy().updated(policy_document(engine))
    except PolicyError as exc:
        raise ConfigError("spec.engine", str(exc)) from None
    try:
        config = EngineConfig(
            model=model,
            served_model_name=served_model_name,
            **sections["engine"],
            scheduler=SchedulerConfig(**sections["scheduler"], policy=policy),
            cache=CacheConfig(**sections["cache"]),
        )
        check_chunk_within_budget(config.scheduler.token_budget, config.scheduler.chunk_size)
        return config
    except ConfigError as exc:
        key = next((k for k, (_s, name, _f) in ENGINE_KNOBS.items() if name == exc.field), exc.field)
        raise ConfigError(f"spec.engine.{key}", exc.reason) from None


def serve_args(engine: Mapping[str, Any]) -> list[str]:
    """``cadenza serve`` flags for the knobs of ``spec.engine``, in a stable order (the policy
    part goes in the ``--policy`` document, see :func:`policy_document`).

    Raises:
        ConfigError: as :func:`engine_config`.
    """
    engine_config("model", engine)  # validate first
    args: list[str] = []
    for key, (_section, _name, flag) in ENGINE_KNOBS.items():
        if key not in engine:
            continue
        value = engine[key]
        if BY_CRD[key].kind is bool:  # argparse.BooleanOptionalAction: --x / --no-x
            args.append(flag if value else "--no-" + flag.removeprefix("--"))
        else:
            args += [flag, "none" if value is None else str(value)]
    return args


# What a running replica can change through PUT /admin/config (spec.engine keys), from the registry.
LIVE_KEYS = tuple(crd for crd, k in BY_CRD.items() if k.live)
_LIVE_DEFAULTS = {name: BY_NAME[name].default for name in ("token_budget", "chunk_size")}


def live_document(engine: Mapping[str, Any]) -> dict[str, Any]:
    """The ``PUT /admin/config`` body that gives a running replica the live part of ``spec.engine``
    (token budget and chunk size with the engine's defaults when unset, step-time target, class and
    tenant policies) — how a role changes in place."""
    doc: dict[str, Any] = {"token_budget": engine.get("tokenBudget", _LIVE_DEFAULTS["token_budget"]),
                           "chunk_size": engine.get("chunkSize", _LIVE_DEFAULTS["chunk_size"])}
    for key in ("maxNumSeqs", "prefixCaching"):
        if key in engine:
            doc[BY_CRD[key].name] = engine[key]
    doc.update(policy_document(engine))
    return doc
