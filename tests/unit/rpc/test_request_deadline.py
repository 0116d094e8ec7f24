"""A call whose request message does not arrive within the server's `request_timeout_s` of its start ends
DEADLINE_EXCEEDED: a client that opened streams and sent no message (gRPC's slowloris) held each one, with its task
and buffers, for as long as it kept the connection, before any key was checked (the router's public port took 25,000
of them on one unauthenticated connection, +310 MB)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.rpc.server import Server, channel

pytestmark = pytest.mark.timeout(60)
CHECK, WATCH = "/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"


async def test_a_call_without_its_request_message_ends_and_one_with_it_is_served() -> None:
    server = Server("127.0.0.1", 0, request_timeout_s=0.5)
    await server.start()
    await server.set_serving(True)
    try:
        async with channel(server.address) as ch:
            for method in (CHECK, WATCH):  # a unary and a streaming answer, the message never sent
                headers_only = ch.stream_stream(method, request_serializer=bytes, response_deserializer=bytes)()
                with pytest.raises(grpc.aio.AioRpcError) as ended:
                    await asyncio.wait_for(headers_only.read(), 20)
                assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, ended.value
                assert "request message" in ended.value.details()
            stub = health_pb2_grpc.HealthStub(ch)
            checked = await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert checked.status == health_pb2.HealthCheckResponse.SERVING
            watched = stub.Watch(health_pb2.HealthCheckRequest(), timeout=10)
            assert (await watched.read()).status == health_pb2.HealthCheckResponse.SERVING
            watched.cancel()
            with pytest.raises(grpc.aio.AioRpcError) as unknown:  # a handler's own status passes through
                await stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=10)
            assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await server.stop(None)
