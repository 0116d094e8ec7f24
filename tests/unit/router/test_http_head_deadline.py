"""The HTTP listener closes a connection whose request head (line and headers) is not in within its deadline, as
a client sending it a byte at a time (slowloris) would hold it for ever otherwise; whole requests, one after
another on a keep-alive connection, are served as before. Real uvicorn on loopback."""

from __future__ import annotations

import asyncio

import httpx2
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from services.router.http.server import HttpServer
from tests.unit.router.slow_client import dribbled

DEADLINE_S = 0.5


async def ok(request: Request) -> Response:
    return PlainTextResponse("ok")


async def serving() -> HttpServer:
    server = HttpServer(Starlette(routes=[Route("/", ok)]), "127.0.0.1", 0, head_timeout_s=DEADLINE_S)
    await server.start()
    return server


async def test_a_head_sent_a_byte_at_a_time_is_cut_at_its_deadline():
    server = await serving()
    try:
        # each byte would cancel uvicorn's own (keep-alive) timer
        answer, closed_after = await dribbled(server.port, b"GET / HTTP/1.1\r\nHost: router\r\n", b"X", 5 * DEADLINE_S)
    finally:
        await server.stop()
    assert answer == b"" and DEADLINE_S * 0.8 <= closed_after < 3 * DEADLINE_S, (answer, closed_after)


async def test_whole_requests_on_a_keep_alive_connection_are_served_across_deadlines():
    server = await serving()
    try:
        async with httpx2.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=5) as http:
            texts = []
            for _ in range(4):  # 4 x 0.3 s: past one deadline in all, each head within its own
                texts.append((await http.get("/")).text)
                await asyncio.sleep(0.6 * DEADLINE_S)
    finally:
        await server.stop()
    assert texts == ["ok"] * 4
