"""OpenAI-style error responses, and which status each pagedkv error gets.

Every failure a client can cause comes back as ``{"error": {"message", "type", "param",
"code"}}`` with the status OpenAI's clients map to their exception classes: 400
(``BadRequestError``), 401 (``AuthenticationError``), 404 (``NotFoundError``), 503 (the server is
overloaded or shutting down; OpenAI's clients retry it), 413 (the body is too large). Nothing a
request does can take the server down: unexpected exceptions become a 500 with the same body.

``code`` is always a string, as in OpenAI's API: a specific code where there is one
(``model_not_found``, ``invalid_api_key``, ``context_length_exceeded``, ``server_overloaded``,
the pagedkv error's class name, ...), else the HTTP status's name (``bad_request``,
``not_found``, ``request_entity_too_large``, ``internal_server_error``, ...). ``param`` names the
request field at fault, or is null.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from http import HTTPStatus

from fastapi.responses import JSONResponse

from pagedkv.errors import (
    EngineDeadError,
    InvalidArgumentError,
    KVTransferError,
    OverloadedError,
    PagedKVError,
    RequestFailedError,
    StructuredOutputError,
    UnknownRequestError,
)
from pagedkv.server.protocol import ErrorInfo, ErrorResponse

__all__ = ["APIError", "error_body", "error_response", "from_exception", "request_error"]

# OpenAI's error "type" per status.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error to answer with ``status`` and OpenAI's body (raised by the handlers)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def _status_name(status: int) -> str:
    """``"request_entity_too_large"`` for 413: the status's phrase in snake case."""
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:  # a status Python does not name
        return f"http_{status}"
    return phrase.lower().replace(" ", "_").replace("-", "_")


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> ErrorResponse:
    return ErrorResponse(
        error=ErrorInfo(
            message=message,
            type=_TYPES.get(status, _status_name(status)),
            param=param,
            code=code if code is not None else _status_name(status),
        )
    )


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None) -> JSONResponse:
    body = error_body(status, message, param=param, code=code)
    headers = {"Retry-After": "1"} if status == 503 else None
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def from_exception(exc: BaseException) -> APIError:
    """The API error for an exception raised while serving a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"the engine is not running: {exc}")
    if isinstance(exc, RequestFailedError):
        if isinstance(exc.__cause__, StructuredOutputError):  # its own constraint broke mid-way
            return APIError(400, str(exc), code=StructuredOutputError.__name__)
        return APIError(500, str(exc))
    if isinstance(exc, OverloadedError):  # a full shared queue: nothing started, retry
        return APIError(503, str(exc), code="server_overloaded")
    if isinstance(exc, UnknownRequestError):
        return APIError(404, str(exc))
    if isinstance(exc, KVTransferError):  # the KV producer (a peer) failed or cannot match
        return APIError(502, str(exc), code=type(exc).__name__)
    if isinstance(exc, (InvalidArgumentError, PagedKVError, ValueError, TypeError)):
        # ConfigError (sampling parameters), PromptTooLongError, InvalidTokenError, ...
        return APIError(400, str(exc), code=type(exc).__name__)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}")


_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def request_error(exc: BaseException, fields: Collection[str]) -> APIError:
    """:func:`from_exception` for an error raised on a request's values, with ``param`` set to
    the request field its message names first (of ``fields``): the engine's checks name the
    parameter they refuse (``"presence_penalty must be in [-2, 2], got 3"``,
    ``"logit_bias holds token id 99999, outside the vocabulary ..."``)."""
    err = from_exception(exc)
    if err.param is None and err.status == 400:
        err.param = next((w for w in _WORD.findall(err.message) if w in fields), None)
    return err
