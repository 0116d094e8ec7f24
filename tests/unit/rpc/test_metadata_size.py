"""A request's metadata is judged against one limit: under it every call passes, past it every call is refused,
never the same request by chance (gRPC's default refuses at random between 8 and 16 KiB)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.rpc.server import MAX_METADATA_BYTES, Server, channel

pytestmark = pytest.mark.timeout(60)
ECHO_METHOD = "/test.Echo/Get"


async def _echo(request: bytes, _context: grpc.aio.ServicerContext) -> bytes:
    return request


async def _codes(header_bytes: int, calls: int) -> list[grpc.StatusCode]:
    server = Server("127.0.0.1", 0)
    handler = grpc.method_handlers_generic_handler("test.Echo", {"Get": grpc.unary_unary_rpc_method_handler(_echo)})
    server.add(lambda s: s.add_generic_rpc_handlers((handler,)), ["test.Echo"])
    await server.start()
    codes = []
    try:
        async with channel(server.address) as ch:
            get = ch.unary_unary(ECHO_METHOD)
            for _ in range(calls):
                try:
                    await get(b"x", metadata=(("x-padding", "a" * header_bytes),), timeout=10)
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as e:
                    codes.append(e.code())
    finally:
        await server.stop(None)
    return codes


def test_metadata_under_the_limit_always_passes_and_past_it_is_always_refused():
    assert asyncio.run(_codes(12_000, 12)) == [grpc.StatusCode.OK] * 12  # ~45% refused each, before
    assert asyncio.run(_codes(MAX_METADATA_BYTES + 1000, 3)) == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 3
