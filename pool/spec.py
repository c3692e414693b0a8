"""A ServingPool's spec, read once: its roles, their replicas and their engine settings.

Both renderers — Kubernetes objects (:mod:`cadenza.operator.render`) and local processes
(:mod:`cadenza.local.up`) — work
from this view, so a pool means the same thing in a cluster and on a laptop.

Roles: ``colocated`` mode runs one role, ``colocated``, whose replicas serve every class.
``dedicated`` runs ``interactive`` replicas (the base engine settings with ``dedicated.engine`` on
top) and ``batch`` replicas (the base settings) for batch and background traffic. ``auto`` runs one
workload, ``auto``, whose pods start with the base settings and no routing; the SLO controller
gives each pod its role (colocated, interactive or prefill) in place — labels and live settings —
and only then routes to it (:mod:`cadenza.control.in_place`); unless ``controller.disaggregate``
is false they all run a KV transfer endpoint, so any may become a prefill replica. ``disaggregated`` runs ``prefill`` replicas
(``disaggregated.prefillEngine`` on top of the base), which compute long prompts and stream their
KV, and ``decode`` replicas (``disaggregated.decodeEngine`` on top) serving every class; both
have a KV transfer endpoint.

Tensor parallelism: every replica's model is split across ``spec.engine.tensorParallelSize``
devices (:attr:`Pool.tensor_parallel_size`; default the GPUs per replica, 1 without), the same in
every role: a decode replica takes a prefill replica's KV only from a peer of its own size.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cadenza.node.core.config import ConfigError
from cadenza.node.core.parallel import check_tensor_parallel
from cadenza.node.embedded import (
    EMBEDDED_MODEL_HEADS,
    EMBEDDED_MODEL_INTERMEDIATE_SIZE,
    EMBEDDED_MODEL_KV_HEADS,
    EMBEDDED_MODEL_NAME,
)
from cadenza.pool.engine_args import ENGINE_KNOBS, POLICY_KEYS, engine_config, policy_document, serve_args

MODEL_MOUNT = "/models"
DEFAULT_CLASS = {"colocated": "interactive", "interactive": "interactive", "batch": "batch", "auto": "interactive",
                 "prefill": "interactive", "decode": "interactive"}
MODES = ("colocated", "dedicated", "disaggregated", "auto")
KV_TRANSFER_ROLES = ("prefill", "decode")  # the roles whose replicas move prompt KV between them
_OVERRIDES = {"interactive": ("dedicated", "engine"), "prefill": ("disaggregated", "prefillEngine"),
              "decode": ("disaggregated", "decodeEngine")}  # role -> where its engine overrides are
# What a prefill or decode role may set on top of the base: a decode replica takes the prefill
# replica's KV blocks as they are, so the KV layout, the model length and the tensor-parallel size
# stay the pool's.
KV_ROLE_KEYS = frozenset({"tokenBudget", "chunkSize", "maxNumSeqs", "prefixCaching", "stepTimeTargetMs",
                          "kvCacheFraction", "classes", "tenants"})
# Extended resources that give a replica GPUs (torch reaches both through its "cuda" device);
# Kubernetes counts them in whole devices, and takes them from limits (requests must equal them).
GPU_RESOURCES = ("nvidia.com/gpu", "amd.com/gpu")


class PoolSpecError(ValueError):
    """A spec the schema accepts but that cannot run (reported as a condition, never retried)."""


@dataclass(frozen=True)
class Role:
    """One kind of replica in a pool.

    Attributes:
        name: ``colocated`` | ``interactive`` | ``batch`` | ``auto`` | ``prefill`` | ``decode``.
        replicas: how many.
        engine: the merged camelCase engine settings.
        kv_transfer: its replicas run a KV transfer endpoint: ``prefill`` and ``decode``, and
            ``auto`` when its controller may move replicas into the prefill role
            (:attr:`Pool.prefill_in_place`).
    """

    name: str
    replicas: int
    engine: Mapping[str, Any]
    kv_transfer: bool = False  # its replicas run a KV transfer endpoint (and need the pool's token to use it)

    def serve_args(self, model_args: list[str]) -> list[str]:
        """``cadenza serve`` arguments, except host, port and ``--policy`` (placed by the renderer)."""
        return [*model_args, *serve_args(self.engine), "--default-class", DEFAULT_CLASS[self.name]]

    def policy(self) -> dict[str, Any]:
        return policy_document(self.engine)

    def config_hash(self, model_args: list[str]) -> str:
        """Changes exactly when what this role's replicas run changes (rolls only them)."""
        doc = {"args": self.serve_args(model_args), "policy": self.policy()}
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Pool:
    """The parts of a (defaulted, schema-valid) ServingPool the renderers need."""

    name: str
    namespace: str
    spec: Mapping[str, Any]

    @property
    def mode(self) -> str:
        """``colocated`` | ``dedicated`` | ``disaggregated`` | ``auto``."""
        return self.spec.get("mode") if self.spec.get("mode") in MODES else "colocated"

    @property
    def model_name(self) -> str:
        return self.spec["model"]["name"]

    def model_args(self) -> list[str]:
        """``--model`` and ``--served-model-name`` as a replica in a cluster sees the model."""
        source = self.spec["model"].get("source", {"embedded": True})
        args = ["--served-model-name", self.model_name]
        if "path" in source:
            return ["--model", source["path"], *args]
        if "pvc" in source:
            sub = source["pvc"].get("subPath", "").strip("/")
            return ["--model", f"{MODEL_MOUNT}/{sub}".rstrip("/"), *args]
        if "hf" in source:
            return ["--model", self.hub_model, *args]
        return args  # the embedded default

    @property
    def hub_model(self) -> str | None:
        """``hf://org/name@revision`` of a Hub source, else None."""
        hf = self.spec["model"].get("source", {}).get("hf")
        return None if hf is None else f"hf://{hf['repo']}@{hf.get('revision', 'main')}"

    def roles(self) -> list[Role]:
        """The roles to run, validated against the engine's own rules.

        Raises:
            PoolSpecError: an engine setting the engine refuses, a dedicated or disaggregated
                split that leaves a role empty, a prefill or decode override outside
                :data:`KV_ROLE_KEYS` (the CRD refuses those too; ``cadenza up`` has no API server),
                or a tensor-parallel size the pool cannot run (:meth:`_check_tensor_parallel`).
        """
        self.gpus  # noqa: B018 - a GPU count that is not a whole number raises here
        replicas = int(self.spec.get("replicas", 1))
        if self.mode == "colocated":
            roles = [self.role_settings("colocated", replicas)]
        elif self.mode == "auto":
            roles = [self.role_settings("auto", replicas)]
            if self.prefill_in_place:  # the prefill role its controller may move replicas into
                self._check_kv_overrides("disaggregated", "prefill")
                self._check(self.role_settings("prefill"))
        else:
            first, rest, section, key = (("interactive", "batch", "dedicated", "interactiveReplicas")
                                         if self.mode == "dedicated" else
                                         ("prefill", "decode", "disaggregated", "prefillReplicas"))
            n = int(self.spec.get(section, {}).get(key, 1))
            if n >= replicas:
                raise PoolSpecError(f"spec.{section}.{key} ({n}) must be less than spec.replicas ({replicas})")
            for role in KV_TRANSFER_ROLES if self.mode == "disaggregated" else ():
                self._check_kv_overrides(section, role)
            roles = [self.role_settings(first, n), self.role_settings(rest, replicas - n)]
        for role in roles:
            self._check(role)
        self._check_tensor_parallel()
        return roles

    def routes(self) -> dict[str, str]:
        """The gateway's routes in this mode and the role whose replicas serve each:
        ``{"interactive": role, "batch": role}``, plus ``"prefill"`` in disaggregated mode.

        ``colocated`` and ``auto`` send both classes to their one role (auto's pods start
        colocated; the SLO controller then narrows each route to the pods it has given a role);
        ``dedicated`` sends interactive traffic to ``interactive`` and batch (and background) to
        ``batch``; ``disaggregated`` decodes every class on ``decode`` and prefills long prompts
        on ``prefill``. The operator's class Services, ``cadenza up``'s gateway config and the
        simulator's fleet all read it.
        """
        if self.mode == "dedicated":
            return {"interactive": "interactive", "batch": "batch"}
        if self.mode == "disaggregated":
            return {"interactive": "decode", "batch": "decode", "prefill": "prefill"}
        # colocated, auto: one role serves both. An auto pool's prefill route starts empty: the
        # controller puts a replica in it once it has moved one there (:attr:`prefill_in_place`).
        return {"interactive": self.mode, "batch": self.mode}

    def role_settings(self, name: str, replicas: int = 0) -> Role:
        """The settings a role runs with under this spec — the base engine settings with the role's
        overrides on top — whether or not the mode runs it (for the policy file of a role being
        retired, with 0 replicas). A pod of several GPUs and no ``tensorParallelSize`` gets one rank
        per GPU (:attr:`tensor_parallel_size`); with one GPU or none the flag is left out, the
        engine's default being the same 1 (so such a pool renders as it did before the field)."""
        base = dict(self.spec.get("engine", {}))
        if "tensorParallelSize" not in base and self.gpus > 1:
            base["tensorParallelSize"] = self.gpus
        if name in _OVERRIDES:
            section, key = _OVERRIDES[name]
            base = _merged(base, self.spec.get(section, {}).get(key, {}))
        kv = name in KV_TRANSFER_ROLES or (name == "auto" and self._controller_disaggregates)
        return Role(name, replicas, base, kv)

    @property
    def _controller_disaggregates(self) -> bool:
        return bool((self.spec.get("controller") or {}).get("disaggregate", True))

    @property
    def prefill_in_place(self) -> bool:
        """An ``auto`` pool whose SLO controller may move replicas into the prefill role in place
        (``spec.controller.disaggregate``, default true): every replica then runs a KV transfer
        endpoint (any may become a prefill replica; every one serving the classes may pull), and
        the gateways route long prompts to the prefill replicas as in a disaggregated pool."""
        return self.mode == "auto" and self._controller_disaggregates

    @property
    def min_prompt_tokens(self) -> int | None:
        """The pinned disaggregation threshold (``disaggregated.minPromptTokens``, read in mode
        auto too), or None: the gateway takes the one the decode replicas compute."""
        value = self.spec.get("disaggregated", {}).get("minPromptTokens")
        return None if value is None else int(value)

    def _check_kv_overrides(self, section: str, role: str) -> None:
        overrides = self.spec.get(section, {}).get(_OVERRIDES[role][1], {})
        where = f"spec.{section}.{_OVERRIDES[role][1]}"
        if unknown := sorted(set(overrides) - {*ENGINE_KNOBS, *POLICY_KEYS}):
            raise PoolSpecError(f"{where}.{unknown[0]}: unknown engine setting (allowed here: "
                                f"{', '.join(sorted(KV_ROLE_KEYS))})")
        if extra := sorted(set(overrides) - KV_ROLE_KEYS):
            same_tp = (", so prefill and decode replicas must have the same tensor-parallel size "
                       "(spec.engine.tensorParallelSize)") if "tensorParallelSize" in extra else ""
            raise PoolSpecError(f"{where} may not set {', '.join(extra)}: a decode replica takes the "
                                f"prefill replica's KV blocks as they are{same_tp} (allowed here: "
                                f"{', '.join(sorted(KV_ROLE_KEYS))})")

    def _check(self, role: Role) -> None:
        try:  # the engine's own rules, a chunk within the budget included, on the merged settings
            engine_config("/model", role.engine, self.model_name)
        except ConfigError as exc:
            raise PoolSpecError(f"role {role.name} (its engine overrides applied): {exc}") from None

    @property
    def tensor_parallel_size(self) -> int:
        """Devices each replica's model is split across: ``spec.engine.tensorParallelSize``, else
        the GPUs per replica (:attr:`gpus`), else 1.

        Raises:
            PoolSpecError: as :attr:`gpus`.
        """
        given = self.spec.get("engine", {}).get("tensorParallelSize")
        return given if given is not None else max(1, self.gpus)

    def _check_tensor_parallel(self) -> None:
        """Refuse a tensor-parallel size (:attr:`tensor_parallel_size`) this pool cannot run, where
        that is knowable without a cluster:

        - more ranks than the GPUs the pod asks for (a rank needs a GPU of its own; a pod without
          GPUs runs every rank on its CPUs);
        - a size the model's heads or MLP do not split over
          (:func:`~cadenza.node.core.parallel.check_tensor_parallel`, the engine's own rule), for the
          embedded model and a ``model.source.path`` whose ``config.json`` is readable here (under
          ``cadenza up``). A Hub or PVC model, or a path inside an image, is checked by the engine
          at start: its replicas exit with the same message.

        Raises:
            PoolSpecError: naming ``spec.engine.tensorParallelSize`` (and where a defaulted value
                came from) and the reason.
        """
        size, gpus = self.tensor_parallel_size, self.gpus
        if not isinstance(size, int) or size == 1:
            return  # a value that is not a size is the engine's to refuse (roles() did)
        field = "spec.engine.tensorParallelSize"
        given = f"{field} ({size})" if "tensorParallelSize" in self.spec.get("engine", {}) else \
            f"{field} ({size}, defaulted from the {gpus} GPUs per replica)"
        if gpus and size > gpus:
            raise PoolSpecError(f"{field}: {size} ranks need {size} GPUs per replica, but spec.resources asks for "
                                f"{gpus} (one GPU per rank: raise the GPU count or lower tensorParallelSize)")
        if (shape := self._model_shape()) is not None:
            try:
                check_tensor_parallel(size, *shape)
            except ConfigError as exc:
                raise PoolSpecError(f"{given}: {exc.reason}") from None

    def _model_shape(self) -> tuple[int, int, int, str] | None:
        """``(attention heads, KV heads, MLP intermediate size, the model as a message names it)``
        when knowable here: the embedded model's, or a ``model.source.path``'s readable
        ``config.json`` (relative to this process's folder, as ``cadenza up``'s replicas see it);
        else None."""
        source = self.spec["model"].get("source", {"embedded": True})
        if source.get("embedded"):
            return (EMBEDDED_MODEL_HEADS, EMBEDDED_MODEL_KV_HEADS, EMBEDDED_MODEL_INTERMEDIATE_SIZE,
                    EMBEDDED_MODEL_NAME)
        if "path" not in source:
            return None
        file = Path(source["path"]) / "config.json"
        try:
            config = json.loads(file.read_text(encoding="utf-8"))
            heads, inter = config["num_attention_heads"], config["intermediate_size"]
            kv = config.get("num_key_value_heads") or heads
        except (OSError, ValueError, KeyError, TypeError):
            return None  # not here (a path inside an image), or not a model the engine reads: its call
        if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in (heads, kv, inter)):
            return None
        return heads, kv, inter, f"{self.model_name} ({file})"

    def gateway_args(self) -> list[str]:
        """``--slo-targets-ms`` with every SLO target of the pool (the gateway's histograms are dense
        around them), or nothing without SLOs; in disaggregated mode, and in an auto pool that may
        move replicas into the prefill role (:attr:`prefill_in_place`), ``--disagg-min-prompt-tokens``,
        pinned (``disaggregated.minPromptTokens``) or ``auto``."""
        targets = sorted({float(v) for slo in (self.spec.get("slo") or {}).values() for v in (slo or {}).values()})
        args = ["--slo-targets-ms", ",".join(f"{t:g}" for t in targets)] if targets else []
        if self.mode == "disaggregated" or self.prefill_in_place:
            pinned = self.min_prompt_tokens
            args += ["--disagg-min-prompt-tokens", "auto" if pinned is None else str(pinned)]
        return args

    @property
    def gpus(self) -> int:
        """GPUs per replica (:data:`GPU_RESOURCES`, from limits, else requests; 0 without).

        Raises:
            PoolSpecError: a GPU count that is not a whole number, or GPUs of two vendors.
        """
        resources = self.spec.get("resources", {})
        found = {}
        for name in GPU_RESOURCES:
            value = resources.get("limits", {}).get(name, resources.get("requests", {}).get(name))
            if value is None:
                continue
            text = str(value).strip()
            if not text.isdigit():
                raise PoolSpecError(f"spec.resources: {name} must be a whole number of GPUs, got {value!r}")
            if int(text):
                found[name] = int(text)
        if len(found) > 1:
            raise PoolSpecError(f"spec.resources: GPUs of one vendor per replica, got {', '.join(found)}")
        return next(iter(found.values()), 0)


def _merged(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``overrides`` on top of ``base``, maps merged key by key (a role's ``classes.interactive``
    changes that class only, keeping the base's other classes and that class's other fields)."""
    out = dict(base)
    for key, value in overrides.items():
        out[key] = _merged(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), Mapping) else value
    return out


_DECIMAL = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1.0, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}


def cpu_threads(pool: Pool) -> int | None:
    """Intra-op threads for an engine pod: its CPU limit (else request), rounded down, at least 1.

    Without it torch starts one thread per core of the node, whatever the pod's CPU quota, and
    throttles. None when the spec gives no CPU quantity (or one in a form CPUs are not given in).
    """
    res = pool.spec.get("resources", {})
    value = res.get("limits", {}).get("cpu", res.get("requests", {}).get("cpu"))
    if value is None:
        return None
    text = str(value)
    number = text.rstrip("".join(_DECIMAL))
    try:
        cores = float(number) * _DECIMAL[text[len(number):]]
    except (KeyError, ValueError):
        return None
    return max(1, math.floor(cores))
