"""A call's request message must arrive within a deadline of the call's start, as an HTTP body must follow its head.

gRPC runs a unary-request handler only once its message is in, and keeps no clock on it: a client that opens streams
and sends no message (a HEADERS frame each, no DATA) holds every one, with its task and buffers, for as long as its
connection lives, before the handler could check any key. The router's public port took 25,000 of them on one
unauthenticated connection (+310 MB). Each unary-request handler is served here as a streaming-request one that reads
its single message within the deadline, else ends DEADLINE_EXCEEDED; the wire is unchanged (HTTP/2 does not say which
side streams).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import grpc


class RequestMessageDeadline(grpc.aio.ServerInterceptor):
    """The outermost interceptor: its handlers wrap the whole chain, spans included (a call that never sent its
    message has no request to trace)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        codec = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
        if handler.unary_unary is not None:
            return grpc.stream_unary_rpc_method_handler(self._unary(handler.unary_unary), **codec)
        if handler.unary_stream is not None:
            return grpc.stream_stream_rpc_method_handler(self._stream(handler.unary_stream), **codec)
        return handler  # a streaming request (reflection): its handler runs from the start

    async def _request(self, context: grpc.aio.ServicerContext) -> Any:
        try:
            async with asyncio.timeout(self.timeout_s):  # no task of its own, as wait_for would make per call
                request = await context.read()
        except TimeoutError:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"the request message did not arrive within {self.timeout_s:g} s of the call's start",
            )
        if request is grpc.aio.EOF:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call ended without its request message")
        return request

    def _unary(self, fn: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def unary(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            return await fn(await self._request(context), context)

        return unary

    def _stream(self, fn: Callable[[Any, grpc.aio.ServicerContext], Any]) -> Callable[..., Awaitable[None]]:
        async def stream(requests: Any, context: grpc.aio.ServicerContext) -> None:
            answer = fn(await self._request(context), context)
            if inspect.isasyncgen(answer):  # a generator handler no StreamWriter drives: its messages written here
                async for message in answer:
                    await context.write(message)
            else:
                await answer

        return stream
