"""How a streamed OpenAI response ends when its request fails after the first event."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx2
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Route

from pdserve.errors import UnavailableError
from services.router.http.app import SSEResponse


async def test_an_error_after_the_first_event_is_an_error_event_then_done():
    """The status is sent with the first event, so a later failure is an `error` event; the stream still ends with
    `[DONE]`, as vLLM's does, so a reader waiting for it does not take the stream for cut off."""

    async def events() -> AsyncIterator[bytes]:
        yield b'data: {"choices": []}\n\n'
        raise UnavailableError("the decode worker was lost")

    async def stream(request: Request) -> SSEResponse:
        return SSEResponse(events(), "max_tokens")

    app = Starlette(routes=[Route("/stream", stream)])
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://router") as http:
        response = await http.get("/stream")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    first, error, done = response.text.split("\n\n")[:3]
    assert first == 'data: {"choices": []}' and done == "data: [DONE]"
    assert json.loads(error.removeprefix("data: "))["error"]["type"] == "service_unavailable_error"
