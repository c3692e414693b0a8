"""Translate a ServingPool's ``spec.engine`` into the engine configuration a replica runs.

The operator renders replicas as ``cadenza serve`` processes (pods locally or in a cluster); this
module is the one place where the CRD's camelCase engine knobs meet the engine's own
configuration, so both renderers and ``cadenza up`` agree on it. Validation is the engine's own
(:mod:`cadenza.node.config`): a pool is refused with the same message the engine would give.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cadenza.node.config import CacheConfig, ConfigError, EngineConfig, SchedulerConfig

# spec.engine key -> (config section, field, `cadenza serve` flag)
ENGINE_KNOBS: dict[str, tuple[str, str, str]] = {
    "tokenBudget": ("scheduler", "token_budget", "--token-budget"),
    "chunkSize": ("scheduler", "chunk_size", "--chunk-size"),
    "maxNumSeqs": ("scheduler", "max_num_seqs", "--max-num-seqs"),
    "maxModelLen": ("scheduler", "max_model_len", "--max-model-len"),
    "blockSize": ("cache", "block_size", "--block-size"),
    "numKvBlocks": ("cache", "num_kv_blocks", "--num-kv-blocks"),
    "kvCacheFraction": ("cache", "kv_cache_fraction", "--kv-cache-fraction"),
}


def engine_config(model: str, engine: Mapping[str, Any], served_model_name: str | None = None) -> EngineConfig:
    """Build (and so validate) the engine configuration of a pool.

    Args:
        model: the model folder path inside the replica.
        engine: the pool's ``spec.engine`` (camelCase keys; absent keys take engine defaults).
        served_model_name: the ``model`` id clients send.

    Raises:
        ConfigError: an unknown knob, or a value the engine refuses (message names the CRD key).
    """
    sections: dict[str, dict[str, Any]] = {"scheduler": {}, "cache": {}}
    for key, value in engine.items():
        if key not in ENGINE_KNOBS:
            raise ConfigError(f"spec.engine.{key}: unknown engine setting (known: {', '.join(ENGINE_KNOBS)})")
        section, name, _flag = ENGINE_KNOBS[key]
        sections[section][name] = value
    try:
        return EngineConfig(
            model=model,
            served_model_name=served_model_name,
            scheduler=SchedulerConfig(**sections["scheduler"]),
            cache=CacheConfig(**sections["cache"]),
        )
    except ConfigError as exc:
        field, _, message = str(exc).partition(": ")
        key = next((k for k, (_s, name, _f) in ENGINE_KNOBS.items() if name == field), field)
        raise ConfigError(f"spec.engine.{key}: {message}") from None


def serve_args(engine: Mapping[str, Any]) -> list[str]:
    """``cadenza serve`` flags for the pool's engine knobs, in a stable order.

    Raises:
        ConfigError: as :func:`engine_config`.
    """
    engine_config("model", engine)  # validate first
    args: list[str] = []
    for key, (_section, _name, flag) in ENGINE_KNOBS.items():
        if key in engine:
            value = engine[key]
            args += [flag, "none" if value is None else str(value)]
    return args
