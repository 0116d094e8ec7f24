"""Channels to workers close once idle, never under a call in flight, and reopen on the next call."""

from __future__ import annotations

import asyncio

from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.rpc.channel_pool import ChannelPool
from pdserve.rpc.server import Server

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def test_idle_channels_close_and_reopen_while_a_call_in_flight_keeps_its_own() -> None:
    a, b = Server("127.0.0.1", 0), Server("127.0.0.1", 0)
    for server in (a, b):
        await server.start()
        await server.set_serving(True)
    now = [0.0]
    pool = ChannelPool(health_pb2_grpc.HealthStub, idle_close_s=10.0, clock=lambda: now[0])

    async def check(address: str) -> int:
        reply = await pool.call(address, lambda stub: stub.Check(health_pb2.HealthCheckRequest(), timeout=5))
        return reply.status

    try:
        watch = pool.call(a.address, lambda stub: stub.Watch(health_pb2.HealthCheckRequest(), timeout=30))
        assert (await watch.read()).status == SERVING
        now[0] += 100.0
        assert await check(b.address) == SERVING
        assert sorted(pool.addresses) == sorted([a.address, b.address])  # a's watch is still in flight
        await a.set_serving(False)
        assert (await asyncio.wait_for(watch.read(), 5)).status == NOT_SERVING  # and still answers

        watch.cancel()
        await asyncio.sleep(0.1)  # the call's end reaches the pool
        now[0] += 9.0
        assert await check(b.address) == SERVING
        assert a.address in pool.addresses  # idle for less than 10 s
        now[0] += 1.0
        assert await check(b.address) == SERVING
        assert pool.addresses == [b.address]  # idle for 10 s: closed
        assert await check(a.address) == NOT_SERVING  # the next call opens another
        assert sorted(pool.addresses) == sorted([a.address, b.address])
    finally:
        await pool.close()
        for server in (a, b):
            await server.stop(None)
    assert pool.addresses == []
