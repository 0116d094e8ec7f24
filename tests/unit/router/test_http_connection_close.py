"""The HTTP listener closes a keep-alive connection after its first response past the max connection age, as the
gRPC listener's GOAWAY does, so a client's pool reconnects (and a Service may spread it to a newer router); no
request fails, a streamed response goes out whole first. Real uvicorn on loopback, a real HTTP client's pool."""

from __future__ import annotations

import asyncio

import httpx2
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from services.router.http.connection_close import ConnectionAge
from services.router.http.server import HttpServer

AGE_S = 0.5


def app(clients: list[tuple[str, int]]) -> Starlette:
    """Records the client address (one per connection) of every request."""

    async def plain(request: Request) -> Response:
        assert request.client is not None
        clients.append((request.client.host, request.client.port))
        return PlainTextResponse("ok")

    async def stream(request: Request) -> Response:
        assert request.client is not None
        clients.append((request.client.host, request.client.port))

        async def chunks():  # type: ignore[no-untyped-def]
            for i in range(5):
                await asyncio.sleep(0.1)
                yield f"{i}\n"

        return StreamingResponse(chunks(), media_type="text/plain")

    return Starlette(routes=[Route("/plain", plain), Route("/stream", stream)])


async def requests_over(age_s: float | None, seconds: float, path: str) -> tuple[list[tuple[str, int]], list[str]]:
    """Back-to-back requests on one client's keep-alive pool for `seconds`: each request's client address, and the
    bodies."""
    clients: list[tuple[str, int]] = []
    server = HttpServer(app(clients), "127.0.0.1", 0, max_connection_age_s=age_s)
    await server.start()
    bodies = []
    try:
        async with httpx2.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=10) as http:
            end = asyncio.get_running_loop().time() + seconds
            while asyncio.get_running_loop().time() < end:
                response = await http.get(path)
                assert response.status_code == 200
                bodies.append(response.text)
                await asyncio.sleep(0.05)
    finally:
        await server.stop()
    return clients, bodies


async def test_a_connection_past_its_age_is_closed_after_a_response_and_the_client_reconnects() -> None:
    clients, bodies = await requests_over(AGE_S, 4 * AGE_S, "/plain")
    assert set(bodies) == {"ok"}
    connections = len(set(clients))
    assert 3 <= connections <= 6, clients  # a new one about every AGE_S (the first request of each starts its age)
    assert len(clients) > 2 * connections  # each served several requests before it aged


async def test_without_an_age_one_connection_serves_them_all() -> None:
    clients, _ = await requests_over(None, 4 * AGE_S, "/plain")
    assert len(set(clients)) == 1 and len(clients) > 10, clients


async def test_a_stream_past_the_age_goes_out_whole_before_the_close() -> None:
    clients, bodies = await requests_over(AGE_S, 4 * AGE_S, "/stream")
    assert set(bodies) == {"0\n1\n2\n3\n4\n"}
    assert len(set(clients)) >= 2, clients  # streams of 0.5 s each: every other one or so on a new connection


async def test_a_proxys_forwarded_address_is_not_taken_for_the_connection() -> None:
    """Behind a proxy (X-Forwarded-For from 127.0.0.1, which uvicorn would trust by default) every connection still
    ages on its own: a new one from the same forwarded client is not told to close on its first response."""
    clients: list[tuple[str, int]] = []
    server = HttpServer(app(clients), "127.0.0.1", 0, max_connection_age_s=AGE_S)
    await server.start()
    forwarded = {"X-Forwarded-For": "203.0.113.7"}
    base = f"http://127.0.0.1:{server.port}"
    try:
        # Both clients made first: making one (its TLS context) took seconds on a loaded CI host, long enough for
        # the server's 5 s keep-alive to close the old connection, whose next request then came on a new one.
        async with (
            httpx2.AsyncClient(base_url=base, timeout=10, headers=forwarded) as old,
            httpx2.AsyncClient(base_url=base, timeout=10, headers=forwarded) as new,
        ):
            await old.get("/plain")
            await asyncio.sleep(AGE_S * 1.5)
            first = await new.get("/plain")
            aged = await old.get("/plain")
    finally:
        await server.stop()
    assert first.headers.get("connection") != "close"
    assert aged.headers.get("connection") == "close"
    assert {host for host, _ in clients} == {"127.0.0.1"}  # the connection's own address, not the forwarded one


async def test_the_ages_kept_stay_bounded() -> None:
    """Requests that close their connection anyway (HTTP/1.0, `Connection: close`) are not kept; connections that
    left without a request past their age are forgotten, oldest first."""
    now = [0.0]

    async def ok(scope, receive, send):  # type: ignore[no-untyped-def]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def request(port: int, version: str = "1.1", headers: tuple = ()) -> None:
        scope = {"type": "http", "client": ("10.0.0.1", port), "server": ("10.0.0.2", 8000)}
        scope |= {"http_version": version, "headers": list(headers)}

        async def send(message):  # type: ignore[no-untyped-def]
            pass

        await age(scope, None, send)  # type: ignore[arg-type]

    age = ConnectionAge(ok, AGE_S, keep_alive_s=AGE_S, clock=lambda: now[0])
    for port in range(1000):
        await request(port, "1.0")
        await request(port + 1000, headers=((b"connection", b"close"),))
    assert len(age._first_seen) == 0
    for port in range(1000):
        now[0] += AGE_S / 1000
        await request(port)
    assert len(age._first_seen) == 1000
    now[0] += AGE_S * 1.5  # the first half of them are now past the age and the keep-alive timeout
    await request(5000)
    assert 400 <= len(age._first_seen) <= 601


async def test_a_live_connection_idle_past_twice_the_age_is_still_told_to_close() -> None:
    """A connection may wait up to the keep-alive timeout between requests: one whose first request is older than
    twice the age, but not than the age and the keep-alive timeout, is still live and past its age (the map forgot
    it at twice the age, and its next request started a new age: a loaded CI host took that long)."""
    now = [0.0]
    sent: list[dict] = []

    async def ok(scope, receive, send):  # type: ignore[no-untyped-def]
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def send(message):  # type: ignore[no-untyped-def]
        sent.append(message)

    def request(port: int):  # type: ignore[no-untyped-def]
        scope = {"type": "http", "client": ("10.0.0.1", port), "server": ("10.0.0.2", 8000), "http_version": "1.1"}
        return age(scope | {"headers": []}, None, send)  # type: ignore[arg-type]

    age = ConnectionAge(ok, AGE_S, keep_alive_s=10 * AGE_S, clock=lambda: now[0])
    await request(1)
    now[0] += 3 * AGE_S
    await request(2)  # another connection's request prunes the map
    await request(1)
    assert (b"connection", b"close") not in sent[0]["headers"]
    assert (b"connection", b"close") not in sent[1]["headers"]
    assert (b"connection", b"close") in sent[2]["headers"]


async def test_a_connection_that_closed_is_forgotten_at_once() -> None:
    """A caller opening connections fast, each with one request, leaves no entry behind each (the map kept every
    one for twice the age: 80k connections in ten minutes held 21 MB)."""
    server = HttpServer(app([]), "127.0.0.1", 0, max_connection_age_s=300.0)
    await server.start()
    age = server._server.config.app
    assert isinstance(age, ConnectionAge)
    try:
        for _ in range(20):
            async with httpx2.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=10) as http:
                assert (await http.get("/plain")).status_code == 200
                assert len(age._first_seen) == 1  # kept while the connection lives
            for _ in range(200):
                if not age._first_seen:
                    break
                await asyncio.sleep(0.01)  # the server sees the close a moment after the client made it
            assert age._first_seen == {}
    finally:
        await server.stop()
