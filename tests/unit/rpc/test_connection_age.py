"""A server's `max_connection_age_s`: past it, new calls come on a new connection (one a load balancer may place
on another replica), while a stream open on the old connection runs on to its end."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.rpc.server import Server, channel

pytestmark = pytest.mark.timeout(60)
AGE_S = 1.0
PEER_METHOD = "/test.Peer/Get"


async def _peer(_request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    """The caller's address as the server sees it: a new connection comes from a new client port."""
    return context.peer().encode()


async def _serve(max_connection_age_s: float | None) -> Server:
    server = Server("127.0.0.1", 0, max_connection_age_s=max_connection_age_s)
    handler = grpc.method_handlers_generic_handler("test.Peer", {"Get": grpc.unary_unary_rpc_method_handler(_peer)})
    server.add(lambda s: s.add_generic_rpc_handlers((handler,)), ["test.Peer"])
    await server.start()
    await server.set_serving(True)
    return server


async def _peers_and_stream(max_connection_age_s: float | None) -> tuple[bytes, bytes, int]:
    """The peer of a call before and after 2.5 connection ages, and the status a stream opened before them
    receives after them."""
    server = await _serve(max_connection_age_s)
    try:
        async with channel(server.address) as ch:
            get_peer = ch.unary_unary(PEER_METHOD)
            before = await get_peer(b"")
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""))
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            await asyncio.sleep(2.5 * AGE_S)
            after = await get_peer(b"")
            await server.set_serving(False)
            status = (await asyncio.wait_for(watch.read(), timeout=10)).status
            watch.cancel()
            return before, after, status
    finally:
        await server.stop(None)


def test_past_its_age_a_connection_takes_no_new_calls_but_its_stream_runs_on():
    before, after, status = asyncio.run(_peers_and_stream(AGE_S))
    assert before != after, "a call after the connection's age came on the same connection"
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING


def test_without_an_age_the_connection_stays():
    before, after, status = asyncio.run(_peers_and_stream(None))
    assert before == after
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
