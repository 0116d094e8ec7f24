"""The typed errors of the shared request path as OpenAI-shaped HTTP errors, the HTTP counterpart of
pdserve.rpc.errors: {"error": {"message", "type", "param", "code"}} with the status a client's SDK maps to
its own exception (openai.BadRequestError, RateLimitError, ...)."""

from __future__ import annotations

import asyncio
import re

from starlette.responses import JSONResponse

from pdserve.errors import (
    InternalError,
    InvalidRequestError,
    MissingKeyError,
    OverloadedError,
    PermissionDeniedError,
    RouterStoppedError,
    UnauthenticatedError,
    UnavailableError,
)
from pdserve.rpc.errors import internal_error_message
from services.router.generation import ModelNotFoundError
from services.router.http.openai_request import openai_param


class BodyTooLargeError(InvalidRequestError):
    """A body past the router's `max_http_body_bytes`: a 413, and the connection closes, since the rest of the body
    is never read."""

    def __init__(self, limit: int) -> None:
        super().__init__("body", f"is larger than this router's limit of {limit} bytes")


class BodyTimeoutError(InvalidRequestError):
    """A body that did not all arrive within BODY_TIMEOUT_S of its head: a 408 (counted `invalid`, the caller's
    doing), and the connection closes (the rest is never read). Sent faster, it may be sent again."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__("body", f"did not arrive within {timeout_s:g} s of the request's head")


class UnsupportedBodyError(InvalidRequestError):
    """A body sent in a form the API does not take, compressed (Content-Encoding) or not JSON (Content-Type): a 415
    before any of it is read, and the connection closes. Sent as uncompressed JSON, it may be sent again."""

    def __init__(self, problem: str) -> None:
        super().__init__("body", problem)


# The shared path's fields whose refusals speak of the request's max_tokens: its own, and its choices' (n), which are
# refused as their prompt plus max_tokens over n. Any other field's text is about a parameter the caller named.
NAMES_MAX_TOKENS = frozenset({"sampling.max_tokens", "n"})

_STATUS: list[tuple[type[BaseException], int, str]] = [  # the first match wins: a subclass before its base
    (ModelNotFoundError, 404, "invalid_request_error"),  # OpenAI's type for a 404 too
    (BodyTooLargeError, 413, "invalid_request_error"),
    (UnsupportedBodyError, 415, "invalid_request_error"),
    (BodyTimeoutError, 408, "timeout_error"),
    (InvalidRequestError, 400, "invalid_request_error"),
    (UnauthenticatedError, 401, "invalid_request_error"),  # OpenAI's type for a missing or unknown key
    (PermissionDeniedError, 403, "permission_error"),
    (OverloadedError, 429, "rate_limit_error"),
    (UnavailableError, 503, "service_unavailable_error"),
    (RouterStoppedError, 503, "service_unavailable_error"),
    (TimeoutError, 504, "timeout_error"),
    (asyncio.TimeoutError, 504, "timeout_error"),
    (InternalError, 500, "internal_error"),  # a worker's bug: its text names the error id in that worker's log
]


def error_body(exc: BaseException, max_tokens_param: str = "max_tokens") -> tuple[int, dict, dict[str, str]]:
    """(status, body, headers) for `exc`; an error not of the shared path's kinds is a 500, logged."""
    status, kind = next(((s, k) for cls, s, k in _STATUS if isinstance(exc, cls)), (500, "internal_error"))
    param, code = None, None
    unexpected = status == 500 and not isinstance(exc, InternalError)
    message = internal_error_message(exc) if unexpected else str(exc) or type(exc).__name__
    headers: dict[str, str] = {}
    if isinstance(exc, InvalidRequestError):
        param = openai_param(exc.field, max_tokens_param)
        message = f"{param}: {message.split(': ', 1)[1]}" if ": " in message else message
        if exc.field in NAMES_MAX_TOKENS:  # its text names it as the shared path does, not as the caller sent it
            message = re.sub(r"\bmax_tokens\b", max_tokens_param, message)
        code = "model_not_found" if isinstance(exc, ModelNotFoundError) else None
        if isinstance(exc, (BodyTooLargeError, BodyTimeoutError, UnsupportedBodyError)):
            headers = {"connection": "close"}
    elif isinstance(exc, MissingKeyError):  # its text names gRPC's metadata; OpenAI's code is null
        message = "this cluster requires an API key: send the header `Authorization: Bearer KEY`"
    elif isinstance(exc, UnauthenticatedError):
        code = "invalid_api_key"
    elif isinstance(exc, PermissionDeniedError):
        param = openai_param(exc.field, max_tokens_param)
    elif isinstance(exc, OverloadedError):
        ms = exc.retry_after_ms
        headers = {"retry-after": str(max(1, -(-ms // 1000))), "retry-after-ms": str(ms)}
        code = "rate_limit_exceeded"
    elif status == 500:  # OpenAI's SDK retries a 5xx twice unless told not to: a bug fails the same way again
        headers = {"x-should-retry": "false"}
    body = {"error": {"message": _encodable(message), "type": kind, "param": param and _encodable(param), "code": code}}
    return status, body, headers


def _encodable(text: str) -> str:
    """Client text an error echoes (a parameter's name) may hold a lone surrogate, which UTF-8 cannot carry."""
    return text.encode("utf-8", "backslashreplace").decode()


def error_response(exc: BaseException, max_tokens_param: str = "max_tokens") -> JSONResponse:
    status, body, headers = error_body(exc, max_tokens_param)
    return JSONResponse(body, status, headers)
