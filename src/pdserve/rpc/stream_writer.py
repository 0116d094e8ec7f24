"""Every streaming handler (an async generator) is driven by a coroutine that writes its messages
(`context.write`), so a call that ends while gRPC writes one of them (its caller left, or its deadline passed, and
the write fails) closes the handler at once, before the call is over: inside the call's span (rpc/server_spans.py,
outside this), with the request's context variables.

grpc.aio's own driving of a generator handler left it suspended at its `yield` when a write failed
(grpc/grpc#42295), to be closed whenever the garbage collector reached it, in a task of its own: the request's
outcome never reached its span, and its cleanup ran outside its trace. gRPC also cancels the call's task once the
transport is gone, whatever it is doing then, so the close runs in a task of its own, in a copy of the call's
context, to its end (background.through_cancels). A handler therefore resets no context variable across a `yield`
(ContextVar.reset, OpenTelemetry's attach and detach: a token is only good in the context it was made in); none
does (a worker's drain gate closes its streams in the very context their steps ran in).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import grpc
from grpc._cython import cygrpc

from pdserve.background import through_cancels

Handler = Callable[[Any, grpc.aio.ServicerContext], Awaitable[None]]


class StreamWriter(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.unary_stream is None or not inspect.isasyncgenfunction(handler.unary_stream):
            return handler
        return grpc.unary_stream_rpc_method_handler(
            _written(handler.unary_stream),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def _written(fn: Callable[[Any, grpc.aio.ServicerContext], AsyncGenerator[Any, None]]) -> Handler:
    async def stream(request: Any, context: grpc.aio.ServicerContext) -> None:
        messages = fn(request, context)
        try:
            async for message in messages:
                try:
                    await context.write(message)
                except cygrpc.ExecuteBatchError:  # grpc.aio has no public type for it
                    # The call ended under the write: its caller left, or its deadline passed (or the message was
                    # over the channel's limit, which no pdserve message nears: the caller gets RESOURCE_EXHAUSTED).
                    raise asyncio.CancelledError("the caller left, or its deadline passed") from None
        finally:
            # Not run to its end, nor closed by what it raised (a native generator's frame: typeshed's type lacks it).
            if messages.ag_frame is not None:  # type: ignore[attr-defined]
                await through_cancels(messages.aclose())

    return stream
