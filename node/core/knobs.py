"""Every engine knob, declared once: its type, default, bounds, CLI flag, CRD field, whether a
running engine may change it, and its help.

Everything that names a knob derives from :data:`KNOBS`: the ``cadenza serve`` flags
(:mod:`cadenza.node.cli`), the ``spec.engine`` fields of a ServingPool and the flags the operator
renders from them (:mod:`cadenza.pool.engine_args`, whose CRD schema a test checks against
this table), ``GET /admin/config``'s view and the keys ``PUT /admin/config`` accepts
(:func:`config_view`, :func:`reconfigured`), and the engine's own reconfiguration. The values
themselves are still checked where they live — :mod:`cadenza.node.core.config` and
:mod:`cadenza.node.core.policy` — so a bad value gets the same message from every door. No torch
here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cadenza.node.core.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    CacheConfig,
    ConfigError,
    TEXT_SPECIAL_TOKENS,
    SchedulerConfig,
    check_chunk_within_budget,
)
from cadenza.node.core.parallel import MAX_TENSOR_PARALLEL_SIZE
from cadenza.node.core.policy import MAX_TENANTS, Policy, PolicyError

SECTIONS = ("engine", "scheduler", "cache", "policy")


@dataclass(frozen=True, slots=True)
class Knob:
    """One engine setting.

    Attributes:
        name: the configuration field, and the key of ``/admin/config``.
        section: where it lives: ``engine`` (:class:`EngineConfig`), ``scheduler``, ``cache`` or
            ``policy`` (:class:`~cadenza.node.core.policy.Policy`).
        kind: ``int``, ``float``, ``bool``, ``str`` or ``dict`` (class and tenant policies).
        default: the value when unset (None: decided at start, e.g. from the model).
        help: one line for ``--help`` and the CRD's description.
        cli: the ``cadenza serve`` flag (None: no flag of its own).
        crd: the ``spec.engine`` field of a ServingPool (None: not a pool setting).
        live: a running engine may change it (``PUT /admin/config``); the others need a restart.
        minimum, maximum: inclusive bounds of a number (None: unbounded on that side).
        nullable: None is a value of its own (``--chunk-size none``: no cap).
        choices: the only values allowed (strings, or the CRD's enum of a number).
    """

    name: str
    section: str
    kind: type
    default: Any
    help: str
    cli: str | None = None
    crd: str | None = None
    live: bool = False
    minimum: float | None = None
    maximum: float | None = None
    nullable: bool = False
    choices: tuple = field(default=())

    def check(self, value: Any) -> None:
        """Refuse a number outside this knob's bounds (the type is checked where the value lives).

        Raises:
            ConfigError: naming the knob and the bound.
        """
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return
        if self.minimum is not None and value < self.minimum:
            raise ConfigError(self.name, f"must be >= {self.minimum}, got {value}")
        if self.maximum is not None and value > self.maximum:
            raise ConfigError(self.name, f"must be <= {self.maximum}, got {value}")


_S, _C, _P = SchedulerConfig(), CacheConfig(), Policy()

KNOBS: tuple[Knob, ...] = (
    Knob("token_budget", "scheduler", int, _S.token_budget, "Tokens per step, decode + prefill.",
         cli="--token-budget", crd="tokenBudget", live=True, minimum=1, maximum=1 << 20),
    Knob("chunk_size", "scheduler", int, _S.chunk_size,
         "Most prompt tokens a request prefills per step ('none' = unlimited).",
         cli="--chunk-size", crd="chunkSize", live=True, minimum=1, maximum=1 << 20, nullable=True),
    Knob("max_num_seqs", "scheduler", int, _S.max_num_seqs, "Most requests running at once.",
         cli="--max-num-seqs", crd="maxNumSeqs", live=True, minimum=1, maximum=65536),
    Knob("max_model_len", "scheduler", int, None, "Most tokens per request (default: the model's).",
         cli="--max-model-len", crd="maxModelLen", minimum=1, nullable=True),
    Knob("prefix_caching", "scheduler", bool, _S.prefix_caching, "Reuse the KV blocks of identical prompt prefixes.",
         cli="--prefix-caching", crd="prefixCaching", live=True),
    Knob("block_size", "cache", int, _C.block_size, "Tokens per KV block (a power of two).",
         cli="--block-size", crd="blockSize", choices=(8, 16, 32, 64, 128)),
    Knob("num_kv_blocks", "cache", int, None, "KV blocks in the pool (default: sized from memory).",
         cli="--num-kv-blocks", minimum=1, nullable=True),
    Knob("kv_cache_fraction", "cache", float, _C.kv_cache_fraction, "Fraction of free GPU memory for the KV cache.",
         cli="--kv-cache-fraction", crd="kvCacheFraction", minimum=0.05, maximum=1.0),
    Knob("dtype", "engine", str, "auto", "Weights, activations and KV cache: auto is bfloat16 on CUDA, float32 on CPU.",
         cli="--dtype", choices=DTYPES),
    Knob("attention_backend", "engine", str, "auto",
         "Kernels: auto (CADENZA_ATTENTION_BACKEND, else triton on CUDA, the compiled cpu kernels for float32 on "
         "the CPU, torch otherwise).",
         cli="--attention-backend", choices=ATTENTION_BACKENDS),
    Knob("seed", "engine", int, 0, "Seed of every request that brings no seed of its own.", cli="--seed",
         minimum=-(2**63), maximum=2**63 - 1),
    Knob("text_special_tokens", "engine", str, "control",
         "Special-token text in requests (<|im_start|> in chat content or a prompt): control makes it control "
         "tokens, as vLLM and transformers do (a user can forge a system turn); plain encodes it as text, the chat "
         "template's own markup staying control tokens.",
         cli="--text-special-tokens", crd="textSpecialTokens", choices=TEXT_SPECIAL_TOKENS),
    Knob("cuda_graphs", "engine", bool, True,
         "Capture decode steps (and mixed steps with one bounded chunk) in CUDA graphs at start-up and replay them "
         "(--no-cuda-graphs: every kernel launched from Python each step). CUDA with the triton backend only; ignored on "
         "the CPU.",
         cli="--cuda-graphs", crd="cudaGraphs"),
    Knob("tensor_parallel_size", "engine", int, 1,
         "Devices one replica's model is split across (tensor parallelism: one worker process per device after the "
         "first; NCCL on GPUs, shared memory on the CPU). Must divide the model's attention heads.",
         cli="--tensor-parallel-size", crd="tensorParallelSize", minimum=1, maximum=MAX_TENSOR_PARALLEL_SIZE),
    Knob("step_time_target_ms", "policy", float, None,
         "Shrink prefill chunks so predicted steps stay within this while interactive streams decode.",
         cli="--step-time-target-ms", crd="stepTimeTargetMs", live=True, minimum=1, nullable=True),
    Knob("classes", "policy", dict, None, "Per class: maxPrefillTokens, minShare, maxQueueAgeS, maxQueueDepth.",
         crd="classes", live=True),
    Knob("tenants", "policy", dict, None, "Per tenant: weight, maxConcurrent, maxQueuedPromptTokens.",
         crd="tenants", live=True),
    Knob("default_tenant", "policy", dict, None, "Settings of every tenant not listed.", live=True),
    Knob("max_preemptions", "policy", int, _P.max_preemptions,
         "A request preempted more than this many times is not preempted again.", live=True, minimum=0),
    Knob("watermark", "policy", float, _P.watermark, "Fraction of KV blocks kept free when admitting prompts.",
         live=True, minimum=0, maximum=0.5),
    Knob("tenant_cache_isolation", "policy", bool, _P.tenant_cache_isolation,
         "Tenants never share prefix-cache blocks.", live=True),
)
BY_NAME: dict[str, Knob] = {k.name: k for k in KNOBS}
BY_CRD: dict[str, Knob] = {k.crd: k for k in KNOBS if k.crd}
LIVE: tuple[str, ...] = tuple(k.name for k in KNOBS if k.live)
SHOWN: tuple[str, ...] = tuple(k.name for k in KNOBS if k.section in ("scheduler", "policy"))


def config_view(config: SchedulerConfig) -> dict[str, Any]:
    """The scheduling knobs of ``config`` as ``GET /admin/config`` shows them (JSON-ready;
    ``max_model_len`` is shown but cannot change)."""
    policy = config.policy.to_dict()
    return {name: policy[name] if BY_NAME[name].section == "policy" else getattr(config, name) for name in SHOWN}


def reconfigured(config: SchedulerConfig, changes: Mapping[str, Any]) -> SchedulerConfig:
    """``config`` with live ``changes`` applied (the body of ``PUT /admin/config``).

    Raises:
        ConfigError: a key that is not a knob, or one a running engine cannot change (naming
            it); PolicyError / ConfigError: an invalid value, or a chunk over the token budget
            once applied (:func:`check_chunk_within_budget`, as a pool file or the flags are
            checked). Nothing changes on an error.
    """
    if not isinstance(changes, Mapping):
        raise ConfigError("changes", "must be an object of settings")
    for key in changes:
        knob = BY_NAME.get(key)
        if knob is None:
            raise ConfigError(key, f"unknown setting (live settings: {', '.join(LIVE)})")
        if not knob.live or knob.section not in ("scheduler", "policy"):
            raise ConfigError(key, "cannot change on a running engine")
    check_live_changes(changes)
    plain = {k: v for k, v in changes.items() if BY_NAME[k].section == "scheduler"}
    policy_changes = {k: v for k, v in changes.items() if BY_NAME[k].section == "policy"}
    policy = config.policy.updated(policy_changes) if policy_changes else config.policy
    new = dataclasses.replace(config, **plain, policy=policy)
    if "token_budget" in changes or "chunk_size" in changes:
        check_chunk_within_budget(new.token_budget, new.chunk_size)
    return new


def check_live_changes(changes: Mapping[str, Any]) -> None:
    """The registry's bounds on the plain knobs of a ``PUT /admin/config`` body, and the size of
    its tenant map (the front end checks them before sending; the core checks them again).

    Raises:
        ConfigError: a number out of its knob's bounds; PolicyError: more than
            :data:`~cadenza.node.core.policy.MAX_TENANTS` tenants in the body.
    """
    if isinstance(changes, Mapping):
        for key, value in changes.items():
            knob = BY_NAME.get(key)
            if knob is not None and knob.kind in (int, float):
                knob.check(value)
        tenants = changes.get("tenants")
        if isinstance(tenants, Mapping) and len(tenants) > MAX_TENANTS:
            raise PolicyError("tenants", f"at most {MAX_TENANTS} tenants may be listed, got {len(tenants)} in the change")


def policy_from_view(view: Mapping[str, Any]) -> Policy:
    """The policy a config view (:func:`config_view`) shows; the default one for an empty view.

    Raises:
        PolicyError: a view that is not one.
    """
    return Policy().updated({k: v for k, v in view.items() if k in BY_NAME and BY_NAME[k].section == "policy"})
