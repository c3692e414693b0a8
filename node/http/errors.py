"""OpenAI-format errors and the middleware that turns every failure into one.

Body: ``{"error": {"message", "type", "param", "code"}}`` as in the OpenAI API reference. A bad
request never takes the server down: validation errors are 4xx, anything unexpected is a logged
500, and the engine goes on serving everyone else.
"""

from __future__ import annotations

import logging

from aiohttp import web

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error to return to the client.

    Args:
        status: HTTP status.
        message: what went wrong, for a person.
        param: the request field at fault, if any.
        code: machine-readable code (e.g. ``model_not_found``, ``context_length_exceeded``).
        headers: extra response headers (e.g. ``Retry-After``).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def response(self) -> web.Response:
        return error_response(self.status, self.message, param=self.param, code=self.code, headers=self.headers)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status: int, message: str, *, param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None
) -> web.Response:
    return web.json_response(error_body(status, message, param, code), status=status, headers=headers)


@web.middleware
async def error_middleware(request: web.Request, handler):
    """Every error leaves as OpenAI JSON: our own, aiohttp's (404, 405, 413), and crashes (500)."""
    try:
        return await handler(request)
    except APIError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason
        if exc.status == 404:
            message = f"no route for {request.method} {request.path}"
        return error_response(exc.status, message, headers={k: v for k, v in exc.headers.items() if k.lower() == "allow"})
    except ConnectionResetError:
        raise  # the client is gone (or was dropped for not reading): there is nobody to answer
    except Exception:
        logger.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, "internal server error; the request was not completed")
