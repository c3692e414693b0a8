"""A pool's pod settings on the pods the operator renders: ``spec.pod`` on every engine pod,
``spec.gateway.pod`` on the gateway's.

What passes through, unchanged: pod ``labels`` and ``annotations``; the scheduling fields
``nodeSelector``, ``tolerations``, ``affinity``, ``topologySpreadConstraints``,
``priorityClassName``, ``runtimeClassName`` and ``schedulerName``; ``imagePullSecrets`` and (engine
pods only) ``serviceAccountName``; and for each of the pod's containers (init containers too),
``env``, ``envFrom`` (e.g. ``OTEL_EXPORTER_OTLP_ENDPOINT`` from a ConfigMap) and ``volumeMounts``
of extra ``volumes``.

Invariants:
- **The operator's own keys are not overridable.** A label, annotation, environment variable,
  volume or mount path the operator sets itself is refused (:class:`PoolSpecError`), not merged:
  the selectors, the config hash, the model cache and the token must mean what the operator
  made them mean.
- **Additions only.** The user's env comes after the operator's, labels and annotations are
  added to its own; nothing the operator renders is removed.
- **The gateway keeps its service account**, which alone may read the pool's EndpointSlices.

Follows the pod-template passthrough of KServe's ``InferenceService`` and the Kubernetes
``PodSpec`` field names, so a platform team's values copy over as they are.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from cadenza.pool.spec import PoolSpecError

POD_FIELDS = ("nodeSelector", "tolerations", "affinity", "topologySpreadConstraints", "priorityClassName",
              "runtimeClassName", "schedulerName", "imagePullSecrets", "serviceAccountName")
CONTAINER_FIELDS = ("env", "envFrom", "volumeMounts")


def apply(template: dict, settings: Mapping[str, Any] | None, where: str, gateway: bool = False) -> dict:
    """``template`` (a Deployment's ``spec.template``) with ``settings`` added; ``template``
    itself is not changed.

    Args:
        settings: ``spec.pod`` or ``spec.gateway.pod`` (None or empty: the template as it is).
        where: the settings' path in the spec, for error messages.
        gateway: the gateway's pod (no ``serviceAccountName``).

    Raises:
        PoolSpecError: a key the operator sets itself, or the gateway's service account.
    """
    if not settings:
        return template
    out = copy.deepcopy(template)
    meta, pod = out.setdefault("metadata", {}), out["spec"]
    containers = [*pod.get("initContainers", []), *pod["containers"]]
    for key in ("labels", "annotations"):
        _add_map(meta, key, settings.get(key), f"{where}.{key}")
    if gateway and "serviceAccountName" in settings:
        raise PoolSpecError(f"{where}.serviceAccountName: the gateway runs as its own service account, "
                            f"{pod.get('serviceAccountName')}, the one allowed to read the pool's EndpointSlices")
    for key in POD_FIELDS:
        if key in settings:
            if key in pod:
                raise PoolSpecError(f"{where}.{key}: set by the operator ({pod[key]!r})")
            pod[key] = copy.deepcopy(settings[key])
    _add_named(pod, "volumes", settings.get("volumes"), f"{where}.volumes")
    for container in containers:  # an init container (the Hub download) gets them too: HF_ENDPOINT, a CA
        _add_named(container, "env", settings.get("env"), f"{where}.env")
        if settings.get("envFrom"):
            container["envFrom"] = [*container.get("envFrom", []), *copy.deepcopy(settings["envFrom"])]
        mounts = settings.get("volumeMounts") or []
        taken = {m["mountPath"].rstrip("/") for m in container.get("volumeMounts", [])}
        for mount in mounts:
            if mount.get("mountPath", "").rstrip("/") in taken:
                raise PoolSpecError(f"{where}.volumeMounts: {mount.get('mountPath')} is the operator's mount")
        if mounts:  # a volume may be mounted twice: only the paths must be new
            container["volumeMounts"] = [*container.get("volumeMounts", []), *copy.deepcopy(list(mounts))]
    return out


def _add_map(parent: dict, key: str, extra: Mapping[str, str] | None, where: str) -> None:
    if not extra:
        return
    own = parent.get(key, {})
    if clash := sorted(set(extra) & set(own)):
        raise PoolSpecError(f"{where}: {', '.join(clash)} set by the operator")
    parent[key] = {**own, **extra}


def _add_named(parent: dict, key: str, extra: list[Mapping[str, Any]] | None, where: str) -> None:
    """Append ``extra`` to the list ``parent[key]``, whose entries are named (``name``)."""
    if not extra:
        return
    own = parent.get(key, [])
    if clash := sorted({e["name"] for e in extra} & {e["name"] for e in own}):
        raise PoolSpecError(f"{where}: {', '.join(clash)} set by the operator")
    parent[key] = [*own, *copy.deepcopy(list(extra))]
