"""Validate a ServingPool as the Kubernetes API server would, without a cluster.

``cadenza up pool.yaml`` and the operator accept and refuse the same pools as the API server: both
read the CRD shipped next to this module and apply it in the API server's order: (1) prune nulls of
non-nullable fields, then default (structural-schema defaulting); (2) validate against the OpenAPI
v3 schema (``jsonschema`` with Draft 4 semantics, as OpenAPI 3.0; int-or-string and nullable
translated) and refuse undeclared fields (kubectl's default strict field validation); (3) evaluate
each ``x-kubernetes-validations`` CEL rule with ``self`` bound to its node, unless (2) found a type,
required, enum or size violation: then the API server skips the rules and says so (``hasBlockingErr``).

Sources: https://kubernetes.io/docs/tasks/extend-kubernetes/custom-resources/custom-resource-definitions/
(structural schema, defaulting, validation rules); https://kubernetes.io/docs/reference/using-api/cel/
"""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import yaml

from cadenza.pool.live_knobs import knob_bounds

API_VERSION = "serving.cadenza.dev/v1alpha1"
KIND = "ServingPool"
CRD_FILE = "servingpools.crd.yaml"
CRD_VERSION = "v1alpha1"
MAX_NAME_LENGTH = 45  # so that `<name>-interactive`, `<name>-gateway`, ... stay valid DNS labels (<= 63)
_DNS_1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_DNS_1123_LABEL = re.compile(r"(?=.{1,63}\Z)[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# jsonschema failures that are TypeInvalid/Required/NotSupported/TooLong/TooMany errors in the API server
_BLOCKING = {"type", "required", "enum", "maxLength", "maxItems", "maxProperties"}
_RULES_SKIPPED = ("<root>: some validation rules were not checked because the object was invalid; "
                  "correct the existing errors to complete validation")


class PoolValidationError(ValueError):
    """A ServingPool the API server would refuse; ``problems`` holds one ``"path: message"`` line each."""

    def __init__(self, problems: list[str], header: str | None = None) -> None:
        self.problems = list(problems)
        super().__init__(f"{header}:\n  " + "\n  ".join(problems) if header else "\n".join(problems))


def load_crd_schema() -> dict:
    """The ``openAPIV3Schema`` of ServingPool ``v1alpha1``, a fresh copy; raises ``OSError`` if unreadable."""
    return json.loads(_crd_schema_json())


@functools.cache
def _crd_schema_json() -> str:
    crd = yaml.safe_load(Path(__file__).with_name(CRD_FILE).read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == CRD_VERSION)
    return json.dumps(version["schema"]["openAPIV3Schema"], sort_keys=True)


def apply_defaults(obj: dict, schema: dict) -> dict:
    """Structural-schema defaulting, as the API server does it: a new deep copy of ``obj`` in which,
    for every object node present in the data, ``null`` values of non-nullable properties are
    pruned, each missing property with a ``default`` gets a copy of it, and defaulting recurses into
    the children (just-defaulted values too) via ``properties``, ``additionalProperties``, ``items``.
    """
    out = copy.deepcopy(obj)
    _default(out, schema)
    return out


def _default(value: Any, schema: dict) -> None:
    if isinstance(value, dict):
        for key, prop in schema.get("properties", {}).items():
            if key in value and value[key] is None and not prop.get("nullable"):
                del value[key]  # pruned, then defaulted below if it has a default
            if key not in value and "default" in prop:
                value[key] = copy.deepcopy(prop["default"])
    for _key, child, sub in _children(value, schema):
        _default(child, sub)


def _children(value: Any, schema: dict) -> Iterator[tuple[str | int, Any, dict]]:
    """``(key or index, child, its schema)`` for the data under a node that the schema describes."""
    if isinstance(value, dict):
        props, extra = schema.get("properties", {}), schema.get("additionalProperties")
        for key, child in value.items():
            if isinstance(sub := props[key] if key in props else extra, dict):
                yield key, child, sub
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, child in enumerate(value):
            yield i, child, schema["items"]


def validate_pool(obj: dict, schema: dict | None = None) -> dict:
    """Check a ServingPool (a parsed YAML document or a watched object) and return it defaulted.

    ``schema`` replaces the shipped CRD's ``openAPIV3Schema`` (tests). Returns a defaulted deep
    copy of ``obj``. Raises ``PoolValidationError`` listing every problem, one ``path: message`` each.
    """
    if not isinstance(obj, dict):
        raise PoolValidationError([f"<root>: Invalid value: must be an object, got {type(obj).__name__}"])
    schema = load_crd_schema() if schema is None else schema
    pool = apply_defaults(obj, schema)
    problems = [f"{key}: Unsupported value: {json.dumps(pool.get(key))}: must be {want}"
                for key, want in (("apiVersion", API_VERSION), ("kind", KIND)) if pool.get(key) != want]
    problems += _metadata_problems(pool.get("metadata") if isinstance(pool.get("metadata"), dict) else {})
    schema_problems = list(_schema_problems(pool, schema))
    problems += [f"{path}: {message}" for path, message, _ in schema_problems]
    blocking = any(is_blocking for *_, is_blocking in schema_problems)
    problems += _node_problems(pool, schema, rules=not blocking) + ([_RULES_SKIPPED] if blocking else [])
    if not blocking and isinstance(pool.get("spec"), dict):
        try:  # what no schema rule can see: a bound's defaults come from spec.engine
            knob_bounds(pool["spec"])
        except ValueError as exc:
            problems.append(f"{exc}")
    if problems:
        raise PoolValidationError(list(dict.fromkeys(problems)))
    return pool


def _metadata_problems(meta: dict) -> list[str]:
    name, namespace, problems = meta.get("name"), meta.get("namespace"), []
    if not name:
        problems.append("metadata.name: Required value")
    elif not (isinstance(name, str) and _DNS_1035_LABEL.fullmatch(name) and len(name) <= MAX_NAME_LENGTH):
        problems.append(f"metadata.name: Invalid value: {json.dumps(name)}: must be a DNS-1035 label of at most "
                        f"{MAX_NAME_LENGTH} characters (a-z, 0-9, '-'; a letter first, a letter or digit last)")
    if namespace is not None and not (isinstance(namespace, str) and _DNS_1123_LABEL.fullmatch(namespace)):
        problems.append(f"metadata.namespace: Invalid value: {json.dumps(namespace)}: must be a DNS-1123 label")
    return problems


def _jsonschema_of(schema: dict) -> dict:
    """The OpenAPI schema in jsonschema's terms: int-or-string and nullable become type lists."""
    out = json.loads(json.dumps(schema))
    stack = [out]
    while stack:
        node = stack.pop()
        if node.get("x-kubernetes-int-or-string"):
            node.pop("anyOf", None)
            node["type"] = ["integer", "string"]
        if node.get("nullable") and isinstance(node.get("type"), str):
            node["type"] = [node["type"], "null"]
        stack += [*node.get("properties", {}).values(), *node.get("anyOf", ()), *node.get("allOf", ())]
        stack += [node[k] for k in ("additionalProperties", "items", "not") if isinstance(node.get(k), dict)]
    return out


@functools.cache
def _validator_for(schema_json: str) -> jsonschema.Draft4Validator:
    return jsonschema.Draft4Validator(_jsonschema_of(json.loads(schema_json)))


def _schema_problems(pool: dict, schema: dict) -> Iterator[tuple[str, str, bool]]:
    """``(path, message, blocks CEL)`` per OpenAPI violation, worded like the API server's."""
    validator = _validator_for(json.dumps(schema, sort_keys=True))
    for error in sorted(validator.iter_errors(pool), key=lambda e: [str(p) for p in e.absolute_path]):
        parts, kind, expected = list(error.absolute_path), error.validator, error.validator_value
        value = json.dumps(error.instance, default=str)
        if kind == "required":  # jsonschema says it once per missing name; validate_pool drops repeats
            for name in [n for n in expected if n not in error.instance]:
                yield functools.reduce(_join, [*parts, name], ""), "Required value", True
            continue
        if kind == "enum":
            message = f"Unsupported value: {value}: supported values: {', '.join(map(json.dumps, expected))}"
        elif kind == "type":
            types = " or ".join(expected) if isinstance(expected, list) else expected
            message = f"Invalid value: {value}: must be of type {types}"
        elif kind in ("minimum", "maximum"):
            relation = "greater" if kind == "minimum" else "less"
            message = f"Invalid value: {value}: should be {relation} than or equal to {expected}"
        elif kind in ("maxProperties", "maxItems"):  # the API server's field.TooMany, without the value
            message = f"Too many: {len(error.instance)}: must have at most {expected} items"
        else:
            message = f"Invalid value: {error.message}"
        yield functools.reduce(_join, parts, "") or "<root>", message, kind in _BLOCKING


def _join(path: str, key: str | int) -> str:
    """``spec.engine.chunkSize``; list indices and map keys that are not plain words in brackets."""
    if isinstance(key, str) and _IDENTIFIER.fullmatch(key):
        return f"{path}.{key}" if path else key
    return f"{path}[{key}]"


def _node_problems(value: Any, schema: dict, rules: bool, path: str = "") -> list[str]:
    """Undeclared fields, and (if ``rules``) failing CEL rules, at this node and every node below it."""
    problems = []
    if (isinstance(value, dict) and "properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        problems += [f"{_join(path, k)}: field not declared in schema" for k in value if k not in schema["properties"]]
    for rule in schema.get("x-kubernetes-validations", ()) if rules else ():
        where = (path + rule.get("fieldPath", "")).lstrip(".") or "<root>"
        try:
            result = _program(rule["rule"]).evaluate({"self": celpy.json_to_cel(_to_cel(value, schema))})
            if not isinstance(result, celpy.celtypes.BoolType):  # CELEvalError values land here too
                raise result if isinstance(result, Exception) else TypeError(f"not a boolean: {result!r}")
        except Exception as exc:  # noqa: BLE001 - a rule that cannot run is reported, never ignored
            detail = exc.args[0] if isinstance(exc, celpy.CELEvalError) and exc.args else exc
            problems.append(f"{where}: rule {rule['rule']!r} could not be evaluated: {detail}")
            continue
        if not result:
            problems.append(f"{where}: {rule.get('message') or 'failed rule: ' + rule['rule']}")
    for key, child, sub in _children(value, schema):
        problems += _node_problems(child, sub, rules, _join(path, key))
    return problems


@functools.cache
def _program(rule: str) -> celpy.Runner:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def _to_cel(value: Any, schema: dict) -> Any:
    """JSON data typed as the schema says (a ``number`` is a CEL double even when written ``1``)."""
    if schema.get("type") == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    out = copy.copy(value)
    for key, child, sub in _children(value, schema):
        out[key] = _to_cel(child, sub)
    return out


def load_pools(path: str | Path) -> list[dict]:
    """The validated, defaulted ServingPools of a (multi-document) YAML file; other kinds are ignored
    (:func:`document_kinds` lists them, for a message when no pool is found).

    Raises ``OSError`` if the file cannot be read, ``PoolValidationError`` if it does not parse or its
    ServingPools are invalid (each problem names its document: 1-based number, pool name) or clash.
    """
    path = Path(path)
    try:
        documents = list(yaml.safe_load_all(path.read_text(encoding="utf-8")))
    except UnicodeDecodeError as exc:
        raise PoolValidationError([f"<root>: not UTF-8 text ({exc.reason} at byte {exc.start})"],
                                  header=str(path)) from None
    except yaml.YAMLError as exc:
        raise PoolValidationError([f"<root>: not valid YAML: {exc}"], header=str(path)) from None
    pools, problems, seen = [], [], set()
    for number, doc in enumerate(documents, start=1):
        if not isinstance(doc, dict) or doc.get("kind") != KIND:
            continue
        meta = doc["metadata"] if isinstance(doc.get("metadata"), dict) else {}
        label = f"document {number} ({KIND} {meta.get('name') or '<unnamed>'})"
        try:
            pool = validate_pool(doc)
        except PoolValidationError as exc:
            problems += [f"{label}: {p}" for p in exc.problems]
            continue
        if (key := (pool["metadata"].get("namespace", "default"), pool["metadata"]["name"])) in seen:
            problems.append(f"{label}: metadata.name: Duplicate value: {json.dumps(key[1])} in namespace {key[0]}")
        seen.add(key)
        pools.append(pool)
    if problems:
        raise PoolValidationError(problems, header=f"{path}: invalid {KIND} documents")
    return pools


def document_kinds(path: str | Path) -> list[str]:
    """``apiVersion/kind`` of each document of a YAML file that :func:`load_pools` read (so it parses)."""
    kinds = []
    for doc in yaml.safe_load_all(Path(path).read_text(encoding="utf-8")):
        if isinstance(doc, dict):
            kinds.append(f"{doc.get('apiVersion', '?')}/{doc.get('kind', '?')}")
        elif doc is not None:
            kinds.append(type(doc).__name__)
    return kinds
