"""What every HTTP process of a pool agrees on: header names and body limits, defined once.

The engine server (:mod:`cadenza.node.server`), the gateway (:mod:`cadenza.gateway`) and the
trace-replay client (:mod:`cadenza.loadgen`) all read these; a pool whose gateway accepted a
body its engines refuse, or that spelled a header two ways, would fail in ways no single process
could explain.
"""

from __future__ import annotations

CLASS_HEADER = "x-cadenza-class"  # the request's traffic class: interactive | batch | background
TENANT_HEADER = "x-cadenza-tenant"  # who sent it (fair queuing and quotas within a class)
TRACEPARENT_HEADER = "traceparent"  # W3C trace context; the request's span is its child
REQUEST_ID_HEADER = "x-request-id"  # the completion's id, on every response

# OpenAI request bodies are small; 32 MiB leaves room for long prompts sent as token ids.
MAX_BODY_BYTES = 32 * 2**20

# Disaggregated serving (:mod:`cadenza.node.server.kv_headers`): a prefill call asks the replica to
# hold the prompt's KV and answers where it is; a decode call names where to pull it from.
KV_PUBLISH_HEADER = "x-cadenza-kv-publish"
KV_SOURCE_HEADER = "x-cadenza-kv-source"
# On a replica's answers: the coefficients of its selective disaggregation rule
# (:meth:`cadenza.node.kv_transfer.threshold.Rule.header`; absent: its cost model is not calibrated
# yet). The gateway reads it, solves it with its prefill replicas' queues, and drops it.
DISAGG_RULE_HEADER = "x-cadenza-disagg-rule"
