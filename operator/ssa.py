"""Idempotent apply and delete of the objects a pool renders, with the ``kubernetes`` client.

``apply`` is server-side apply (field manager ``cadenza-operator``, forced): the API server
records which fields the operator set (``metadata.managedFields``), so a field a new rendering
drops — a selector key, a resource limit, an annotation — is removed, while fields other
controllers, people and the API server own (status, defaults, ``clusterIP``, a label a team
added) stay theirs. The rendering's digest is kept in an annotation: when it is unchanged and the
live object still holds every field it sets (:func:`contains`), nothing is sent (no patch, no
event, no rollout); a hand edit to a field the operator renders — replicas, an image, a selector,
the ConfigMap — is applied back over. A missing object is created; one the pool does not control
is never touched (:class:`Conflict`).

Objects an older operator wrote with its client-side three-way merge carry the rendering, as
JSON, in a ``last-applied`` annotation: the first apply moves that manager's fields to
``cadenza-operator`` (:func:`upgrade_managed_fields`, as ``kubectl``'s ``csaupgrade`` does) and
drops the annotation, so those fields can be removed later too.

Every call goes through :mod:`.kube`'s shared client and fails as it sorts failures
(:class:`~.kube.Transient`: retry with backoff; :class:`~.kube.Refused`: not until something changes).

Source: Kubernetes server-side apply, https://kubernetes.io/docs/reference/using-api/server-side-apply/
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from typing import Any

import kubernetes
from kubernetes.client.rest import ApiException
from kubernetes.utils import parse_quantity

from cadenza.operator import kube

FIELD_MANAGER = "cadenza-operator"
RENDERED = "serving.cadenza.dev/rendered"  # digest of the rendering last applied
LAST_APPLIED = "serving.cadenza.dev/last-applied"  # client-side apply of operators before 0.x: migrated away
APPLY_PATCH = "application/apply-patch+yaml"

# Fields whose live value must equal the rendering, extra keys included: atomic in the API's
# schema, so server-side apply replaces them whole (a key added by hand is drift, not another's:
# a peer widened to every namespace in the KV NetworkPolicy, say). The API server defaults
# nothing inside them (the rendering spells out each port's protocol), so exact equality holds.
_ATOMIC = {"Service": (("spec", "selector"),),
           "NetworkPolicy": (("spec", "podSelector"), ("spec", "ingress"))}


class Conflict(kube.Refused):
    """An object with a child's name exists and the pool does not control it: it is left alone."""


def digest(obj: dict) -> str:
    """The form stored in :data:`RENDERED`: a short hash of the rendering (key order does not matter)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]


def contains(live: Any, desired: Any) -> bool:
    """Whether ``live`` (an object as the API server returns it) still holds everything
    ``desired`` sets: maps key by key (the server adds defaults; those are not ours), lists item
    by item at the same length, scalars equal (a quantity may come back as a number or a string).
    False after a hand edit to a field the operator renders: the next apply sets it back."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(k in live and contains(live[k], v) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(live, list) and len(live) == len(desired) and all(map(contains, live, desired))
    return (live == desired or (isinstance(live, (int, float, str)) and str(live) == str(desired))
            or _same_quantity(live, desired))


_QUANTITY = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+|[numkMGTPE]|[KMGTPE]i)?$")


def _same_quantity(live: Any, desired: Any) -> bool:
    """Whether two resource quantities are the same amount (the API server stores ``4096Mi`` as
    ``4Gi``, ``1000m`` as ``1``), for strings that are quantities with a unit."""
    if not (isinstance(desired, str) and isinstance(live, (str, int, float)) and _QUANTITY.match(desired)
            and _QUANTITY.match(str(live))) or desired.lstrip("+-").replace(".", "").isdigit():
        return False
    try:
        return parse_quantity(str(live)) == parse_quantity(desired)
    except ValueError:
        return False


def _at(obj: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        obj = obj.get(key) if isinstance(obj, dict) else None
    return obj


def _holds(live: dict, desired: dict) -> bool:
    """:func:`contains`, and every atomic field of the kind (:data:`_ATOMIC`) exactly as rendered."""
    return contains(live, desired) and all(_at(live, path) == _at(desired, path)
                                           for path in _ATOMIC.get(desired["kind"], ()))


def leftovers(stored: dict | None, desired: dict) -> dict | None:
    """A JSON merge patch (RFC 7386) that removes the keys an atomic map of ``stored`` (the object
    as the server answered an apply of ``desired``) still holds although ``desired`` dropped them;
    None when there are none.

    Server-side apply replaces an atomic map whole (a Service's ``spec.selector`` is
    ``x-kubernetes-map-type: atomic``), so on a real API server its answer holds the selector as
    rendered and this is None. A server that merges the apply instead — kmock's emulator, or
    anything in front of the API that turns it into a merge patch — keeps the key a rendering
    dropped (the role, after ``dedicated`` → ``colocated``), and then every later apply would
    write again for nothing, each resync. This patch removes those keys once, on any server."""
    out: dict = {}
    for path in _ATOMIC.get(desired["kind"], ()):
        removal = _dropped(_at(stored, path), _at(desired, path))
        if removal is None:
            continue
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = removal
    return out or None


def _dropped(have: Any, want: Any) -> dict | None:
    """The merge patch that nulls the keys of map ``have`` that ``want`` lacks, in maps both hold
    too (lists: a merge patch replaces them whole already); None when there are none."""
    if not isinstance(have, dict) or not isinstance(want, dict):
        return None
    out: dict = {key: None for key in sorted(set(have) - set(want))}
    for key in sorted(set(have) & set(want)):
        if (inner := _dropped(have[key], want[key])) is not None:
            out[key] = inner
    return out or None


def _without(fields: dict, path: tuple[str, ...]) -> dict:
    """``fields`` (a managedFields ``fieldsV1`` tree) without the leaf at ``path``, and without
    the maps that leaves empty (an empty map is a field owned whole)."""
    if not path:
        return fields
    head, rest = path[0], path[1:]
    if head not in fields:
        return fields
    out = dict(fields)
    if rest:
        inner = _without(fields[head], rest)
        if inner == {} or set(inner) == {"."}:
            del out[head]
        else:
            out[head] = inner
    else:
        del out[head]
    return out


def _union(a: dict, b: dict) -> dict:
    out = dict(a)
    for key, value in b.items():
        out[key] = _union(out[key], value) if isinstance(out.get(key), dict) and isinstance(value, dict) else value
    return out


def upgrade_managed_fields(entries: list[dict] | None) -> list[dict] | None:
    """``metadata.managedFields`` with the client-side manager's entry — the ``Update`` entry
    that owns the :data:`LAST_APPLIED` annotation — turned into :data:`FIELD_MANAGER`'s ``Apply``
    entry (merged into one already there), less that annotation; None when there is none.

    After this, fields only that manager set are the operator's applied fields, so a rendering
    that drops one removes it (they would otherwise stay, co-owned by the old ``Update`` entry).
    Source: client-go ``csaupgrade.UpgradeManagedFields``.
    """
    path = ("f:metadata", "f:annotations", f"f:{LAST_APPLIED}")
    legacy = [e for e in entries or [] if e.get("operation") == "Update" and not e.get("subresource")
              and path[2] in ((e.get("fieldsV1") or {}).get("f:metadata", {}).get("f:annotations") or {})]
    if not legacy:
        return None
    fields: dict = {}
    for entry in legacy:
        fields = _union(fields, _without(entry.get("fieldsV1") or {}, path))
    kept, applied = [], None
    for entry in entries or []:
        if entry in legacy:
            continue
        if entry.get("manager") == FIELD_MANAGER and entry.get("operation") == "Apply":
            applied = entry
            continue
        kept.append(entry)
    merged = {**(applied or legacy[0]), "manager": FIELD_MANAGER, "operation": "Apply", "fieldsType": "FieldsV1",
              "fieldsV1": _union((applied or {}).get("fieldsV1") or {}, fields)}
    return [merged, *kept]


def _stamped(obj: dict) -> dict:
    meta = obj["metadata"]
    return {**obj, "metadata": {**meta, "annotations": {**meta.get("annotations", {}), RENDERED: digest(obj)}}}


def rendered_as(live: dict | None, obj: dict) -> bool:
    """Whether ``live`` (an API dict) was last applied from the rendering ``obj`` (its
    :data:`RENDERED` digest), whatever was changed in it since."""
    annotations = ((live or {}).get("metadata") or {}).get("annotations") or {}
    return annotations.get(RENDERED) == digest(obj)


def _recreate(kind: str, current: dict, desired: dict) -> bool:
    """Whether ``current`` must be deleted before ``desired`` can be applied: a Service turning
    headless (``clusterIP: None``) cannot change its ``clusterIP`` in place.

    On a real API server ``spec.clusterIP`` is immutable once allocated, so a Service holding an IP
    is deleted (on the condition that it is still that object) and created headless. kmock
    allocates no IP (``clusterIP`` stays unset), so there the apply sets ``None`` in place: the
    delete-and-create path is shown by ``tests/operator/test_ssa.py`` (an allocated IP, played)
    and by ``tests/operator/test_cluster_e2e.py`` on a real server."""
    want = (desired.get("spec") or {}).get("clusterIP")
    have = (current.get("spec") or {}).get("clusterIP")
    return kind == "Service" and want == "None" and have not in (None, "None")


def apply(obj: dict, live: dict | None = None) -> str:
    """Server-side apply ``obj`` as :data:`FIELD_MANAGER`, forced; ``created`` | ``updated`` |
    ``unchanged``.

    What it relies on from the server: that the apply replaces atomic maps whole (a key a new
    rendering drops goes) and answers with the object as stored. Where the answer still holds a
    dropped key (a server that merged the apply: kmock), a merge patch removes it at once
    (:func:`leftovers`), so a pool whose rendering dropped a key converges either way: the next
    resync finds every child as rendered and writes nothing.

    ``live`` is the object as the caller last saw it (e.g. from a watch of the pool's
    children); without it (or when the caller saw none, which may be an object someone else made)
    it is read first. An ``obj`` with a controller owner reference is only applied where the
    object in the cluster has that same controller: a same-named object someone else made is
    never touched.

    Raises:
        kube.Transient: the API failed in a way worth retrying.
        Conflict: an object with this name exists and is not controlled by ``obj``'s owner.
        kube.Refused: a permanent refusal (e.g. 403, 422, or a body the API rejects).
    """
    kind, meta = obj["kind"], obj["metadata"]
    _read, create, patch, remove = kube.apis(kind)
    name, namespace = meta["name"], meta["namespace"]
    desired = _stamped(obj)
    current = live if live is not None else kube.read(kind, name, namespace)
    try:
        outcome = "created"
        if current is not None:
            owner, found = kube.controller_uid(obj), kube.controller_uid(current)
            if owner is not None and (found is None or found[1] != owner[1]):
                held = f"controlled by {found[0]}" if found else "with no controller"
                raise Conflict(f"{kind} {name} exists {held}, not by this pool: left alone "
                               f"(rename or delete it, and the pool creates its own)")
            current_meta = current.get("metadata") or {}
            annotations = current_meta.get("annotations") or {}
            if LAST_APPLIED in annotations:
                _migrate(kind, current, patch)
            elif annotations.get(RENDERED) == desired["metadata"]["annotations"][RENDERED] and _holds(current, desired):
                return "unchanged"  # rendered the same, and nobody changed what we set: no write
            if _recreate(kind, current, desired):
                uid = current_meta.get("uid")
                try:
                    remove(name, namespace, body=kubernetes.client.V1DeleteOptions(
                        preconditions=kubernetes.client.V1Preconditions(uid=uid) if uid else None))
                except ApiException as exc:
                    if exc.status != 404:  # gone already: created below
                        raise
            else:
                outcome = "updated"
        try:
            stored = patch(name, namespace, desired, field_manager=FIELD_MANAGER, force=True,
                           _content_type=APPLY_PATCH)
        except ApiException as exc:
            if exc.status != 404 or outcome != "created":
                raise
            create(namespace, desired, field_manager=FIELD_MANAGER)  # a server that cannot create on apply (kmock)
            return outcome
        if (stored is not None and desired["kind"] in _ATOMIC  # only atomic fields can keep leftovers
                and (removal := leftovers(kube.api_client().sanitize_for_serialization(stored), desired))):
            patch(name, namespace, removal, field_manager=FIELD_MANAGER, _content_type=kube.MERGE_PATCH)
        return outcome
    except Conflict:
        raise
    except Exception as exc:
        raise kube.failure(kind, name, exc) from exc


def _migrate(kind: str, current: dict, patch) -> None:
    """Hand an object an older operator applied client-side over to server-side apply: drop its
    :data:`LAST_APPLIED` annotation and give the fields it recorded to :data:`FIELD_MANAGER`, on
    the condition that the object is still the version read."""
    meta = current["metadata"]
    body: dict[str, Any] = {"metadata": {"annotations": {LAST_APPLIED: None}}}
    upgraded = upgrade_managed_fields(meta.get("managedFields"))
    if upgraded is not None:
        body["metadata"]["managedFields"] = copy.deepcopy(upgraded)
    if meta.get("resourceVersion"):
        body["metadata"]["resourceVersion"] = meta["resourceVersion"]
    patch(meta["name"], meta["namespace"], body, _content_type=kube.MERGE_PATCH)


def delete(kind: str, name: str, namespace: str, owner_uid: str | None = None, live: dict | None = None) -> bool:
    """Delete an object if it exists — with ``owner_uid``, only if that owner controls it (read
    first, unless the caller passes what it saw as ``live``; then deleted on the condition that
    it is still that very object); True if something was deleted.

    Raises:
        kube.Transient, kube.Refused: as :func:`apply`.
    """
    _read, _create, _patch, remove = kube.apis(kind)
    try:
        if owner_uid is None:
            remove(name, namespace)
            return True
        current = live if live is not None else kube.read(kind, name, namespace)
        found = kube.controller_uid(current)
        if current is None or found is None or found[1] != owner_uid:
            return False  # gone, or someone else's: left alone
        uid = (current.get("metadata") or {}).get("uid")
        remove(name, namespace, body=kubernetes.client.V1DeleteOptions(
            preconditions=kubernetes.client.V1Preconditions(uid=uid) if uid else None))
        return True
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise kube.failure(kind, name, exc) from exc
    except (kube.Transient, kube.Refused):
        raise
    except Exception as exc:
        raise kube.failure(kind, name, exc) from exc
