"""A ServingPool's spec, read once: its roles, their replicas and their engine settings.

Both renderers — Kubernetes objects (:mod:`.render`) and local processes (:mod:`.local`) — work
from this view, so a pool means the same thing in a cluster and on a laptop.

Roles: ``colocated`` mode runs one role, ``colocated``, whose replicas serve every class.
``dedicated`` runs ``interactive`` replicas (the base engine settings with ``dedicated.engine`` on
top) and ``batch`` replicas (the base settings) for batch and background traffic. ``auto`` runs one
workload, ``auto``, whose pods start with the base settings and no routing; the SLO controller
gives each pod its role (colocated or interactive) in place — labels and live settings — and
only then routes to it (:mod:`.actuator`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cadenza.node.core.config import ConfigError
from cadenza.operator.engine_args import engine_config, policy_document, serve_args

MODEL_MOUNT = "/models"
DEFAULT_CLASS = {"colocated": "interactive", "interactive": "interactive", "batch": "batch", "auto": "interactive"}


class PoolSpecError(ValueError):
    """A spec the schema accepts but that cannot run (reported as a condition, never retried)."""


@dataclass(frozen=True)
class Role:
    """One kind of replica in a pool.

    Attributes:
        name: ``colocated`` | ``interactive`` | ``batch``.
        replicas: how many.
        engine: the merged camelCase engine settings.
    """

    name: str
    replicas: int
    engine: Mapping[str, Any]

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
        """``colocated`` | ``dedicated`` | ``auto``."""
        return self.spec.get("mode") if self.spec.get("mode") in ("dedicated", "auto") else "colocated"

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
        return args  # the embedded default

    def roles(self) -> list[Role]:
        """The roles to run, validated against the engine's own rules.

        Raises:
            PoolSpecError: an engine setting the engine refuses, or a dedicated split that leaves
                a role empty.
        """
        replicas = int(self.spec.get("replicas", 1))
        base = dict(self.spec.get("engine", {}))
        if self.mode == "colocated":
            roles = [Role("colocated", replicas, base)]
        elif self.mode == "auto":
            roles = [Role("auto", replicas, base)]
        else:
            dedicated = self.spec.get("dedicated", {})
            interactive = int(dedicated.get("interactiveReplicas", 1))
            if interactive >= replicas:
                raise PoolSpecError(f"spec.dedicated.interactiveReplicas ({interactive}) must be less than "
                                    f"spec.replicas ({replicas})")
            merged = {**base, **dedicated.get("engine", {})}
            roles = [Role("interactive", interactive, merged), Role("batch", replicas - interactive, base)]
        for role in roles:
            self._check(role)
        return roles

    def role_settings(self, name: str) -> Role:
        """The settings a role runs with under this spec, whether or not the mode runs it (for the
        policy file of a role being retired; its replicas are 0 here)."""
        base = dict(self.spec.get("engine", {}))
        if name == "interactive":
            base = {**base, **self.spec.get("dedicated", {}).get("engine", {})}
        return Role(name, 0, base)

    def _check(self, role: Role) -> None:
        engine = role.engine
        budget, chunk = engine.get("tokenBudget", 512), engine.get("chunkSize", 256)
        if chunk is not None and chunk > budget:
            raise PoolSpecError(f"role {role.name}: chunkSize ({chunk}) exceeds tokenBudget ({budget}) once "
                                "spec.dedicated.engine is applied")
        try:
            engine_config("/model", engine, self.model_name)
        except ConfigError as exc:
            raise PoolSpecError(f"role {role.name}: {exc}") from None

    def gateway_args(self) -> list[str]:
        """``--slo-targets-ms`` with every SLO target of the pool (the gateway's histograms are dense
        around them), or nothing without SLOs."""
        targets = sorted({float(v) for slo in (self.spec.get("slo") or {}).values() for v in (slo or {}).values()})
        return ["--slo-targets-ms", ",".join(f"{t:g}" for t in targets)] if targets else []

    @property
    def gpus(self) -> int:
        limits = self.spec.get("resources", {}).get("limits", {})
        return int(limits.get("nvidia.com/gpu", 0) or 0)
