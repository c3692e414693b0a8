"""Traffic classes and tenants: the scheduling policy's settings (frozen, self-validating).

Every request has a **class** — ``interactive``, ``batch`` or ``background``, in that priority
order — and a **tenant**. Classes get their own queue and a share of each step's prefill budget;
tenants within a class share prefill tokens by weighted fair queuing. No torch here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from cadenza.node.core.errors import FieldError

CLASSES = ("interactive", "batch", "background")  # highest priority first
CLASS_RANK = {name: rank for rank, name in enumerate(CLASSES)}
# A class's queue bound when its policy sets none: this many waiting requests per running slot
# (``max_running``). Interactive requests wait at most about two generations before a 429 says
# "retry later"; batch and background tolerate long queues, not unbounded ones.
QUEUE_DEPTH_PER_SLOT = {"interactive": 2, "batch": 16, "background": 16}
DEFAULT_TENANT = "default"
# Most tenants a policy may list (a --policy file, a pool's spec.engine.tenants, PUT /admin/config):
# every tenant not listed takes ``default_tenant``, so the list holds only tenants with settings
# of their own. The bound keeps a policy document within a ConfigMap (1 MiB) and an admin call
# cheap; a listed tenant costs nothing per step while it has no live request.
MAX_TENANTS = 1024
_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$")


class PolicyError(FieldError):
    """An invalid policy value (:class:`~cadenza.node.core.errors.FieldError`: ``field`` is the setting's path)."""


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_class(name: object) -> str:
    """A valid class name (case-insensitive, returned lower-case), or :class:`PolicyError`."""
    if isinstance(name, str) and name.strip().lower() in CLASS_RANK:
        return name.strip().lower()
    raise PolicyError("class", f"must be one of {', '.join(CLASSES)}, got {_shown(name)}")


def check_tenant(name: object) -> str:
    """A valid tenant name (1-64 of ``A-Za-z0-9._:-``, starting alphanumeric), or :class:`PolicyError`."""
    if not isinstance(name, str) or not _TENANT.match(name):
        raise PolicyError("tenant", "must be 1-64 characters of A-Za-z0-9._:- starting with a letter or digit, "
                                    f"got {_shown(name)}")
    return name


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positive(value: object, path: str, kind: type = int, optional: bool = True) -> None:
    if value is None and optional:
        return
    ok = _is_number(value) and value > 0 and (kind is not int or isinstance(value, int))
    if not ok:
        suffix = " or null" if optional else ""
        raise PolicyError(path, f"must be a finite positive {kind.__name__}{suffix}, got {_shown(value)}")




@dataclass(frozen=True, slots=True)
class ClassPolicy:
    """How one class shares the prefill part of each step.

    Attributes:
        max_prefill_tokens: most prefill tokens the class may take in one step (None: no cap).
        min_share: fraction of the step's prefill budget kept for the class whenever it has
            prefill work, even while higher classes want more (0 to 1).
        max_queue_age_s: once the class's oldest waiting request has waited this long (seconds),
            it is admitted next, ahead of every other class (aging: nothing starves).
        max_queue_depth: most requests waiting in the class; more are refused with 429. None:
            derived from the engine's capacity, ``QUEUE_DEPTH_PER_SLOT[class] × max_running``
            (128 interactive and 1,024 batch or background requests at ``max_num_seqs`` 64).
    """

    max_prefill_tokens: int | None = None
    min_share: float = 0.0
    max_queue_age_s: float | None = None
    max_queue_depth: int | None = None

    def validate(self, path: str) -> None:
        _positive(self.max_prefill_tokens, f"{path}.max_prefill_tokens")
        if not _is_number(self.min_share) or not 0 <= self.min_share <= 1:
            raise PolicyError(f"{path}.min_share", f"must be between 0 and 1, got {_shown(self.min_share)}")
        _positive(self.max_queue_age_s, f"{path}.max_queue_age_s", float)
        _positive(self.max_queue_depth, f"{path}.max_queue_depth")


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """A tenant's weight and quotas within every class.

    Attributes:
        weight: share of prefill tokens relative to other tenants of the same class (> 0).
        max_concurrent: most live requests (waiting or running); more are refused with 429.
        max_queued_prompt_tokens: most prompt tokens waiting; more are refused with 429.
    """

    weight: float = 1.0
    max_concurrent: int | None = None
    max_queued_prompt_tokens: int | None = None

    def validate(self, path: str) -> None:
        _positive(self.weight, f"{path}.weight", float, optional=False)
        if self.weight < 1e-6 or self.weight > 1e6:
            raise PolicyError(f"{path}.weight", f"must be between 1e-6 and 1e6, got {_shown(self.weight)}")
        _positive(self.max_concurrent, f"{path}.max_concurrent")
        _positive(self.max_queued_prompt_tokens, f"{path}.max_queued_prompt_tokens")


def default_class_policies() -> dict[str, ClassPolicy]:
    """Interactive first; batch keeps a tenth of the prefill budget and ages in 30 s; background
    ages in 120 s."""
    return {
        "interactive": ClassPolicy(),
        "batch": ClassPolicy(min_share=0.1, max_queue_age_s=30.0),
        "background": ClassPolicy(max_queue_age_s=120.0),
    }


@dataclass(frozen=True, slots=True)
class Policy:
    """Classes, tenants and the knobs of the time-based decode reservation and preemption.

    Attributes:
        classes: one :class:`ClassPolicy` per class (all three).
        tenants: per-tenant settings (at most :data:`MAX_TENANTS`); tenants not listed get
            ``default_tenant``.
        default_tenant: settings of every unlisted tenant.
        step_time_target_ms: when set, prefill chunks shrink so the cost model's predicted step
            time stays within it (the reservation for decodes, in time).
        max_preemptions: a request preempted more than this many times is not preempted again.
        watermark: fraction of KV blocks kept free when admitting new prompts.
        tenant_cache_isolation: tenants never share prefix-cache blocks (a tenant cannot learn
            from time to first token whether another sent a prompt); off by default, so a system
            prompt common to every tenant is computed once.
    """

    classes: Mapping[str, ClassPolicy] = field(default_factory=default_class_policies)
    tenants: Mapping[str, TenantPolicy] = field(default_factory=dict)
    default_tenant: TenantPolicy = field(default_factory=TenantPolicy)
    step_time_target_ms: float | None = None
    max_preemptions: int = 2
    watermark: float = 0.01
    tenant_cache_isolation: bool = False

    def __post_init__(self) -> None:
        if set(self.classes) != set(CLASSES):
            raise PolicyError("classes", f"must define exactly {', '.join(CLASSES)}, got {', '.join(self.classes)}")
        for name, cls in self.classes.items():
            cls.validate(f"classes.{name}")
        if sum(c.min_share for c in self.classes.values()) > 1:
            raise PolicyError("classes", "the min_share values add up to more than 1")
        if len(self.tenants) > MAX_TENANTS:
            raise PolicyError("tenants", _too_many_tenants(len(self.tenants)))
        for name, tenant in self.tenants.items():
            check_tenant(name)
            tenant.validate(f"tenants.{name}")
        self.default_tenant.validate("default_tenant")
        _positive(self.step_time_target_ms, "step_time_target_ms", float)
        if not isinstance(self.max_preemptions, int) or isinstance(self.max_preemptions, bool) or self.max_preemptions < 0:
            raise PolicyError("max_preemptions", f"must be an integer >= 0, got {_shown(self.max_preemptions)}")
        if not _is_number(self.watermark) or not 0 <= self.watermark < 0.5:
            raise PolicyError("watermark", f"must be a number in [0, 0.5), got {_shown(self.watermark)}")
        if not isinstance(self.tenant_cache_isolation, bool):
            raise PolicyError("tenant_cache_isolation", f"must be true or false, got {_shown(self.tenant_cache_isolation)}")

    def cache_salt(self, tenant: str, client_salt: str | None) -> bytes:
        """The prefix-cache salt of a request: its tenant when tenants are isolated, and the
        client's ``cache_salt``; requests share cached KV blocks only under equal salts."""
        if not self.tenant_cache_isolation and not client_salt:
            return b""
        own = f"tenant={tenant}" if self.tenant_cache_isolation else ""
        return f"{own}\0{'salt=' + client_salt if client_salt else ''}".encode()

    def tenant(self, name: str) -> TenantPolicy:
        return self.tenants.get(name, self.default_tenant)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready settings (what ``GET /admin/config`` shows)."""
        return {
            "classes": {name: asdict(p) for name, p in self.classes.items()},
            "tenants": {name: asdict(p) for name, p in self.tenants.items()},
            "default_tenant": asdict(self.default_tenant),
            "step_time_target_ms": self.step_time_target_ms,
            "max_preemptions": self.max_preemptions,
            "watermark": self.watermark,
            "tenant_cache_isolation": self.tenant_cache_isolation,
        }

    def updated(self, changes: Mapping[str, Any]) -> "Policy":
        """A new policy with ``changes`` (same shape as :meth:`to_dict`, any subset) applied.

        Classes and tenants merge field by field; ``"tenants": {"t": null}`` removes a tenant.

        Raises:
            PolicyError: an unknown key, an invalid value, or more than :data:`MAX_TENANTS`
                tenants once applied (nothing is changed).
        """
        changes = _mapping(changes, "policy")
        unknown = set(changes) - {"classes", "tenants", "default_tenant", "step_time_target_ms",
                                  "max_preemptions", "watermark", "tenant_cache_isolation"}
        if unknown:
            raise PolicyError(sorted(map(str, unknown))[0], "unknown policy setting")
        classes = dict(self.classes)
        seen: dict[str, object] = {}
        for given, patch in _mapping(changes.get("classes", {}), "classes").items():
            try:
                name = check_class(given)  # canonical: "Batch" and " batch" are batch
            except PolicyError as exc:
                raise PolicyError("classes", exc.reason) from None
            if name in seen:
                raise PolicyError("classes", f"{_shown(seen[name])} and {_shown(given)} name the same class")
            seen[name] = given
            classes[name] = _merge(ClassPolicy, classes[name], patch, f"classes.{name}")
        tenants = dict(self.tenants)
        tenant_changes = _mapping(changes.get("tenants", {}), "tenants")
        count = len(tenants.keys() | tenant_changes.keys()) - sum(
            1 for name, patch in tenant_changes.items() if patch is None and name in tenants)
        if count > MAX_TENANTS:  # before any tenant is merged: a huge map is refused at the cost of counting it
            raise PolicyError("tenants", _too_many_tenants(count))
        for name, patch in tenant_changes.items():
            try:
                check_tenant(name)
            except PolicyError as exc:
                raise PolicyError("tenants", exc.reason) from None
            if patch is None:
                tenants.pop(name, None)
            else:
                tenants[name] = _merge(TenantPolicy, tenants.get(name, self.default_tenant), patch, f"tenants.{name}")
        default_tenant = self.default_tenant
        if "default_tenant" in changes:
            default_tenant = _merge(TenantPolicy, default_tenant, changes["default_tenant"], "default_tenant")
        return Policy(
            classes=classes,
            tenants=tenants,
            default_tenant=default_tenant,
            step_time_target_ms=changes.get("step_time_target_ms", self.step_time_target_ms),
            max_preemptions=changes.get("max_preemptions", self.max_preemptions),
            watermark=changes.get("watermark", self.watermark),
            tenant_cache_isolation=changes.get("tenant_cache_isolation", self.tenant_cache_isolation),
        )


def _too_many_tenants(count: int) -> str:  # the reason, of the field ``tenants``
    return (f"at most {MAX_TENANTS} tenants may be listed, got {count} (tenants not listed take "
            "default_tenant's settings)")


def _mapping(value: object, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise PolicyError(path, "must be an object")
    return value


def _merge(kind: type, current: Any, patch: object, path: str) -> Any:
    patch = _mapping(patch, path)
    names = {f.name for f in fields(kind)}
    if unknown := set(patch) - names:
        raise PolicyError(f"{path}.{sorted(map(str, unknown))[0]}", f"unknown setting (known: {', '.join(sorted(names))})")
    merged = kind(**{**asdict(current), **patch})
    merged.validate(path)
    return merged
