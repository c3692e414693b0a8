"""The operator's start: where its credentials come from, kopf's settings, the shared API client,
and tracing.

- login: in a pod the service account, elsewhere ``$KUBECONFIG`` (:func:`credentials_problem`
  says before kopf starts why neither can be used: kopf would retry its login forever);
- settings: no finalizer (owner references garbage-collect the children), kopf's progress and
  diff-base kept in annotations under the API group, watches of the children label-selected
  (:mod:`.children`), Events at INFO unless ``CADENZA_OPERATOR_EVENTS=false``;
- tracing: a span per controller evaluation that acted, over OTLP when the standard ``OTEL_*``
  variables ask for it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import kopf
import kubernetes
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from cadenza.node.otel import make_resource, otlp_enabled
from cadenza.operator import kube, render
from cadenza.operator.children import CHILD_KINDS, MANAGED
from cadenza.operator.report import events_enabled

_SA_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"


@kopf.on.login()
def login(**kwargs: Any):
    """In a pod: the service account; elsewhere: ``$KUBECONFIG`` read now (the ``kubernetes``
    package reads it at import time, which may be before it was set)."""
    if os.path.exists(_SA_TOKEN):
        return kopf.login_with_service_account(**kwargs)
    return kopf.login_with_kubeconfig(**kwargs)


def credentials_problem() -> str | None:
    """Why the operator could not reach a cluster (no service account, no usable kubeconfig), or None.

    Checked before kopf starts, which would otherwise retry its login forever.
    """
    if os.path.exists(_SA_TOKEN):
        return None
    try:
        kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
    except (kubernetes.config.ConfigException, OSError, TypeError, ValueError) as exc:
        where = os.environ.get("KUBECONFIG") or "~/.kube/config"
        return (f"no cluster credentials: not in a pod with a service account, and the kubeconfig "
                f"({where}) cannot be used: {exc}")
    return None


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    if os.path.exists(_SA_TOKEN):
        kubernetes.config.load_incluster_config()
    else:
        kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
    kube.connect()  # one client, one connection pool, for every call from here on
    # No handler needs a finalizer (owner references garbage-collect the children); naming the
    # one earlier operators added lets kopf remove it from the pools that still carry it.
    settings.persistence.finalizer = f"{render.GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=render.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=render.GROUP)
    settings.watching.reconnect_backoff = 1.0
    for resource in CHILD_KINDS.values():  # the API server sends only the pools' children, not the cluster's
        settings.watching.label_selectors[resource] = ",".join(f"{k}={v}" for k, v in MANAGED.items())
    settings.posting.level = logging.INFO
    settings.posting.enabled = events_enabled()
    _tracing()


def _tracing() -> None:
    """A span per controller evaluation that acted, exported over OTLP when the standard ``OTEL_*``
    variables ask for it (service ``cadenza-operator`` unless ``OTEL_SERVICE_NAME`` says otherwise)."""
    if not otlp_enabled("traces") or isinstance(trace.get_tracer_provider(), TracerProvider):
        return
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    resource = make_resource().merge(Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME",
                                                                                     "cadenza-operator")}))
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
