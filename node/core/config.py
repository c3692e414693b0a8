"""Engine configuration: frozen dataclasses that validate themselves at start-up.

Every check raises :class:`ConfigError` naming the offending field. Only configurations that can
never serve anything are refused; a prompt longer than the token budget is fine (it is chunked).
This module imports no torch: the scheduler and the operator read it too.
"""

from __future__ import annotations

import dataclasses
import socket
from dataclasses import dataclass, field

from cadenza.node.core.errors import ConfigError
from cadenza.node.core.parallel import check_size
from cadenza.node.core.policy import Policy

DTYPES = ("auto", "float32", "float16", "bfloat16")
TEXT_SPECIAL_TOKENS = ("control", "plain")  # special-token text in requests: control tokens, or plain text
ATTENTION_BACKENDS = ("auto", "torch", "triton", "cpu")
# The largest CUDA-graphed steps (node/runner/cuda_graphs.py; sim's graphs profiles): decode rows, chunk tokens.
CUDA_GRAPH_MAX_ROWS, CUDA_GRAPH_MAX_CHUNK = 256, 512


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ConfigError(name, message)


def _positive_int(value: object, name: str) -> None:
    _check(isinstance(value, int) and not isinstance(value, bool), name, f"must be an integer, got {value!r}")
    _check(value >= 1, name, f"must be >= 1, got {value}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """How each engine step is filled.

    Attributes:
        token_budget: tokens per step, decode + prefill (vLLM's ``max_num_batched_tokens``).
        chunk_size: most prompt tokens one request may prefill in a step; ``None`` = unlimited
            (chunking off: a prompt is ingested in one step when the budget allows it).
        max_num_seqs: most requests running at once (decoding or mid-prefill). The scheduler also
            never runs more requests than ``token_budget``, so every running decode can advance
            every step.
        max_model_len: most tokens (prompt + output) one request may hold; ``None`` takes the
            model's context length (capped by the KV cache when that is smaller).
        prefix_caching: reuse the KV blocks of identical prompt prefixes across requests.
        policy: traffic classes, tenants, the step-time target and preemption limits.
    """

    token_budget: int = 512
    chunk_size: int | None = 256
    max_num_seqs: int = 64
    max_model_len: int | None = None
    prefix_caching: bool = True
    policy: Policy = field(default_factory=Policy)

    def __post_init__(self) -> None:
        _positive_int(self.token_budget, "token_budget")
        if self.chunk_size is not None:
            _positive_int(self.chunk_size, "chunk_size")
        _positive_int(self.max_num_seqs, "max_num_seqs")
        if self.max_model_len is not None:
            _positive_int(self.max_model_len, "max_model_len")
        _check(isinstance(self.prefix_caching, bool), "prefix_caching", f"must be true or false, got {self.prefix_caching!r}")
        _check(isinstance(self.policy, Policy), "policy", "must be a Policy")

    @property
    def max_running(self) -> int:
        """Requests allowed to run at once: capped by the budget so each decode fits a step."""
        return min(self.max_num_seqs, self.token_budget)

    @property
    def effective_chunk_size(self) -> int:
        """The chunk cap actually applied (the budget bounds it anyway)."""
        return self.token_budget if self.chunk_size is None else min(self.chunk_size, self.token_budget)


def check_chunk_within_budget(token_budget: int, chunk_size: int | None) -> None:
    """Refuse a chunk larger than the token budget: a chunk is part of one step's tokens.

    The rule for settings a person gives — ``cadenza serve`` flags, a pool's ``spec.engine`` (each
    role's, overrides applied) and a live ``PUT /admin/config`` touching either knob — so every
    door answers the same. :class:`SchedulerConfig` itself caps such a chunk instead
    (:attr:`~SchedulerConfig.effective_chunk_size`), so code that builds configurations need not
    order two changes.

    Raises:
        ConfigError: naming ``chunk_size`` and the budget.
    """
    _check(chunk_size is None or chunk_size <= token_budget, "chunk_size",
           f"{chunk_size} is over the token budget ({token_budget} tokens per step): a chunk is part of one step "
           "(lower chunk_size or raise token_budget)")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Paged KV cache size.

    Give at most one of ``num_kv_blocks`` and ``kv_cache_bytes``; with neither, the engine sizes
    the cache from ``kv_cache_fraction`` of the device memory left after loading the weights
    (CUDA) or uses 1 GiB (CPU).

    Attributes:
        block_size: tokens per KV block (a power of two: 8, 16, 32, ...).
        num_kv_blocks: KV blocks in the pool.
        kv_cache_bytes: bytes of K and V cache across all layers and tensor-parallel ranks.
        kv_cache_fraction: fraction in (0, 1] of free device memory to use for the cache.
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None
    kv_cache_fraction: float = 0.9

    def __post_init__(self) -> None:
        _positive_int(self.block_size, "block_size")
        _check(self.block_size & (self.block_size - 1) == 0, "block_size", f"must be a power of two, got {self.block_size}")
        _check(self.num_kv_blocks is None or self.kv_cache_bytes is None, "num_kv_blocks",
               "give either num_kv_blocks or kv_cache_bytes, not both")
        if self.num_kv_blocks is not None:
            _positive_int(self.num_kv_blocks, "num_kv_blocks")
        if self.kv_cache_bytes is not None:
            _positive_int(self.kv_cache_bytes, "kv_cache_bytes")
        _check(isinstance(self.kv_cache_fraction, (int, float)) and not isinstance(self.kv_cache_fraction, bool)
               and 0 < self.kv_cache_fraction <= 1, "kv_cache_fraction", f"must be in (0, 1], got {self.kv_cache_fraction!r}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything an engine needs to start.

    Attributes:
        model: path of a Hugging Face model folder (``config.json`` + ``*.safetensors`` +
            ``tokenizer.json``).
        served_model_name: the ``model`` id clients send; defaults to the folder name.
        dtype: weights, activations and KV cache dtype; ``auto`` is bfloat16 on a CUDA device and
            float32 on the CPU.
        device: ``cpu`` or ``cuda[:N]``.
        attention_backend: ``torch``, ``triton``, ``cpu`` (compiled CPU kernels) or ``auto``
            (``CADENZA_ATTENTION_BACKEND``, else triton on a CUDA device, cpu for float32 on the CPU
            where the kernels build, torch otherwise; see :mod:`cadenza.node.runner.backend`).
        seed: seeds every request that does not bring its own ``seed``.
        kv_transfer_port: TCP port of the replica's KV transfer endpoint (disaggregated pools:
            prefill replicas serve their KV there, decode replicas pull from their peers'); 0 picks
            a free one; None: no endpoint, every prompt is prefilled here.
        kv_transfer_host: the address it binds (and that peers reach it at).
        kv_lease_s: seconds published KV is held for a decode replica without its progress (the
            same on every replica of a pool: both sides renew leases every third of it).
        kv_max_hold_s: seconds a request queued on a decode replica keeps its prefill replica's
            KV leased; past it the source is released and the prompt is computed where it decodes.
        text_special_tokens: special-token text in requests (``<|im_start|>`` in a chat message or
            a completion prompt): ``control`` makes it the control tokens it spells, as
            ``transformers`` and vLLM do (a user can forge a turn of another role); ``plain``
            encodes it as text, the chat template's own markup staying control tokens
            (:mod:`cadenza.node.frontend.tokenizer`). Read by the front end only.
        cuda_graphs: capture decode steps and steps with one bounded chunk in CUDA graphs
            (:mod:`cadenza.node.runner.cuda_graphs`; CUDA and the triton backend only).
        tensor_parallel_size: devices one replica is split across (:mod:`cadenza.node.core.parallel`).
    """

    model: str
    served_model_name: str | None = None
    dtype: str = "auto"
    device: str = "cpu"
    attention_backend: str = "auto"
    seed: int = 0
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    kv_transfer_port: int | None = None
    kv_transfer_host: str = "127.0.0.1"
    kv_lease_s: float = 30.0
    kv_max_hold_s: float = 120.0
    text_special_tokens: str = "control"
    cuda_graphs: bool = True
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        _check(isinstance(self.model, str) and bool(self.model), "model", "must be a model folder path")
        _check(self.dtype in DTYPES, "dtype", f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        _check(
            self.attention_backend in ATTENTION_BACKENDS,
            "attention_backend",
            f"must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}",
        )
        _check(
            isinstance(self.device, str) and (self.device == "cpu" or self.device.startswith("cuda")),
            "device",
            f"must be 'cpu' or 'cuda[:N]', got {self.device!r}",
        )
        _check(isinstance(self.seed, int) and not isinstance(self.seed, bool), "seed", f"must be an integer, got {self.seed!r}")
        _check(-(2**63) <= self.seed < 2**63, "seed", f"must be a 64-bit signed integer, got {self.seed}")
        port = self.kv_transfer_port
        _check(port is None or (isinstance(port, int) and not isinstance(port, bool) and 0 <= port <= 65535),
               "kv_transfer_port", f"must be a port number from 0 to 65535, got {port!r}")
        _check(isinstance(self.kv_lease_s, (int, float)) and not isinstance(self.kv_lease_s, bool)
               and 0 < self.kv_lease_s <= 3600, "kv_lease_s", f"must be seconds in (0, 3600], got {self.kv_lease_s!r}")
        _check(isinstance(self.kv_max_hold_s, (int, float)) and not isinstance(self.kv_max_hold_s, bool)
               and 0 < self.kv_max_hold_s <= 3600, "kv_max_hold_s",
               f"must be seconds in (0, 3600], got {self.kv_max_hold_s!r}")
        _check(self.text_special_tokens in TEXT_SPECIAL_TOKENS, "text_special_tokens",
               f"must be one of {', '.join(TEXT_SPECIAL_TOKENS)}, got {self.text_special_tokens!r}")
        _check(isinstance(self.cuda_graphs, bool), "cuda_graphs", f"must be true or false, got {self.cuda_graphs!r}")
        check_size(self.tensor_parallel_size)

    @property
    def model_name(self) -> str:
        """The id served at ``/v1/models``."""
        if self.served_model_name:
            return self.served_model_name
        return self.model.rstrip("/").rsplit("/", 1)[-1]

    def replace(self, **changes: object) -> "EngineConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_knobs(cls, model: str, **knobs: object) -> "EngineConfig":
        """``EngineConfig.from_knobs(path, token_budget=64, num_kv_blocks=32, seed=1)``: every
        field of the engine, scheduler and cache sections by name (scripts and tests).

        Raises:
            ConfigError: an unknown name, or an invalid value.
        """
        sections: dict[str, dict[str, object]] = {"engine": {}, "scheduler": {}, "cache": {}}
        for name, value in knobs.items():
            for section, kind in (("scheduler", SchedulerConfig), ("cache", CacheConfig), ("engine", cls)):
                if name in kind.__dataclass_fields__ and name not in ("scheduler", "cache", "model"):
                    sections[section][name] = value
                    break
            else:
                raise ConfigError(name, "unknown engine setting")
        return cls(model=model, scheduler=SchedulerConfig(**sections["scheduler"]),
                   cache=CacheConfig(**sections["cache"]), **sections["engine"])

    def to_dict(self) -> dict:
        """JSON- and msgpack-ready (the policy as :meth:`Policy.to_dict`); :meth:`from_dict`
        inverts it."""
        scheduler = {f.name: getattr(self.scheduler, f.name) for f in dataclasses.fields(self.scheduler)}
        scheduler["policy"] = self.scheduler.policy.to_dict()
        engine = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("scheduler", "cache")}
        return {**engine, "scheduler": scheduler, "cache": dataclasses.asdict(self.cache)}

    @classmethod
    def from_dict(cls, data: dict) -> "EngineConfig":
        """The configuration :meth:`to_dict` wrote.

        Raises:
            ConfigError, PolicyError: an invalid value; KeyError: a missing section.
        """
        scheduler = dict(data["scheduler"])
        scheduler["policy"] = Policy().updated(scheduler.get("policy") or {})
        rest = {k: v for k, v in data.items() if k not in ("scheduler", "cache")}
        return cls(**rest, scheduler=SchedulerConfig(**scheduler), cache=CacheConfig(**data["cache"]))


def resolve_max_model_len(
    requested: int | None, model_max: int, kv_capacity_tokens: int
) -> int:
    """The ``max_model_len`` to serve.

    Args:
        requested: the configured value, or None to take the model's.
        model_max: the model's context length (its sliding window, if smaller).
        kv_capacity_tokens: tokens the whole KV cache holds.

    Raises:
        ConfigError: an explicit value above the model's context length, or a KV cache that
            cannot hold one request of the requested length (naming the field to change).
    """
    if requested is None:
        return min(model_max, kv_capacity_tokens)
    _check(
        requested <= model_max,
        "max_model_len",
        f"{requested} exceeds the model's context length {model_max}",
    )
    _check(
        requested <= kv_capacity_tokens,
        "num_kv_blocks",
        f"the KV cache holds {kv_capacity_tokens} tokens, fewer than max_model_len={requested} "
        "(raise the KV cache size or lower max_model_len)",
    )
    return requested


def port_argument(value: str) -> int:
    """An ``argparse`` type for a TCP port (``cadenza serve``, ``cadenza up``).

    Raises:
        argparse.ArgumentTypeError: not an integer from 1 to 65535.
    """
    import argparse

    try:
        port = int(value)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number from 1 to 65535, got {value!r}")
    return port


def listen_problem(host: str, port: int) -> str | None:
    """Why a server could not listen on ``host:port`` now (in use, bad address), or None.

    Checked before anything slow starts (loading a model, starting replicas), so that a busy port
    is a one-line error at once rather than after minutes. Binds with ``SO_REUSEADDR``, as
    aiohttp's server does, so a port in ``TIME_WAIT`` counts as free.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, OverflowError, UnicodeError) as exc:
        return f"cannot listen on {host}:{port}: {exc}"
    family, kind, proto, _name, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as exc:
            return f"cannot listen on {host}:{port}: {exc.strerror or exc} (another server, or an earlier one?)"
    return None
