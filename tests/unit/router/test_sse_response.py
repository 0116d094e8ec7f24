"""How a streamed OpenAI response ends when its request fails before or after its start, and what it sends while it
is silent, its wait for the first event included."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx2
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Route

from pdserve.errors import OverloadedError, UnavailableError
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
        await asyncio.sleep(0.35)  # waiting for its first token: the stream starts after 0.1 s, with a comment
        yield b"data: 1\n\n"
        await asyncio.sleep(0.35)
        yield b"data: 2\n\n"
        yield b"data: [DONE]\n\n"

    before = asyncio.all_tasks()
    parts = (await respond(events(), 0.1)).split("\n\n")
    first = parts.index("data: 1")
    assert first >= 2 and set(parts[:first]) == {KEPT}, parts  # 0.35 s at 0.1 s: ~3
    assert parts[-3:] == ["data: 2", "data: [DONE]", ""], parts
    assert len(parts[first + 1 : -3]) >= 2 and set(parts[first + 1 : -3]) == {KEPT}, parts
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


async def shed_after(wait_s: float) -> AsyncIterator[bytes]:
    await asyncio.sleep(wait_s)
    raise OverloadedError("no decode worker has room", retry_after_ms=2000)
    yield b""  # unreachable: makes this a generator


async def test_a_refusal_before_the_interval_has_its_own_status_and_after_it_is_an_error_event():
    """Within `keepalive_s` the status waits for the first event, so a shed request gets 429 and its retry hint, as
    a non-streaming one does. Past it the stream has started (a proxy would have cut a connection silent for its
    idle timeout), and the refusal ends it: an error event, then [DONE]."""

    async def stream(request: Request) -> SSEResponse:
        wait_s = float(request.query_params["wait_s"])
        return SSEResponse(shed_after(wait_s), "max_tokens", 0.3)

    app = Starlette(routes=[Route("/stream", stream)])
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://router") as http:
        early = await http.get("/stream", params={"wait_s": 0.05})
        late = await http.get("/stream", params={"wait_s": 0.5})
    assert early.status_code == 429 and early.headers["retry-after-ms"] == "2000"
    assert early.json()["error"]["code"] == "rate_limit_exceeded"
    assert late.status_code == 200, late.text
    parts = late.text.split("\n\n")
    assert parts[0] == KEPT and parts[-2:] == ["data: [DONE]", ""], parts
    assert json.loads(parts[-3].removeprefix("data: "))["error"]["code"] == "rate_limit_exceeded"
