"""The public pdserve.v1.Generation service: protobuf in, the request lifecycle, protobuf out."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc

from pdserve.rpc.metadata import PREDICTED_TTFT_KEY
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc
from services.router.lifecycle import RequestLifecycle


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, lifecycle: RequestLifecycle) -> None:
        self.lifecycle = lifecycle

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        start = time.perf_counter()
        with self.lifecycle.accounting(start) as caller:
            caller.tenant = self.lifecycle.authenticate(context.invocation_metadata())
            with self.lifecycle.quotas.session(caller.tenant) as quota:
                ticket = await self.lifecycle.admit(request, start, quota)
                with ticket:
                    predicted_ms = round(ticket.placement.predicted_ttft_s * 1e3)
                    await context.send_initial_metadata(((PREDICTED_TTFT_KEY, str(predicted_ms)),))
                    async for msg in self.lifecycle.stream(ticket, context.time_remaining):
                        yield msg
