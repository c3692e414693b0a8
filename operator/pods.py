"""The pods of a pool: what runs in each engine replica and in the gateway.

Pure functions from a :class:`~cadenza.pool.spec.Pool` to pod specs (plain dicts); the objects
around them (Deployments, labels, Services, budgets) are :mod:`cadenza.operator.render`'s. An
engine pod runs ``cadenza serve`` on :data:`HTTP_PORT` (and, for prefill, decode and — unless
``controller.disaggregate`` is false — auto, a KV transfer endpoint on :data:`KV_PORT`, bound to
the pod IP), with a read-only root filesystem
(the model cache and ``/tmp`` are volumes), the pool's token where it is used (the admin Secret,
mounted at :data:`ADMIN_TOKEN_DIR`), probes, and a preStop drain before SIGTERM.
"""

from __future__ import annotations

from typing import Any

from cadenza.pool.spec import GPU_RESOURCES, MODEL_MOUNT, Pool, Role, cpu_threads

ADMIN_TOKEN_DIR = "/var/run/cadenza-admin"
HTTP_PORT = 8000
KV_PORT = 9000  # the KV transfer endpoint of prefill, decode and (unless controller.disaggregate is false) auto pods
# Every container of a pool's pods: a non-root user, a read-only root, no privilege, no capability.
_SECURE_CONTAINER = {
    "runAsNonRoot": True, "runAsUser": 65532, "readOnlyRootFilesystem": True,
    "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def admin_secret_name(pool: Pool) -> str:
    """The Secret holding the pool's admin token (modes auto and disaggregated; created by the
    operator)."""
    return f"{pool.name}-admin"


def token_volume(pool: Pool) -> tuple[dict, dict, dict]:
    """The admin Secret as ``(volume, mount, env)`` of a container that reads the token."""
    return ({"name": "admin-token", "secret": {"secretName": admin_secret_name(pool), "defaultMode": 0o440}},
            {"name": "admin-token", "mountPath": ADMIN_TOKEN_DIR, "readOnly": True},
            {"name": "CADENZA_ADMIN_TOKEN_FILE", "value": f"{ADMIN_TOKEN_DIR}/token"})


def resources(pool: Pool) -> dict:
    """``spec.resources`` with every quantity a string, as the Kubernetes API types it (YAML lets a
    user write ``nvidia.com/gpu: 1``; the CRD accepts int-or-string). GPUs asked for in requests
    only are put in limits too: Kubernetes takes extended resources from limits."""
    out = {section: {name: str(value) for name, value in quantities.items()}
           for section, quantities in pool.spec.get("resources", {}).items()}
    for name in GPU_RESOURCES:
        if name in out.get("requests", {}) and name not in out.get("limits", {}):
            out.setdefault("limits", {})[name] = out["requests"][name]
    return out


def _probe(path: str, **timing: int) -> dict:
    return {"httpGet": {"path": path, "port": "http"}, **timing}


def engine_pod(pool: Pool, role: Role) -> dict:
    """The pod spec of ``role``'s replicas: ``cadenza serve`` with the role's flags and policy file
    (and a KV transfer endpoint on the pod IP for prefill and decode), the model cache and
    ``/tmp`` as volumes under a read-only root, the token where the role uses it, probes, and a
    preStop drain before SIGTERM (:func:`termination`); a Hub model is fetched first by an init
    container."""
    model_args = pool.model_args()
    grace, drain = termination(pool)
    args = ["serve", "--host", "0.0.0.0", "--port", str(HTTP_PORT), *role.serve_args(model_args),
            "--policy", f"/etc/cadenza/{role.name}.policy.json", "--shutdown-timeout-s", str(max(1, grace - drain - 5))]
    if pool.gpus:
        args += ["--device", "cuda"]
    if role.kv_transfer:  # peers dial the pod IP ($(POD_IP) is expanded by the kubelet)
        args += ["--kv-transfer-port", str(KV_PORT), "--kv-transfer-host", "$(POD_IP)"]
    claim = (pool.spec.get("cache") or {}).get("claimName")
    cache = {"persistentVolumeClaim": {"claimName": claim}} if claim else {"emptyDir": {}}
    volumes = [{"name": "config", "configMap": {"name": f"{pool.name}-engine"}},
               {"name": "cache", **cache}, {"name": "tmp", "emptyDir": {}}]
    # The root filesystem is read-only: the model cache and /tmp (torch needs a temp dir) are volumes.
    mounts = [{"name": "config", "mountPath": "/etc/cadenza", "readOnly": True},
              {"name": "cache", "mountPath": "/cache"}, {"name": "tmp", "mountPath": "/tmp"}]
    source = pool.spec["model"].get("source", {})
    if "pvc" in source:
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": source["pvc"]["claimName"],
                                                                     "readOnly": True}})
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    # /dev/shm in memory, past the runtime's 64 MiB default: NCCL's buffers, and the arena the ranks of a
    # tensor-parallel replica share (8 MiB per rank, cadenza.node.runner.collectives), on a CPU pod too
    if pool.gpus or pool.tensor_parallel_size > 1:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    env = [
        {"name": "CADENZA_POOL", "value": pool.name},
        {"name": "CADENZA_REPLICA", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "OTEL_SERVICE_NAME", "value": "cadenza"},
        {"name": "HOME", "value": "/cache"},
        {"name": "XDG_CACHE_HOME", "value": "/cache"},
        {"name": "TRITON_CACHE_DIR", "value": "/cache/triton"},
    ]
    if (threads := cpu_threads(pool)) is not None:
        env.append({"name": "OMP_NUM_THREADS", "value": str(threads)})
    init = _fetch_model_container(pool, env, mounts)
    if init:  # the init container downloaded it into /cache: the engine reads the cache only
        env.append({"name": "HF_HUB_OFFLINE", "value": "1"})
    if role.kv_transfer:
        env.append({"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    if role.name == "auto" or role.kv_transfer:  # the SLO controller's admin calls; the gateway's KV headers
        volume, mount, token_env = token_volume(pool)
        volumes.append(volume)
        mounts.append(mount)
        env.append(token_env)
    ports = [{"name": "http", "containerPort": HTTP_PORT}]
    if role.kv_transfer:
        ports.append({"name": "kv", "containerPort": KV_PORT})
    container = {
        "name": "engine", "image": pool.spec["image"], "command": ["cadenza"], "args": args,
        "ports": ports,
        "env": env,
        "resources": resources(pool),
        "volumeMounts": mounts,
        "startupProbe": _probe("/health", periodSeconds=5, failureThreshold=120),
        "livenessProbe": _probe("/health", periodSeconds=10, failureThreshold=6),
        "readinessProbe": _probe("/ready", periodSeconds=5, failureThreshold=2),
        # While this sleeps the pod is still serving but no longer ready: every gateway drops it
        # (EndpointSlice ready false) before SIGTERM makes the server stop listening.
        "lifecycle": {"preStop": {"sleep": {"seconds": drain}}},
        "securityContext": _SECURE_CONTAINER,
    }
    return {
        **({"initContainers": init} if init else {}),
        "containers": [container], "volumes": volumes,
        "terminationGracePeriodSeconds": grace,  # the drain delay, then streams finish
        "securityContext": {"runAsNonRoot": True, "fsGroup": 65532},
    }


def _fetch_model_container(pool: Pool, env: list[dict], mounts: list[dict]) -> list[dict]:
    """The init container that downloads a Hub model (``model.source.hf``) into ``/cache``
    before the engine starts (none for other sources). It has the engine's cache settings and
    mounts, and the Hub token from ``tokenSecret``; the engine itself never sees the token."""
    model = pool.hub_model
    if model is None:
        return []
    hf = pool.spec["model"]["source"]["hf"]
    init_env = [e for e in env if e["name"] in ("HOME", "XDG_CACHE_HOME")]
    if secret := hf.get("tokenSecret"):
        init_env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": secret["name"], "key": secret.get("key", "token")}}})
    return [{
        "name": "fetch-model", "image": pool.spec["image"], "command": ["cadenza"],
        "args": ["fetch-model", model], "env": init_env,
        "volumeMounts": [m for m in mounts if m["name"] in ("cache", "tmp")],
        "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
        "securityContext": _SECURE_CONTAINER,
    }]


def termination(pool: Pool) -> tuple[int, int]:
    """``(terminationGracePeriodSeconds, preStop drain delay)`` of engine pods: ``spec.termination``
    (defaults 600 and 10). The server's shutdown timeout is what is left, less 5 s of margin."""
    t = pool.spec.get("termination") or {}
    return int(t.get("gracePeriodSeconds", 600)), int(t.get("drainDelaySeconds", 10))


def gateway_pod(pool: Pool, service_account: str) -> dict:
    """The pod spec of the pool's gateway: ``cadenza gateway --kubernetes`` reading the pool's
    EndpointSlices as ``service_account``, with the pool's token in disaggregated mode and in an
    auto pool that may move replicas into the prefill role (it asks the replicas to move KV)."""
    container = {
        "name": "gateway", "image": pool.spec.get("gateway", {}).get("image") or pool.spec["image"],
        "command": ["cadenza"],
        "args": ["gateway", "--kubernetes", "--namespace", pool.namespace, "--pool", pool.name,
                 "--host", "0.0.0.0", "--port", str(HTTP_PORT), *pool.gateway_args()],
        "ports": [{"name": "http", "containerPort": HTTP_PORT}],
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"cpu": "1", "memory": "512Mi"}},
        "livenessProbe": _probe("/health", periodSeconds=10),
        "readinessProbe": _probe("/ready", periodSeconds=5),
        "securityContext": _SECURE_CONTAINER,
    }
    pod: dict[str, Any] = {"serviceAccountName": service_account, "containers": [container],
                           "securityContext": {"runAsNonRoot": True}}
    if pool.mode == "disaggregated" or pool.prefill_in_place:  # the KV transfer headers need the pool's token
        volume, mount, token_env = token_volume(pool)
        container.update(volumeMounts=[mount], env=[token_env])
        pod["volumes"] = [volume]
    return pod
