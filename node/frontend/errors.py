"""The front end's errors for what happens inside (or to) the engine core, and how a failure the
core reports becomes the exception its request's stream raises."""

from __future__ import annotations

from cadenza.node.core.admission import AdmissionError
from cadenza.node.core.messages import RequestFailure

CONFIG_ERRORS = ("ConfigError", "ValueError", "ModelConfigError", "PolicyError", "FileNotFoundError")


class EngineDeadError(RuntimeError):
    """The engine core is not running (failed to load, died, or shut down)."""


class EngineCommandError(RuntimeError):
    """A command failed inside the engine for a reason that is not the caller's input (a bug); the
    engine goes on stepping. The server answers 500 with the message."""


class EngineLoadError(ValueError):
    """The engine refused its configuration or model folder (the message says which field)."""


class RequestInvalidError(ValueError):
    """The engine found the request unservable while it ran (its grammar failed): a 400 naming
    ``param``."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


ADD_FAILURES = ("admission", "invalid")  # refused on arrival: none of the call's choices was queued


def failure_error(failure: RequestFailure) -> BaseException:
    """The exception a request's stream raises for a failure the core reported."""
    if failure.kind == "admission":
        return AdmissionError(failure.status, failure.message, failure.reason, failure.retry_after)
    if failure.kind == "invalid":
        return ValueError(failure.message)
    if failure.kind == "grammar":
        return RequestInvalidError(failure.message, failure.reason or None)
    if failure.kind == "internal":
        return EngineCommandError(failure.message)
    return RuntimeError(failure.message)
