"""Every HTTP response names a request in X-Request-Id, as OpenAI's do (its SDK reports the header as `request_id`):
the caller's id where it sent one that may be echoed, else a new one. Generation sets the header itself, to the id its
answer and its log line name; this gives one to every other response: the model routes, /health, a path or method the
API lacks, their 401s, a preflight, the 500 of a bug (Starlette's error middleware)."""

from __future__ import annotations

import uuid

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.protocol.request_checks import non_printable_ascii
from pdserve.rpc.metadata import REQUEST_ID_KEY
from services.router.http.openai_prompts import MAX_CHOICES

HEADER = REQUEST_ID_KEY.encode()


def generated_request_id(limit: int) -> str:
    """A request sent without X-Request-Id gets one here, as its response's `id` and X-Request-Id header and the
    `request_id` of the router's log lines alike (the `id` was a uuid of its own, which no log line named), short
    enough for `limit` with a choice's `-<index>` (at most MAX_CHOICES choices)."""
    return uuid.uuid4().hex[: max(1, limit - len(f"-{MAX_CHOICES - 1}"))]


def echoed_request_id(given: str, limit: int) -> str:
    """The caller's id, where it is one a header may carry back (at most `limit` characters, printable ASCII); else
    a new one: an id refused for its length or characters is not echoed."""
    if given and len(given) <= limit and non_printable_ascii(given) is None:
        return given
    return generated_request_id(limit)


class RequestIdHeader:
    def __init__(self, app: ASGIApp, limit: int) -> None:
        """`limit`: the router's `max_request_id_chars`."""
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def named(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                if all(key.lower() != HEADER for key, _ in headers):
                    given = Headers(scope=scope).get(REQUEST_ID_KEY, "")
                    headers.append((HEADER, echoed_request_id(given, self.limit).encode()))
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, named)
