"""The engine server's application keys: what :mod:`.app` puts in the application and the
handlers (:mod:`.openai_api`, :mod:`.admin`) read, typed (aiohttp ``web.AppKey``)."""

from __future__ import annotations

from aiohttp import web

from cadenza.node.frontend.client import EngineClient
from cadenza.node.frontend.telemetry import Telemetry

ENGINE = web.AppKey("engine", EngineClient)  # the engine core's client (requests, stats, reconfigure)
TELEMETRY = web.AppKey("telemetry", Telemetry)  # metrics and spans (OTLP and /metrics)
MODEL_NAME = web.AppKey("model_name", str)  # the model's name in the API (``model`` of a call)
DEFAULT_CLASS = web.AppKey("default_class", str)  # the traffic class of a call without x-cadenza-class
STARTED = web.AppKey("started", int)  # when the server was created (Unix seconds): the model card's ``created``
TOOL_PARSER = web.AppKey("tool_parser", str)  # the format of the model's tool calls, or "auto" (from its template)
