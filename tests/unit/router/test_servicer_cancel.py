"""A caller that leaves while its request is being admitted ends it as cancelled, not as a handler's failure."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import grpc
import pytest

from services.router.servicer import send_initial_metadata

METHOD = "/test.Slow/Admit"


@contextlib.asynccontextmanager
async def calling(admit: Callable[..., AsyncIterator[bytes]]) -> AsyncIterator[grpc.aio.UnaryStreamMultiCallable]:
    """A real server running `admit` as its one method over loopback, and the method to call it."""
    server = grpc.aio.server()
    handler = grpc.unary_stream_rpc_method_handler(admit)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Slow", {"Admit": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel.unary_stream(METHOD)
    finally:
        await server.stop(None)


async def test_initial_metadata_for_a_caller_that_left_is_a_cancellation() -> None:
    outcome: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()

    async def admit(request: bytes, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
        async def until_done() -> None:
            while not context.done():
                await asyncio.sleep(0.01)

        # Admission outlasts the caller and goes on: gRPC's cancel of the handler lands only at an await that
        # nothing shields (a quota call to Redis may have had its answer at that moment, as seen under load).
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(until_done())
        try:
            await send_initial_metadata(context, (("x-test", "1"),))
            outcome.set_result(None)
        except BaseException as e:
            outcome.set_result(e)
            raise
        yield b""

    async with calling(admit) as method:
        call = method(b"")
        await asyncio.sleep(0.2)
        call.cancel()
        raised = await asyncio.wait_for(outcome, 10)
    assert isinstance(raised, asyncio.CancelledError)


async def test_initial_metadata_for_a_caller_still_there_is_sent() -> None:
    async def admit(request: bytes, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
        await send_initial_metadata(context, (("x-test", "1"),))
        yield b"ok"

    async with calling(admit) as method:
        call = method(b"")
        assert ("x-test", "1") in tuple(await call.initial_metadata())
        assert [m async for m in call] == [b"ok"]


pytestmark = pytest.mark.timeout(30)
