"""Each served gRPC call's span (SpanKind.SERVER), a child of the caller's trace (its `traceparent` metadata),
named as OpenTelemetry's RPC conventions name it (`pdserve.v1.Generation/Generate`, no leading slash), with their
attributes (`rpc.system`, `rpc.service`, `rpc.method`, `rpc.grpc.status_code`; the caller's `client.address` and
integer `client.port`, as the HTTP API's span has them, and the connection's `network.peer.address`/`.port`) and
their status convention for server spans: ERROR only for the codes that are the server's (UNKNOWN, DEADLINE_EXCEEDED,
UNIMPLEMENTED, INTERNAL, UNAVAILABLE, DATA_LOSS).

Ours, not opentelemetry-instrumentation-grpc's server interceptor: its streaming wrapper was a generator, which
gRPC dropped at its `yield` when a call ended while a message was being written (the caller cancelled, or its
deadline passed): its span ended there, before the handler inside had closed, and the handler closed later, outside
the span (a test saw 3 of 12 deadline-exceeded requests without their mark). Inside this, the stream writer
(rpc/stream_writer.py) makes every streaming handler a coroutine that has closed it by the time it returns, so the
span ends after the close.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import unquote

import grpc
from opentelemetry import propagate, trace

from pdserve.rpc.errors import SERVER_FAILURES

Handler = Callable[[Any, grpc.aio.ServicerContext], Any]


class ServerSpans(grpc.aio.ServerInterceptor):
    """The outermost interceptor but the request message's deadline (request_deadline.py): every call `traced` says
    yes to runs inside its span."""

    def __init__(self, tracer: trace.Tracer, traced: Callable[[grpc.HandlerCallDetails], bool]) -> None:
        self.tracer = tracer
        self.traced = traced

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not self.traced(details):
            return handler
        codec = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(self._call(handler.unary_unary, details), **codec)
        if handler.unary_stream is not None:
            if inspect.isasyncgenfunction(handler.unary_stream):
                raise TypeError(f"{details.method}: a generator handler; rpc/stream_writer.py goes inside the spans")
            return grpc.unary_stream_rpc_method_handler(self._call(handler.unary_stream, details), **codec)
        return handler  # no pdserve service takes a stream of requests

    def _call(self, fn: Handler, details: grpc.HandlerCallDetails) -> Handler:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            with self._span(details, context):
                return await fn(request, context)

        return call

    @contextmanager
    def _span(self, details: grpc.HandlerCallDetails, context: grpc.aio.ServicerContext) -> Iterator[trace.Span]:
        """The call's span, current while its handler runs; its status code is the one the call ends with, and
        one the caller ended is no error of this server's."""
        carrier = {m.key: m.value for m in context.invocation_metadata() or () if isinstance(m.value, str)}
        service, _, method = details.method.lstrip("/").partition("/")
        attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method, **_peer(context.peer())}
        if agent := carrier.get("user-agent"):
            attributes["rpc.user_agent"] = agent
        with self.tracer.start_as_current_span(
            details.method.lstrip("/"),
            propagate.extract(carrier),
            kind=trace.SpanKind.SERVER,
            attributes=attributes,
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            code, callers = grpc.StatusCode.UNKNOWN, False
            try:
                yield span
                code = context.code() or grpc.StatusCode.OK
            except grpc.aio.AbortError:
                code = context.code() or grpc.StatusCode.UNKNOWN
                raise
            except (asyncio.CancelledError, GeneratorExit):  # the caller left, or its deadline passed: no error here
                code, callers = _ended_by_caller(context), True
                raise
            except BaseException:  # what gRPC sends then: the code set, if any but OK
                set_code = context.code()
                code = set_code if set_code not in (None, grpc.StatusCode.OK) else grpc.StatusCode.UNKNOWN
                raise
            finally:
                span.set_attribute("rpc.grpc.status_code", code.value[0])
                if code in SERVER_FAILURES and not callers:
                    span.set_status(trace.StatusCode.ERROR, f"{code}:{context.details() or ''}")


def _ended_by_caller(context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    left = context.time_remaining()
    return grpc.StatusCode.DEADLINE_EXCEEDED if left is not None and left <= 0 else grpc.StatusCode.CANCELLED


def _peer(peer: str) -> dict[str, str | int]:
    """`ipv4:127.0.0.1:57284` or `ipv6:%5B::1%5D:57284` as OpenTelemetry's attributes of a server span's caller (no
    proxy between: the connection's peer is the client); a unix socket: none."""
    kind, _, address = peer.split(",")[0].partition(":")
    if kind not in ("ipv4", "ipv6") or ":" not in address:
        return {}
    ip, port = unquote(address).rsplit(":", 1)
    ip = ip.removeprefix("[").removesuffix("]")
    if not port.isdigit():
        return {"client.address": ip, "network.peer.address": ip}
    number = int(port)
    return {"client.address": ip, "client.port": number, "network.peer.address": ip, "network.peer.port": number}
