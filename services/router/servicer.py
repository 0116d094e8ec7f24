"""The public pdserve.v1.Generation service: protobuf in, the shared request path, protobuf out."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from typing import Any

import grpc
from grpc._cython import cygrpc

from pdserve.rpc.metadata import PREDICTED_TTFT_KEY, REQUEST_ID_KEY
from pdserve.telemetry import request_id_var
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc
from services.router.generation import generate
from services.router.lifecycle import RequestLifecycle
from services.router.parse_after_key import Unparsed
from services.router.ticket import Ticket

# Its handler gets its request unparsed (parse_after_key) or, without that, one that does not parse as it is, and
# answers it where requests are counted.
GENERATE_METHOD = f"/{pb.DESCRIPTOR.services_by_name['Generation'].full_name}/Generate"


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, lifecycle: RequestLifecycle) -> None:
        self.lifecycle = lifecycle

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: pb.GenerateRequest | Unparsed, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        async def send_prediction(ticket: Ticket) -> None:
            predicted_ms = round(ticket.placement.predicted_ttft_s * 1e3)
            metadata = ((PREDICTED_TTFT_KEY, str(predicted_ms)), *_request_id(ticket.client_id))
            await send_initial_metadata(context, metadata)

        headers = caller_headers(context.invocation_metadata())
        messages = generate(self.lifecycle, request, headers, context.time_remaining, send_prediction)
        stall_s = self.lifecycle.config.reader_stall_timeout_s
        loop = asyncio.get_running_loop()
        ending: asyncio.Task[None] | None = None

        def reader_gone(last: bool) -> None:
            """The caller took none of the stream for stall_s, a write still waiting on its window: its request
            ends now (cancelled, everything given back), not whenever the caller reads or leaves. Its `last`
            message waiting (a finish reason): the request is done, and ends as finished."""
            nonlocal ending
            ending = asyncio.ensure_future(_run_out(messages) if last else messages.aclose())

        try:
            async for msg in messages:
                last = msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED
                deadline = loop.call_later(stall_s, reader_gone, last)
                try:
                    yield msg
                finally:
                    deadline.cancel()
                if ending is not None:
                    await ending
                    if not last:  # ABORTED, not CANCELLED: that code says the caller cancelled, which it did not
                        await context.abort(grpc.StatusCode.ABORTED, _stalled_reader(stall_s))
        finally:
            await (ending if ending is not None else messages.aclose())
            context.set_trailing_metadata(_request_id(request_id_var.get()))  # set once admission read the request


def _request_id(request_id: str | None) -> tuple[tuple[str, str], ...]:
    """The request's id as metadata: printable ASCII, as a metadata value must be (admission refuses any other)."""
    return ((REQUEST_ID_KEY, request_id),) if request_id else ()


def _stalled_reader(stall_s: float) -> str:
    return (
        f"the caller took none of its stream for {stall_s:g} s (the router's reader_stall_timeout_s): ended, its "
        "output partial; read the stream as it comes (a retry starts over)"
    )


def caller_headers(metadata: Iterable[Any] | None) -> tuple[tuple[str, str], ...]:
    """A call's text metadata as the caller check reads it, a key given twice twice: the check refuses two keys
    rather than take one of them."""
    return tuple((m.key, m.value) for m in metadata or () if isinstance(m.value, str))


async def _run_out(messages: AsyncIterator[pb.GenerateResponse]) -> None:
    """Runs a stream past its last message (a finish reason: nothing follows), so that it ends as finished."""
    async for _ in messages:
        pass


async def send_initial_metadata(context: grpc.aio.ServicerContext, metadata: tuple[tuple[str, str], ...]) -> None:
    """Sends it, or, when the caller already left (cancelled, or its deadline passed, while it was being admitted),
    ends the request as its caller's doing (cancelled, or deadline_exceeded): gRPC's own error there would read as
    a bug of ours and count as failed. The context's done() and cancelled() still say False then; the failed send is
    what tells."""
    try:
        await context.send_initial_metadata(metadata)
    except cygrpc.ExecuteBatchError:  # the call's transport is gone: grpc.aio has no public type for it
        raise asyncio.CancelledError("the caller left before its admission was answered") from None
