"""How a streamed OpenAI response ends when its request fails after the first event, and what it sends while it is
silent."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx2
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Route

from pdserve.errors import UnavailableError
from services.router.http.app import SSEResponse
from services.router.http.keepalive import KEEPALIVE_EVENT


async def test_an_error_after_the_first_event_is_an_error_event_then_done():
    """The status is sent with the first event, so a later failure is an `error` event; the stream still ends with
    `[DONE]`, as vLLM's does, so a reader waiting for it does not take the stream for cut off."""

    async def events() -> AsyncIterator[bytes]:
        yield b'data: {"choices": []}\n\n'
        raise UnavailableError("the decode worker was lost")

    async def stream(request: Request) -> SSEResponse:
        return SSEResponse(events(), "max_tokens", 15.0)

    app = Starlette(routes=[Route("/stream", stream)])
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://router") as http:
        response = await http.get("/stream")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    first, error, done = response.text.split("\n\n")[:3]
    assert first == 'data: {"choices": []}' and done == "data: [DONE]"
    assert json.loads(error.removeprefix("data: "))["error"]["type"] == "service_unavailable_error"


async def respond(events: AsyncIterator[bytes], keepalive_s: float) -> str:
    async def stream(request: Request) -> SSEResponse:
        return SSEResponse(events, "max_tokens", keepalive_s)

    app = Starlette(routes=[Route("/stream", stream)])
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://router") as http:
        response = await http.get("/stream")
    assert response.status_code == 200
    return response.text


KEPT = KEEPALIVE_EVENT.decode().removesuffix("\n\n")


async def test_a_silent_stream_sends_a_comment_each_interval_and_none_once_it_ended():
    """A stream its decode worker preempted is silent for as long as it waits for room: a proxy in front (nginx, a
    cloud load balancer; 60 s idle by default) would cut it. Comments, which SSE readers skip, keep it alive."""

    async def events() -> AsyncIterator[bytes]:
        await asyncio.sleep(0.35)  # before the first event the status is not sent: nothing can be
        yield b"data: 1\n\n"
        await asyncio.sleep(0.35)
        yield b"data: 2\n\n"
        yield b"data: [DONE]\n\n"

    before = asyncio.all_tasks()
    parts = (await respond(events(), 0.1)).split("\n\n")
    assert parts[0] == "data: 1" and parts[-3:] == ["data: 2", "data: [DONE]", ""], parts
    assert len(parts[1:-3]) >= 2 and set(parts[1:-3]) == {KEPT}, parts  # 0.35 s silent at 0.1 s: ~3
    assert asyncio.all_tasks() == before  # the beat ended with the stream


async def test_a_stream_that_never_falls_silent_for_the_interval_sends_no_comment():
    async def events() -> AsyncIterator[bytes]:
        for i in range(8):
            await asyncio.sleep(0.05)
            yield f"data: {i}\n\n".encode()

    assert KEPT not in await respond(events(), 0.2)


async def test_a_failure_after_a_silence_is_still_the_error_event_then_done_and_nothing_after():
    async def events() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        await asyncio.sleep(0.25)
        raise UnavailableError("the decode worker was lost")

    parts = (await respond(events(), 0.1)).split("\n\n")
    assert parts[0] == "data: 1" and set(parts[1:-3]) == {KEPT} and parts[1:-3], parts
    assert json.loads(parts[-3].removeprefix("data: "))["error"]["type"] == "service_unavailable_error"
    assert parts[-2:] == ["data: [DONE]", ""], parts
