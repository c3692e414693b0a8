"""A pool's ``status``, built from what one pass read of it (:class:`~.observe.Observed`): pure
functions, with the time injected, so every field and condition is tested without a cluster.

``status`` holds ``observedGeneration``, ``mode``, replicas per role and in all (``ready``:
``"ready/desired"``, the printer column), the label ``selector`` (the scale subresource), the
disaggregation threshold of a disaggregated pool, the SLO fields of a
pool with SLOs (an auto pool's ``shape``: ``{colocated: n, interactive: m, prefill: p}``, also
in the ``Ready`` message), and the
conditions ``Ready`` / ``Progressing`` / ``Degraded`` (with ``Flapping`` and ``SLOMet`` where SLOs
are read). A condition keeps its ``lastTransitionTime`` until its status flips.

Follows the condition conventions of the Kubernetes API (``metav1.Condition``: a CamelCase
reason, ``observedGeneration``); :mod:`.workload_status` reads why a role is not serving.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

import cadenza.node.metric_names as names
from cadenza.control.exposition import gauge_values
from cadenza.operator import render, workload_status
from cadenza.operator.observe import Observed
from cadenza.pool.spec import Pool, Role


def timestamp(now: datetime.datetime) -> str:
    """``now`` as a condition's ``lastTransitionTime`` (RFC 3339, UTC, whole seconds)."""
    return now.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def previous_condition(previous: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    """The condition ``kind`` of the status ``previous``, None when it has none."""
    return next((c for c in previous.get("conditions") or [] if c.get("type") == kind), None)


def condition(kind: str, status: bool | str, reason: str, message: str, *, previous: Mapping[str, Any],
              now: datetime.datetime, generation: int | None) -> dict:
    """A condition, keeping ``lastTransitionTime`` of the one in ``previous`` (the pool's status so
    far) unless its status flips (``status``: a bool, or ``"True"`` / ``"False"`` / ``"Unknown"``)."""
    value = status if isinstance(status, str) else ("True" if status else "False")
    before = previous_condition(previous, kind) or {}
    changed = before.get("status") != value
    cond = {"type": kind, "status": value, "reason": reason, "message": message,
            "lastTransitionTime": timestamp(now) if changed else before.get("lastTransitionTime", timestamp(now))}
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def readiness(is_ready: bool, ready: int, desired: int, problems: Sequence[tuple[str, str]]) -> tuple[str, str]:
    """``Ready``'s ``(reason, message)``: every replica ready, every role serving, or the first problem."""
    counts = f"{ready}/{desired} engine replicas ready"
    if ready == desired:
        return "AllReplicasReady", counts
    why = "; ".join(message for _reason, message in problems)
    if is_ready:
        return "Serving", f"{counts}; every role serves" + (f" ({why})" if why else "")
    return (problems[0][0] if problems else "ReplicasNotReady"), counts + (f": {why}" if why else "")


def degraded(problems: Sequence[tuple[str, str]], conflicts: Sequence[str], *, previous: Mapping[str, Any],
             now: datetime.datetime, generation: int | None) -> dict:
    """``Degraded``: True for an object left alone (a conflict) or a problem nothing will fix by
    waiting (:data:`workload_status.DEGRADING`)."""
    stuck = [("Conflict", message) for message in conflicts]
    stuck += [(reason, message) for reason, message in problems if reason in workload_status.DEGRADING]
    stamp = {"previous": previous, "now": now, "generation": generation}
    if not stuck:
        return condition("Degraded", False, "AsExpected", "the spec is valid and applied", **stamp)
    return condition("Degraded", True, stuck[0][0], "; ".join(m for _r, m in stuck)[:1000], **stamp)


def build_status(pool: Pool, roles: Sequence[Role], observed: Observed, previous: Mapping[str, Any],
                 now: datetime.datetime, *, generation: int | None = None,
                 shift: tuple[Sequence[str], Sequence[str]] = ((), ()), conflicts: Sequence[str] = ()) -> dict:
    """The status to merge-patch onto the pool.

    Args:
        pool, roles: the pool and the roles it runs.
        observed: what this pass read (the Deployments, the pods of a role short of replicas, the
            gateways' threshold, the SLO fields — None there keeps the last ``SLOMet``).
        previous: the pool's status so far (conditions keep their transition times; a role or
            a threshold no longer reported is removed by name, as a merge patch needs).
        now: the time of this pass (UTC); generation: ``metadata.generation``.
        shift: (new roles not ready yet, old Deployments kept serving) of a mode shift.
        conflicts: objects left alone (:class:`~.ssa.Conflict`), which make the pool degraded.

    Returns:
        The ``status`` fields, as a JSON merge patch (None deletes a key).
    """
    stamp = {"previous": previous, "now": now, "generation": generation}
    slo = observed.slo
    per_role, desired, ready, updated = {}, 0, 0, 0
    serving, unobserved, problems = True, False, []
    for role in roles:
        state = observed.deployment(f"{pool.name}-{role.name}") or {}
        per_role[role.name] = {"replicas": role.replicas, "readyReplicas": state.get("readyReplicas", 0)}
        role_ready = min(state.get("readyReplicas", 0), role.replicas)
        desired += role.replicas
        ready += role_ready
        updated += min(state.get("updatedReplicas", 0), role.replicas)
        serving = serving and (role_ready > 0 or role.replicas == 0)
        unobserved = unobserved or not workload_status.observed(state)
        if state and role_ready < role.replicas:  # why: its pods first (listed only while short)
            pods = observed.pods.get(role.name, ())
            if found := workload_status.pod_problem(pods) or workload_status.deployment_problem(state):
                problems.append((found[0], f"{role.name}: {found[1]}"))
    waiting, retiring = shift
    is_ready = serving or bool(retiring)  # every role serves (in a shift, the old one until the new are ready)
    rolling = updated < desired or ready < desired or unobserved
    progress = ("RolloutInProgress" if rolling else "RolloutComplete",
                f"{updated}/{desired} replicas updated, {ready}/{desired} ready")
    if retiring:
        rolling = True
        progress = ("ModeShift", f"mode {pool.mode}: {', '.join(retiring)} serving until role(s) "
                                 f"{', '.join(waiting)} are ready; {ready}/{desired} ready")
    ready_why = readiness(is_ready, ready, desired, problems)
    if slo is not None and slo.get("shape"):  # an auto pool: replicas per role the controller keeps
        shape = ", ".join(f"{role}: {n}" for role, n in slo["shape"].items())
        ready_why = (ready_why[0], f"{ready_why[1]}; shape {shape}")
    status = {
        "mode": pool.mode,
        "replicas": desired,
        "readyReplicas": ready,
        "ready": f"{ready}/{desired}",
        "selector": render.selector_string(pool),
        "roles": per_role,
        "conditions": [
            condition("Ready", is_ready, *ready_why, **stamp),
            condition("Progressing", rolling, *progress, **stamp),
            degraded(problems, conflicts, **stamp),
        ],
    }
    if pool.mode == "disaggregated":
        status["disaggregated"] = disaggregation_status(pool.min_prompt_tokens, observed.metrics)
    elif previous.get("disaggregated"):
        status["disaggregated"] = None  # a merge patch removes a map by name
    # A merge patch merges maps: a role the mode no longer runs must be removed by name.
    for stale in set(previous.get("roles") or {}) - set(per_role):
        per_role[stale] = None
    if slo is not None:
        # whole maps: a key the loop no longer reports (a drain that ended, a class gone quiet)
        # is removed, not kept by the merge patch
        status["latency"] = replacing(previous.get("latency"), slo["latency"])
        status["controller"] = replacing(previous.get("controller"), slo["controller"])
        for key in ("shape", "lastRetune", "lastShift"):
            if key in slo:
                status[key] = slo[key]
        if "flapping" in slo:
            status["conditions"].append(condition(
                "Flapping", slo["flapping"], "ReshapingFrozen" if slo["flapping"] else "Stable",
                "two reversals inside the flap window: reshaping frozen, decisions advisory until it passes"
                if slo["flapping"] else "no reversal of direction inside the flap window", **stamp))
        status["conditions"].append(condition("SLOMet", *slo["sloMet"], **stamp))
    elif kept := previous_condition(previous, "SLOMet"):
        status["conditions"].append(dict(kept))
    if generation is not None:
        status["observedGeneration"] = generation
    return status


def replacing(before: Any, after: Mapping[str, Any]) -> dict:
    """A merge patch that leaves ``after`` exactly where ``before`` was: every key ``before`` has
    and ``after`` lacks is set to None (a merge patch keeps what it does not name), map by map."""
    out = dict(after)
    if isinstance(before, Mapping):
        for key, value in before.items():
            if key not in out:
                out[key] = None
            elif isinstance(value, Mapping) and isinstance(out[key], Mapping):
                out[key] = replacing(value, out[key])
    return out


def invalid_status(message: str, *, previous: Mapping[str, Any], now: datetime.datetime, generation: int | None,
                   reason: str = "InvalidSpec") -> dict:
    """Conditions for a pool that cannot be rolled out (``InvalidSpec`` or ``ApplyRefused``)."""
    stamp = {"previous": previous, "now": now, "generation": generation}
    cause = "the spec cannot run" if reason == "InvalidSpec" else "the API refused an object"
    status = {"conditions": [
        condition("Ready", False, reason, cause, **stamp),
        condition("Progressing", False, reason, f"nothing more is rolled out until it is fixed: {cause}", **stamp),
        condition("Degraded", True, reason, message[:1000], **stamp),
    ]}
    if generation is not None:
        status["observedGeneration"] = generation
    return status


THRESHOLD_METRIC = names.GATEWAY_DISAGG_MIN_PROMPT_TOKENS.prometheus


def disaggregation_status(pinned: int | None, scraped: Mapping[str, str] | None) -> dict[str, Any]:
    """``status.disaggregated`` of a disaggregated pool: the shortest prompt its gateways send
    through a prefill replica, and where that figure comes from.

    Args:
        pinned: ``spec.disaggregated.minPromptTokens``, or None (the engines compute it).
        scraped: ``/metrics`` text by pod (:func:`~cadenza.operator.k8s_roles.scrape_pool`), or
            None; the gateways' ``cadenza.gateway.disagg.min_prompt_tokens`` gauge is read.

    Returns:
        ``{"minPromptTokens", "source": "pinned" | "computed", "message"}``, or ``source:
        unknown`` (no ``minPromptTokens``) while no gateway reports a computed threshold — the
        decode replicas' cost models calibrate on their first steps and their link on the first
        1 MiB pulled; until then nothing is moved.
    """
    if pinned is not None:
        return {"minPromptTokens": pinned, "source": "pinned", "message": "spec.disaggregated.minPromptTokens"}
    values = gauge_values((scraped or {}).values(), THRESHOLD_METRIC)
    if not values:
        return {"source": "unknown", "message": "no gateway reports a computed threshold yet (the decode replicas "
                                                "calibrate their step-time model and measure the link first); "
                                                "until then every prompt is prefilled where it decodes"}
    return {"minPromptTokens": int(max(values)), "source": "computed",
            "message": "from the decode replicas' step-time models and measured KV transfer bandwidth"}
