"""The public pdserve.v1.Generation service: protobuf in, the shared request path, protobuf out."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from grpc._cython import cygrpc

from pdserve.rpc.metadata import PREDICTED_TTFT_KEY
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc
from services.router.generation import generate
from services.router.lifecycle import RequestLifecycle
from services.router.ticket import Ticket

# Its handler gets a request that does not parse as it is, and answers it where requests are counted.
GENERATE_METHOD = f"/{pb.DESCRIPTOR.services_by_name['Generation'].full_name}/Generate"


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, lifecycle: RequestLifecycle) -> None:
        self.lifecycle = lifecycle

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        async def send_prediction(ticket: Ticket) -> None:
            predicted_ms = round(ticket.placement.predicted_ttft_s * 1e3)
            await send_initial_metadata(context, ((PREDICTED_TTFT_KEY, str(predicted_ms)),))

        headers = {m.key: m.value for m in context.invocation_metadata() or () if isinstance(m.value, str)}
        messages = generate(self.lifecycle, request, headers, context.time_remaining, send_prediction)
        stall_s = self.lifecycle.config.reader_stall_timeout_s
        loop = asyncio.get_running_loop()
        ending: asyncio.Task[None] | None = None

        def reader_gone() -> None:
            """The caller took none of the stream for stall_s, a write still waiting on its window: its request
            ends now (cancelled, everything given back), not whenever the caller reads or leaves."""
            nonlocal ending
            ending = asyncio.ensure_future(messages.aclose())

        try:
            async for msg in messages:
                deadline = loop.call_later(stall_s, reader_gone)
                try:
                    yield msg
                finally:
                    deadline.cancel()
                if ending is not None:
                    await ending
                    await context.abort(
                        grpc.StatusCode.CANCELLED, f"the caller took none of its stream for {stall_s:g} s: ended"
                    )
        finally:
            await (ending if ending is not None else messages.aclose())


async def send_initial_metadata(context: grpc.aio.ServicerContext, metadata: tuple[tuple[str, str], ...]) -> None:
    """Sends it, or, when the caller already left (cancelled, or its deadline passed, while it was being admitted),
    ends the request as cancelled: gRPC's own error there would read as a bug of ours and count as failed. The
    context's done() and cancelled() still say False then; the failed send is what tells."""
    try:
        await context.send_initial_metadata(metadata)
    except cygrpc.ExecuteBatchError:  # the call's transport is gone: grpc.aio has no public type for it
        raise asyncio.CancelledError("the caller left before its admission was answered") from None
