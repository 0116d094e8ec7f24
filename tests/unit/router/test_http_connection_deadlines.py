"""The HTTP listener closes a connection whose request head (line and headers) is not in within its deadline, as
a client sending it a byte at a time (slowloris) would hold it for ever otherwise; whole requests, one after
another on a keep-alive connection, are served as before. A connection whose reader takes none of a response for
its write deadline is ended, and the response's stream with it (a stalled reader held its request, and the
router's slot, for ever). Real uvicorn on loopback."""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections.abc import AsyncIterator

import httpx2
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Send

from pdserve.rpc.credentials import ServerTLS
from services.router.http.connection_deadlines import DeadlineProtocol
from services.router.http.server import HttpServer
from tests.certs import make_certs
from tests.unit.router.slow_client import dribbled

DEADLINE_S = 0.5


async def ok(request: Request) -> Response:
    return PlainTextResponse("ok")


class Flood:
    """A response of 1 MiB chunks for ever; notes when it ended."""

    def __init__(self) -> None:
        self.ended = asyncio.Event()

    async def respond(self, request: Request) -> Response:
        async def chunks() -> AsyncIterator[bytes]:
            while True:
                yield b"x" * 2**20
                await asyncio.sleep(0)  # as a stream waiting for its next event does: a gone reader's send never does

        flood = self

        class Noted(StreamingResponse):
            async def stream_response(self, send: Send) -> None:
                try:
                    await super().stream_response(send)
                finally:
                    flood.ended.set()

        return Noted(chunks())


BIG = 2 * 2**20


async def big(request: Request) -> Response:
    return Response(b"x" * BIG)  # written whole, as a non-streamed answer is


async def stream(request: Request) -> Response:
    async def events() -> AsyncIterator[bytes]:
        for _ in range(BIG // 2**14):
            yield b"x" * 2**14  # as SSE events come: many writes
            await asyncio.sleep(0)

    return StreamingResponse(events())


async def serving(flood: Flood | None = None, tls: ServerTLS | None = None) -> HttpServer:
    routes = [Route("/", ok), Route("/flood", (flood or Flood()).respond), Route("/big", big), Route("/stream", stream)]
    server = HttpServer(
        Starlette(routes=routes), "127.0.0.1", 0, tls, head_timeout_s=DEADLINE_S, write_stall_timeout_s=DEADLINE_S
    )
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


async def test_a_reader_that_takes_nothing_is_cut_at_its_write_deadline_and_the_stream_ends():
    flood = Flood()
    server = await serving(flood)
    reader = socket.socket()
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    reader.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(reader, ("127.0.0.1", server.port))
        reader.send(b"GET /flood HTTP/1.1\r\nHost: router\r\n\r\n")  # and never reads
        start = time.monotonic()
        await asyncio.wait_for(flood.ended.wait(), 20)
        ended_after = time.monotonic() - start
    finally:
        reader.close()
        await server.stop()
    assert DEADLINE_S <= ended_after < 15, ended_after  # the buffers fill within seconds; then the deadline


@pytest.mark.parametrize(("path", "tls"), [("/big", False), ("/stream", True)])
async def test_a_slow_reader_that_takes_some_of_each_deadline_gets_the_whole_response(tmp_path, monkeypatch, tls, path):
    """As nginx's send_timeout: the deadline is on progress, not on the whole download. A steady reader of a large
    answer was cut mid-body, and over TLS, where the buffers the check could see stayed still while TLS's inner
    transport drained, cut however it read. The server's send buffer is kept small, as a slow reader's fills."""
    original = DeadlineProtocol.connection_made

    def small_send_buffer(self: DeadlineProtocol, transport: asyncio.Transport) -> None:
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 2**17)
        original(self, transport)

    monkeypatch.setattr(DeadlineProtocol, "connection_made", small_send_buffer)
    certs = make_certs(tmp_path) if tls else None
    server = await serving(tls=ServerTLS(str(certs.server_cert), str(certs.server_key)) if certs else None)
    try:
        context = ssl.create_default_context(cafile=str(certs.ca)) if certs else None
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port, limit=2**16, ssl=context)
        writer.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
        writer.write(f"GET {path} HTTP/1.1\r\nHost: router\r\n\r\n".encode())
        got, start = 0, time.monotonic()
        while got <= BIG and (chunk := await reader.read(16384)):
            got += len(chunk)
            await asyncio.sleep(0.01)  # ~1.6 MB/s: the whole answer takes several deadlines
        writer.close()
    finally:
        await server.stop()
    assert got > BIG and time.monotonic() - start > 2 * DEADLINE_S
