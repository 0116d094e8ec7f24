"""A served call's span (pdserve.rpc.server_spans) on a real loopback server: a stream whose caller's deadline
passes while gRPC writes one of its messages (the caller reads none, so the writes wait on flow control) closes its
handler inside the span, in the call's context, to the end of its cleanup (gRPC cancels the call's task meanwhile):
what the handler does on its way out (the router marks the request's outcome, ends its child calls) lands on the
span. So it does through each interceptor between them (the error mapping; a worker's drain gate, whose steps run
in a context of the stream's own). The garbage collector is off, so nothing ends by it."""

from __future__ import annotations

import asyncio
import contextvars
import gc
from collections.abc import AsyncIterator

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve.cluster.drain import DrainGate
from pdserve.rpc.server import Server, channel
from pdserve.telemetry import Telemetry

pytestmark = pytest.mark.timeout(60)
SERVICE = "pdserve.v1.DecodeWorker"  # one a worker's drain gate holds
METHOD = f"/{SERVICE}/Flood"
SPAN = f"{SERVICE}/Flood"  # OpenTelemetry's RPC span name: the method's path without its leading slash
CHUNK = b"x" * (256 * 1024)
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)


async def _flood(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    REQUEST_ID.set("r1")  # as a worker's handler sets the request id for its log lines
    try:
        while True:
            yield CHUNK
    finally:  # as a request's cleanup: awaits (an engine's abort, a call cancelled), then marks the request's span
        await asyncio.sleep(0.05)
        await asyncio.sleep(0.05)
        trace.get_current_span().set_attribute("closed_in_span", REQUEST_ID.get() or "without the request's id")


def _add(server: grpc.aio.Server) -> None:
    handlers = {
        "Flood": grpc.unary_stream_rpc_method_handler(_flood),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


@pytest.fixture(params=["error mapping", "drain gate"])
async def served(request) -> AsyncIterator[tuple[str, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    telemetry = Telemetry("t", span_processor=SimpleSpanProcessor(exporter))
    inner = [DrainGate("d0")] if request.param == "drain gate" else []
    server = Server("127.0.0.1", 0, telemetry.server_interceptors(), inner=inner)
    server.add(_add, [SERVICE])
    await server.start()
    gc.disable()
    try:
        yield server.address, exporter
    finally:
        gc.enable()
        await server.stop(None)
        telemetry.shutdown()


async def test_a_stream_its_callers_deadline_ended_mid_write_closes_its_handler_inside_its_span(served):
    address, exporter = served
    async with channel(address) as ch:
        call = ch.unary_stream(METHOD)(b"", timeout=0.5)
        await call.initial_metadata()
        assert await call.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    for _ in range(50):  # the server's side of the call ends a moment after its caller's
        if any(s.name == SPAN for s in exporter.get_finished_spans()):
            break
        await asyncio.sleep(0.1)
    (server_span,) = [s for s in exporter.get_finished_spans() if s.name == SPAN]
    assert server_span.attributes.get("closed_in_span") == "r1", server_span.attributes
    port = server_span.attributes["client.port"]  # the caller as the HTTP API's span names it: an integer port
    assert isinstance(port, int) and 0 < port < 65536 and server_span.attributes["client.address"] == "127.0.0.1"
    assert server_span.attributes["network.peer.address"] == "127.0.0.1"
    assert server_span.attributes["network.peer.port"] == port
    assert server_span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert server_span.status.status_code != trace.StatusCode.ERROR  # the caller's deadline, not this server's fault


def test_a_callers_address_is_the_client_and_network_peer_attributes_with_an_integer_port():
    """OpenTelemetry's current names (`net.peer.ip`/`net.peer.port` are deprecated), an IPv6 address without the
    brackets its URI form has, as the HTTP API's span names its caller."""
    from pdserve.rpc.server_spans import _peer

    for peer, ip in (("ipv4:10.0.0.7:57284", "10.0.0.7"), ("ipv6:%5B::1%5D:57284", "::1")):
        assert _peer(peer) == {
            "client.address": ip,
            "client.port": 57284,
            "network.peer.address": ip,
            "network.peer.port": 57284,
        }
    assert _peer("unix:/tmp/s.sock") == {}
