"""The embedded HTTP server's own loop on an idle router: one wake-up a second (the Date header's refresh), where
uvicorn's wakes every 0.1 s to see whether it should stop, on the event loop that relays every stream; a stop
still wakes it at once. Real uvicorn on loopback; its ticks counted, not timed."""

from __future__ import annotations

import asyncio

from starlette.applications import Starlette

from services.router.http.server import TICK_S, HttpServer


async def started_counting_ticks() -> tuple[HttpServer, list[float]]:
    """A server on a free port, and the loop times of each of its ticks."""
    server = HttpServer(Starlette(), "127.0.0.1", 0)
    embedded, ticks = server._server, []
    own_tick = embedded.on_tick

    async def counted(counter: int) -> bool:
        ticks.append(asyncio.get_running_loop().time())
        return await own_tick(counter)

    embedded.on_tick = counted  # type: ignore[method-assign]
    await server.start()
    return server, ticks


async def test_an_idle_server_wakes_once_a_second() -> None:
    server, ticks = await started_counting_ticks()
    loop = asyncio.get_running_loop()
    try:
        start, before = loop.time(), len(ticks)
        await asyncio.sleep(0.5)
        elapsed = loop.time() - start
        assert len(ticks) - before <= 1 + elapsed / TICK_S, ticks  # uvicorn's own loop: about 5 by now
        assert any(name == b"date" for name, _ in server._server.server_state.default_headers)
    finally:
        await server.stop()


async def test_a_stop_wakes_the_idle_loop_at_once() -> None:
    server, ticks = await started_counting_ticks()
    try:
        await asyncio.sleep(0.05)  # past its first tick: waiting for the next, a second away
        before = len(ticks)
        server._server.should_exit = True
        for _ in range(50):  # loop turns, no time: the tick the exit brings is not the second's
            await asyncio.sleep(0)
        assert len(ticks) > before
    finally:
        await server.stop()
