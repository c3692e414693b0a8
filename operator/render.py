"""Pure functions from a :class:`~cadenza.pool.spec.Pool` to the Kubernetes objects it needs.

Every function returns plain dicts (testable without a cluster). For a pool named ``p``:

- ConfigMap ``p-engine``: each role's policy document (mounted at ``/etc/cadenza``);
- a Deployment per role: ``p-colocated``, ``p-interactive`` and ``p-batch``, ``p-auto``, or
  ``p-prefill`` and ``p-decode``; the pod template carries a hash of the role's configuration, so a
  changed knob rolls only that role; prefill and decode pods (and auto pods, unless
  ``controller.disaggregate`` is false) also listen for KV transfers (port ``kv``, bound to the
  pod IP) and hold the pool's token;
- Services: ``p-interactive`` and ``p-batch`` (what the gateway routes each class to — in
  colocated mode both select every engine pod, so a mode shift changes selectors, never the
  gateway; while a shift waits for the new roles, ``narrow=False`` keeps them on every engine
  pod, old and new; in disaggregated mode they select the decode pods, and ``p-prefill`` the
  prefill pods; in mode auto each selects the pods labelled ``serves-<route>``, ``p-prefill``
  included), all headless (the gateway dials the pods its EndpointSlices list, so a virtual
  IP would only be a second, unused load balancer), and ``p-gateway`` (the pool's entry point);
- a PodDisruptionBudget per role, named like its Deployment (one pod of the role down at a time,
  so a drain never takes a whole role, and a one-replica role can still be drained), and
  ``p-gateway`` while the gateway runs two replicas;
- the gateway: ServiceAccount, Role and RoleBinding ``p-gateway`` (read EndpointSlices) and a
  Deployment ``p-gateway`` running ``cadenza gateway --kubernetes`` (with the pool's token where
  it may ask the replicas to move KV);
- while a role with a KV transfer endpoint runs (disaggregated mode, an auto pool that may move
  replicas into the prefill role, and a shift away from either until its pods are gone), the
  NetworkPolicy ``p-kv``: the KV port of those pods admits only the pool's own engine pods, their
  HTTP port stays open.

All carry an owner reference to the pool. What runs in the pods (containers, volumes, probes,
ports) is :mod:`cadenza.operator.pods`'s.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from cadenza.operator import pod_settings
from cadenza.operator.pods import HTTP_PORT, KV_PORT, admin_secret_name, engine_pod, gateway_pod
from cadenza.pool.spec import Pool, PoolSpecError, Role

GROUP, VERSION, KIND = "serving.cadenza.dev", "v1alpha1", "ServingPool"
POOL_LABEL, ROLE_LABEL = "serving.cadenza.dev/pool", "serving.cadenza.dev/role"
# mode auto: the workload label (in the Deployment's selector) and the routing labels the SLO
# controller sets on each pod once its role's settings are applied (never in the selector).
WORKLOAD_LABEL = "serving.cadenza.dev/workload"
SERVES_INTERACTIVE, SERVES_BATCH = "serving.cadenza.dev/serves-interactive", "serving.cadenza.dev/serves-batch"
SERVES_PREFILL = "serving.cadenza.dev/serves-prefill"
# the gateway routes and the labels that put an auto pod in them (the class routes, and prefill)
ROUTE_LABELS = {"interactive": SERVES_INTERACTIVE, "batch": SERVES_BATCH, "prefill": SERVES_PREFILL}
# the role labels an auto pod takes live (its Deployment's pods start colocated)
AUTO_ROLES = ("colocated", "interactive", "prefill")
COMPONENT_LABEL = "app.kubernetes.io/component"
CONFIG_HASH = "serving.cadenza.dev/config-hash"
ALL_ROLES = ("colocated", "interactive", "batch", "auto", "prefill", "decode")
MODE_OF_ROLE = {"colocated": "colocated", "interactive": "dedicated", "batch": "dedicated", "auto": "auto",
                "prefill": "disaggregated", "decode": "disaggregated"}
def labels(pool: Pool, component: str, role: str | None = None) -> dict[str, str]:
    out = {
        "app.kubernetes.io/name": "cadenza", "app.kubernetes.io/instance": pool.name,
        "app.kubernetes.io/managed-by": "cadenza-operator", COMPONENT_LABEL: component, POOL_LABEL: pool.name,
    }
    if role:
        out[ROLE_LABEL] = role
    return out


def engine_selector(pool: Pool, role: str | None = None) -> dict[str, str]:
    sel = {POOL_LABEL: pool.name, COMPONENT_LABEL: "engine"}
    if role:
        sel[ROLE_LABEL] = role
    return sel


def needs_admin_token(pool: Pool) -> bool:
    """Whether the pool's pods use its token: the SLO controller's admin calls (auto), the KV
    transfer headers between gateway and replicas (disaggregated)."""
    return pool.mode in ("auto", "disaggregated")


def admin_secret_meta(pool: Pool, owner: Mapping[str, str] | None) -> dict:
    """Metadata of the admin token Secret (its data is random, so the operator creates it once
    instead of rendering it)."""
    return _meta(pool, admin_secret_name(pool), "engine", owner)


def selector_string(pool: Pool) -> str:
    """The label selector of every engine pod (``status.selector``, for the scale subresource)."""
    return ",".join(f"{k}={v}" for k, v in engine_selector(pool).items())


def _meta(pool: Pool, name: str, component: str, owner: Mapping[str, str] | None, role: str | None = None) -> dict:
    meta: dict[str, Any] = {"name": name, "namespace": pool.namespace, "labels": labels(pool, component, role)}
    if owner:
        meta["ownerReferences"] = [{
            "apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": owner["name"], "uid": owner["uid"],
            "controller": True, "blockOwnerDeletion": True,
        }]
    return meta


def render_configmap(pool: Pool, roles: list[Role], owner=None) -> dict:
    return {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(pool, f"{pool.name}-engine", "engine", owner),
        "data": {f"{role.name}.policy.json": json.dumps(role.policy(), indent=2, sort_keys=True) + "\n"
                 for role in roles},
    }


def render_engine_deployment(pool: Pool, role: Role, owner=None) -> dict:
    """The Deployment of ``role``'s replicas (its pod: :func:`~cadenza.operator.pods.engine_pod`),
    the hash of its configuration on the pod template, so that a change rolls only this role."""
    pod_labels = labels(pool, "engine", role.name)
    selector = role_selector(pool, role.name)
    if role.name == "auto":  # the role label changes on a live pod, so it cannot be in the selector
        pod_labels = {**labels(pool, "engine", "colocated"), WORKLOAD_LABEL: "auto"}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _meta(pool, f"{pool.name}-{role.name}", "engine", owner, role.name),
        "spec": {
            "replicas": role.replicas,
            "selector": {"matchLabels": selector},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": _rollout(pool)},
            "template": pod_settings.apply({
                "metadata": {"labels": pod_labels, "annotations": {CONFIG_HASH: role.config_hash(pool.model_args())}},
                "spec": engine_pod(pool, role),
            }, pool.spec.get("pod"), "spec.pod"),
        },
    }


def _rollout(pool: Pool) -> dict:
    """A CPU pool surges a new pod before stopping an old one; a GPU pool has no spare GPU to surge
    onto, so it replaces one pod at a time."""
    if pool.gpus:
        return {"maxSurge": 0, "maxUnavailable": 1}
    return {"maxSurge": 1, "maxUnavailable": 0}


def _service(pool: Pool, name: str, component: str, selector: dict, owner=None, headless: bool = False) -> dict:
    spec: dict[str, Any] = {"selector": selector, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}
    if headless:  # endpoints only, no virtual IP: the gateway picks the pods itself
        spec = {"clusterIP": "None", **spec}
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(pool, name, component, owner), "spec": spec}


def render_services(pool: Pool, owner=None, narrow: bool = True) -> list[dict]:
    """The headless Service of each gateway route (:meth:`Pool.routes`: ``p-interactive``,
    ``p-batch``, and ``p-prefill`` in disaggregated mode and in an auto pool that may move
    replicas into the prefill role, :attr:`Pool.prefill_in_place`) and the gateway's Service.

    A route's Service selects its role's pods; where one role serves every route (colocated,
    auto) every engine pod, so a shift changes selectors, never the gateway; in mode auto, the
    pods the SLO controller has labelled for the route (``serves-<route>``). With
    ``narrow=False`` the class Services select every engine pod, whatever the mode."""
    routes = pool.routes()
    one_role = len(set(routes.values())) == 1
    services = [_service(pool, f"{pool.name}-{route}", "engine", _route_selector(pool, route, role, one_role, narrow),
                         owner, headless=True) for route, role in routes.items()]
    if pool.prefill_in_place:  # the pods the controller has moved into the prefill role, whatever the shift
        services.append(_service(pool, f"{pool.name}-prefill", "engine",
                                 {**engine_selector(pool), SERVES_PREFILL: "true"}, owner, headless=True))
    gateway = {POOL_LABEL: pool.name, COMPONENT_LABEL: "gateway"}
    return [*services, _service(pool, f"{pool.name}-gateway", "gateway", gateway, owner)]


def _route_selector(pool: Pool, route: str, role: str, one_role: bool, narrow: bool) -> dict[str, str]:
    if route == "prefill":  # the prefill pods, whatever the shift
        return engine_selector(pool, role)
    if narrow and role == "auto":  # routed by the labels the controller sets on each pod
        return {**engine_selector(pool), ROUTE_LABELS[route]: "true"}
    if not narrow or one_role:
        return engine_selector(pool)
    return engine_selector(pool, role)


def render_pdbs(pool: Pool, roles: list[str], owner=None) -> list[dict]:
    """A PodDisruptionBudget per engine role in ``roles`` (running or retiring), selecting what
    its Deployment selects, and one for the gateway when it runs two replicas."""
    def pdb(name: str, component: str, selector: dict, role: str | None = None) -> dict:
        return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                "metadata": _meta(pool, name, component, owner, role),
                "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector}}}

    out = [pdb(f"{pool.name}-{role}", "engine", role_selector(pool, role), role) for role in roles]
    if _gateway_replicas(pool) > 1:
        out.append(pdb(f"{pool.name}-gateway", "gateway", {POOL_LABEL: pool.name, COMPONENT_LABEL: "gateway"}))
    return out


def network_policy_name(pool: Pool) -> str:
    return f"{pool.name}-kv"


def render_network_policy(pool: Pool, roles: list[str], owner=None) -> list[dict]:
    """The NetworkPolicy of the pool's KV transfer endpoints, when one of the engine roles in
    ``roles`` (running or retiring) runs one (:attr:`Role.kv_transfer`); none otherwise.

    It selects the pods of those roles (an ``auto`` pod by every role label it may take,
    :data:`AUTO_ROLES`) and admits ingress to their KV port (:data:`KV_PORT`, TCP)
    only from the pool's own engine pods (a decode replica pulls from a prefill replica; nothing
    else speaks the KV protocol, the gateway included), and to their HTTP port
    (:data:`HTTP_PORT`) from anywhere, as before: a policy that selects a pod denies every
    ingress it does not list, and the gateway, the kubelet's probes and Prometheus reach the
    engine there. Egress is left as it is. Only a network plugin that enforces NetworkPolicy
    (Calico, Cilium, ...) applies it; elsewhere it is accepted and does nothing.

    Source: https://kubernetes.io/docs/concepts/services-networking/network-policies/
    """
    kv = {name for name in roles if pool.role_settings(name).kv_transfer}
    if not kv:
        return []
    if "auto" in kv:  # auto pods change their role label live: select every role they may take
        kv = (kv - {"auto"}) | set(AUTO_ROLES)
    kv = sorted(kv)
    return [{
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": _meta(pool, network_policy_name(pool), "engine", owner),
        "spec": {
            "podSelector": {"matchLabels": engine_selector(pool),
                            "matchExpressions": [{"key": ROLE_LABEL, "operator": "In", "values": kv}]},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"ports": [{"protocol": "TCP", "port": HTTP_PORT}]},
                {"from": [{"podSelector": {"matchLabels": engine_selector(pool)}}],
                 "ports": [{"protocol": "TCP", "port": KV_PORT}]},
            ],
        },
    }]


def render_autoscaler(pool: Pool, owner=None) -> list[dict]:
    """The pool's HorizontalPodAutoscaler (``spec.autoscaling``; none without it). It scales the
    ServingPool's ``/scale`` subresource — ``spec.replicas``, read back from ``status.replicas``
    and ``status.selector`` — so the operator splits whatever count it sets among the roles as
    it would a hand-set one."""
    spec = pool.spec.get("autoscaling")
    if not spec:
        return []
    hpa: dict[str, Any] = {
        "scaleTargetRef": {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": pool.name},
        "minReplicas": int(spec.get("minReplicas", 1)), "maxReplicas": int(spec["maxReplicas"]),
    }
    hpa.update({key: spec[key] for key in ("metrics", "behavior") if spec.get(key)})
    return [{"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
             "metadata": _meta(pool, pool.name, "autoscaler", owner), "spec": hpa}]


def role_selector(pool: Pool, role: str) -> dict[str, str]:
    """What the Deployment of engine role ``role`` selects (auto's pods change role label live)."""
    return {**engine_selector(pool), WORKLOAD_LABEL: "auto"} if role == "auto" else engine_selector(pool, role)


def _gateway_replicas(pool: Pool) -> int:
    return 2 if int(pool.spec.get("replicas", 1)) > 1 else 1


def render_gateway(pool: Pool, owner=None) -> list[dict]:
    """ServiceAccount, Role, RoleBinding and Deployment of the pool's gateway."""
    name = f"{pool.name}-gateway"
    sa = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(pool, name, "gateway", owner)}
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta(pool, name, "gateway", owner),
        "rules": [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": _meta(pool, name, "gateway", owner),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": pool.namespace}],
    }
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(pool, name, "gateway", owner),
        "spec": {
            "replicas": _gateway_replicas(pool),
            "selector": {"matchLabels": {POOL_LABEL: pool.name, COMPONENT_LABEL: "gateway"}},
            "template": pod_settings.apply({"metadata": {"labels": labels(pool, "gateway")},
                                            "spec": gateway_pod(pool, name)},
                                           pool.spec.get("gateway", {}).get("pod"), "spec.gateway.pod", gateway=True),
        },
    }
    return [sa, role, binding, deployment]


def render_all(pool: Pool, owner: Mapping[str, str] | None = None, narrow: bool = True,
               retiring: tuple[str, ...] = ()) -> list[dict]:
    """Every object the pool needs, in creation order.

    Args:
        narrow: see :func:`render_services` (False while a mode shift waits for the new roles).
        retiring: roles whose Deployments still run during a mode shift: their policy files stay
            in the ConfigMap, so a pod of theirs that restarts still finds its file, and their
            disruption budgets and KV NetworkPolicy stay.

    Raises:
        PoolSpecError: a spec that cannot run (see :meth:`Pool.roles`).
    """
    roles = pool.roles()
    return [
        render_configmap(pool, [*roles, *(pool.role_settings(name) for name in retiring)], owner),
        *[render_engine_deployment(pool, role, owner) for role in roles],
        *render_services(pool, owner, narrow),
        *render_pdbs(pool, [*(role.name for role in roles), *retiring], owner),
        *render_network_policy(pool, [*(role.name for role in roles), *retiring], owner),
        *render_autoscaler(pool, owner),
        *render_gateway(pool, owner),
    ]


def render_retiring(pool: Pool, retiring: tuple[str, ...], owner=None) -> list[dict]:
    """The Deployments of the roles a mode shift is retiring (``retiring``: role names), as the
    mode that runs them (:data:`MODE_OF_ROLE`) renders them under the current spec.

    For a shift that changes only ``mode`` this is exactly what was applied before the shift
    (the engine Deployment of a role does not depend on the mode), so the caller can hold a
    retiring Deployment to it — a hand edit is set back while it still serves — and leave alone
    one the spec now renders otherwise (checking the rendering's digest): a role about to go is
    never rolled or rescaled mid-shift. A split the current spec no longer allows renders nothing.
    """
    out = []
    for mode in dict.fromkeys(MODE_OF_ROLE[name] for name in retiring):
        before = Pool(pool.name, pool.namespace, {**pool.spec, "mode": mode})
        try:
            roles = before.roles()
        except PoolSpecError:
            continue
        out += [render_engine_deployment(before, role, owner) for role in roles if role.name in retiring]
    return out


def stale_deployments(pool: Pool, roles: list[Role]) -> list[str]:
    """Engine Deployments of roles the current mode does not run (to delete after a shift)."""
    running = {role.name for role in roles}
    return [f"{pool.name}-{role}" for role in ALL_ROLES if role not in running]


def stale_pdbs(pool: Pool, roles: list[Role]) -> list[str]:
    """PodDisruptionBudgets the pool no longer renders once a shift is done: those of roles the
    mode does not run, the gateway's when it runs one replica, and ``p-engine`` (one for every
    engine pod, before budgets were per role)."""
    running = {role.name for role in roles}
    stale = [f"{pool.name}-{role}" for role in ALL_ROLES if role not in running] + [f"{pool.name}-engine"]
    return stale + ([f"{pool.name}-gateway"] if _gateway_replicas(pool) == 1 else [])


def stale_network_policies(pool: Pool, roles: list[str]) -> list[str]:
    """The KV NetworkPolicy when no engine role in ``roles`` (running or retiring) needs it."""
    return [] if render_network_policy(pool, roles) else [network_policy_name(pool)]


def stale_services(pool: Pool) -> list[str]:
    """Services the current mode does not render (to delete after a shift), and ``p``, which
    selected every engine pod before the class Services went headless and nothing used."""
    keep_prefill = pool.mode == "disaggregated" or pool.prefill_in_place
    return [pool.name] + ([] if keep_prefill else [f"{pool.name}-prefill"])
