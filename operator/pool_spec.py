"""The :class:`~cadenza.pool.spec.Pool` a ServingPool body asks for, validated as the API server
would (defaults included) and as only the engine can (its own rules; pod settings clashing with
the operator's), once per distinct spec: validation costs tens of milliseconds, and the resync
reads every pool every few seconds.
"""

from __future__ import annotations

import copy
import functools
import json

import kopf

from cadenza.operator import render
from cadenza.pool.spec import Pool
from cadenza.pool.validate import validate_pool


def read_pool(body: kopf.Body) -> Pool:
    """Validate the pool as the API server would (defaults included) and read it.

    Raises:
        PoolValidationError, PoolSpecError: the spec cannot run.
    """
    spec = _validated(body.get("apiVersion"), body.get("kind"), body.metadata.name, body.metadata.namespace,
                      json.dumps(dict(body.spec), sort_keys=True))
    return Pool(body.metadata.name, body.metadata.namespace, copy.deepcopy(spec))


@functools.lru_cache(maxsize=1024)
def _validated(api_version: str, kind: str, name: str, namespace: str, spec: str) -> dict:
    """The defaulted spec of a valid pool, once per distinct spec (a pure function's cache: the
    same arguments always give the same spec)."""
    obj = validate_pool({"apiVersion": api_version, "kind": kind, "metadata": {"name": name, "namespace": namespace},
                         "spec": json.loads(spec)})
    render.render_all(Pool(name, namespace, obj["spec"]))  # engine-level checks; pod settings clashing with ours
    return obj["spec"]
