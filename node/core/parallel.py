"""What a tensor-parallel size must satisfy: the one rule the engine, the pool and the simulator apply.

A replica of tensor-parallel size ``N`` splits each layer over ``N`` devices of one node, Megatron-LM's
way (Shoeybi et al., 2019; vLLM's ``ColumnParallelLinear`` / ``RowParallelLinear``): the attention
heads and the MLP's intermediate size divide evenly over the ranks; KV heads either divide over them
or, with fewer KV heads than ranks, each is replicated on ``N / num_kv_heads`` ranks (so that count
must divide ``N``); the vocabulary is padded to a multiple of ``N`` and never refuses. Which rows each
rank then holds is :mod:`cadenza.node.runner.tp_shards`'. No torch here: the operator and the
simulator read it.
"""

from __future__ import annotations

from cadenza.node.core.errors import ConfigError

MAX_TENSOR_PARALLEL_SIZE = 16  # ranks of one replica: the GPUs of one node (several nodes: not built)
_FIELD = "tensor_parallel_size"


def _refuse(reason: str) -> ConfigError:
    return ConfigError(_FIELD, reason)


def check_size(size: object) -> None:
    """A size an engine can start with, whatever the model: a whole number of ranks from 1 to
    :data:`MAX_TENSOR_PARALLEL_SIZE`.

    Raises:
        ConfigError: on ``tensor_parallel_size``, saying why.
    """
    if isinstance(size, bool) or not isinstance(size, int):
        raise _refuse(f"must be an integer, got {size!r}")
    if not 1 <= size <= MAX_TENSOR_PARALLEL_SIZE:
        raise _refuse(f"must be >= 1 and <= {MAX_TENSOR_PARALLEL_SIZE} (the devices of one node), got {size}")


def check_tensor_parallel(size: int, num_heads: int, num_kv_heads: int, intermediate_size: int,
                          model: str = "the model") -> None:
    """Refuse a size a model's shape cannot be split over (see the module docstring).

    Raises:
        ConfigError: on ``tensor_parallel_size``, saying which count does not split.
    """
    check_size(size)
    if num_heads % size:
        raise _refuse(f"{size} does not divide {model}'s {num_heads} attention heads")
    if num_kv_heads % size and size % num_kv_heads:
        raise _refuse(f"{size} neither divides {model}'s {num_kv_heads} KV heads nor is a multiple of them "
                      f"(a KV head is replicated on whole ranks)")
    if intermediate_size % size:
        raise _refuse(f"{size} does not divide {model}'s MLP intermediate size {intermediate_size}")
