"""kmock's Kubernetes emulator over real HTTP on 127.0.0.1, in a thread, with a kubeconfig for it.

What the emulator does not do, and how the tests live with it: it sets no ``resourceVersion``
or ``generation`` (create custom objects with the first), no ``uid`` and no name from
``metadata.generateName`` (both set here, as the API server does: the operator's Events are
posted with ``generateName``, so without it every Event after the first collides), ignores label
selectors, has no PUT, no server-side apply (a PATCH is merged whatever its content type, and does
not create) and no garbage collection (:meth:`KubeEmulator.collect_garbage` plays it), never
updates Deployment status, and fails a
namespaced list of namespaces — so the operator runs cluster-wide here. As it never bumps
``resourceVersion``, kopf can see its own annotation patches late and handle an update again
(the handlers are idempotent): tests wait for converged state rather than count handler runs,
and keep each scenario to a few changes.
"""

from __future__ import annotations

import asyncio
import secrets
import string
import threading
import uuid
from pathlib import Path

import kmock
import yaml


_SUFFIX = string.ascii_lowercase + string.digits


class _Emulator(kmock.KubernetesEmulator):
    """kmock's emulator, giving each object it creates a ``uid`` as the API server does (kopf's
    indexes tell objects apart by it; objects of different kinds share names) and a name from its
    ``generateName`` when it has none (the prefix and five random characters, as the API server's
    ``SimpleNameGenerator``), and keeping only the requests in flight in kmock's own log: kmock
    matches each request by scanning every request it has logged, which grows quadratic over a
    scale test. ``served`` logs them all."""

    async def _handle(self, request):
        if request.resource is not None and request.action == kmock.action.CREATE and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            meta.setdefault("uid", str(uuid.uuid4()))
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + "".join(secrets.choice(_SUFFIX) for _ in range(5))
        state = self.__dict__.setdefault("_log", {"served": [], "inflight": set()})
        state["served"].append((request.method.value.upper(), request.url.path, request.url.query_string))
        state["inflight"].add(id(request))
        try:
            return await super()._handle(request)
        finally:
            state["inflight"].discard(id(request))
            self._requests[:] = [r for r in self._requests if id(r) in state["inflight"]]


class KubeEmulator:
    """Context manager: ``with KubeEmulator({"group/version/plural": ResourceInfo}) as api: ...``."""

    def __init__(self, custom_resources: dict[str, kmock.ResourceInfo]) -> None:
        self.custom_resources = custom_resources
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kube-emulator", daemon=True)
        self.url = ""

    def _run(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _start(self) -> None:
        self.emulator = _Emulator()
        await self.emulator.__aenter__()
        self.emulator.resources.load_bundled()
        for key, info in self.custom_resources.items():
            self.emulator.resources[key] = info
        self.server = kmock.Server(self.emulator)
        await self.server.__aenter__()
        self.url = str(self.server.url).rstrip("/")

    async def _stop(self) -> None:
        await self.server.__aexit__(None, None, None)
        await self.emulator.__aexit__(None, None, None)

    def __enter__(self) -> "KubeEmulator":
        self._thread.start()
        self._run(self._start())
        return self

    def __exit__(self, *exc) -> None:
        self._run(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def objects(self, resource: str) -> dict[tuple[str, str], dict]:
        """Live objects of ``resource`` (e.g. ``apps/v1/deployments``) as ``{(namespace, name): raw}``."""
        wanted = kmock.resource(resource)

        async def snapshot():
            return {(ns, name): dict(obj.raw) for (res, ns, name), obj in self.emulator.objects.items()
                    if res == wanted and not obj.deleted}

        return self._run(snapshot(), 5.0)

    def collect_garbage(self) -> int:
        """Play the garbage collector once: delete every object whose owners are all gone (what
        kube-controller-manager does for owner references); how many went."""

        async def sweep():
            async with self.emulator._lock:
                live = {obj.raw.get("metadata", {}).get("uid") for obj in self.emulator.objects.values()
                        if not obj.deleted}
                gone = 0
                for (resource, _ns, _name), obj in list(self.emulator.objects.items()):
                    if obj.deleted:
                        continue
                    refs = obj.raw.get("metadata", {}).get("ownerReferences") or []
                    if not refs or any(ref.get("uid") in live for ref in refs):
                        continue
                    raw = obj.raw
                    obj.delete()
                    await self.emulator._buses[resource].put({"type": "DELETED", "object": raw})
                    gone += 1
                return gone

        return self._run(sweep(), 5.0)

    def requests(self, query: bool = False) -> list[tuple[str, ...]]:
        """``(method, path)`` — with ``query``, ``(method, path, query string)`` — of every request
        the emulator has served so far, in order."""

        async def snapshot():
            served = self.emulator.__dict__.get("_log", {}).get("served", [])
            return [entry if query else entry[:2] for entry in served]

        return self._run(snapshot(), 10.0)

    def watchers(self, resource: str) -> int:
        """Watch streams of ``resource`` open now (each sees every change made from now on)."""
        wanted = kmock.resource(resource)

        async def count():
            return sum(bus.consumer_count for res, bus in list(self.emulator._buses.items()) if res == wanted)

        return self._run(count(), 5.0)

    def write_kubeconfig(self, path: Path) -> Path:
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "emulator", "user": {"token": "test"}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "emulator",
                                                          "namespace": "default"}}],
        }
        path.write_text(yaml.safe_dump(config))
        return path
