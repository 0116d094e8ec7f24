"""The `grpc` backend: pdserve's public Generate API on one grpc.aio channel."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial

import grpc

from loadgen.client import Send
from loadgen.record import RequestRecord
from loadgen.workload import Request
from pdserve.addresses import split_host_port
from pdserve.rpc.credentials import ClientCredentials
from pdserve.rpc.server import channel
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc

CONNECT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class GrpcBackend:
    address: str
    slo: pb.SLO | None = None  # sent with every request when set, for the router's admission
    credentials: ClientCredentials | None = None  # TLS and API key (None: plaintext, no key)
    priority: int = 0  # every request's

    @asynccontextmanager
    async def session(self, max_concurrency: int) -> AsyncGenerator[Send, None]:
        metadata = self.credentials.metadata() if self.credentials else ()
        await _knock(self.address)
        async with channel(self.address, credentials=self.credentials) as ch:
            await asyncio.wait_for(ch.channel_ready(), CONNECT_TIMEOUT_S)  # connecting is not the server's latency
            yield partial(_stream, generate_pb2_grpc.GenerationStub(ch), self.slo, self.priority, metadata)


async def _knock(address: str) -> None:
    """ConnectionRefusedError naming `address` when nothing listens there: the channel's own wait for it retries
    for its whole CONNECT_TIMEOUT_S and then says only that no answer came."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(*split_host_port(address)), CONNECT_TIMEOUT_S)
    except ConnectionRefusedError:
        raise ConnectionRefusedError(f"nothing listens at {address} (connection refused)") from None
    except (TimeoutError, OSError):  # unreachable or slow, not refused: the channel's wait decides
        return
    writer.close()


async def _stream(
    stub: generate_pb2_grpc.GenerationStub,
    slo: pb.SLO | None,
    priority: int,
    metadata: tuple[tuple[str, str], ...],
    req: Request,
    record: RequestRecord,
) -> None:
    msg = pb.GenerateRequest(
        request_id=record.request_id,
        prompt_token_ids=req.prompt_token_ids,
        sampling=pb.SamplingParams(max_tokens=req.output_len, ignore_eos=True),
        slo=slo,
        priority=priority,
    )
    sent = record.sent_clock = time.perf_counter()
    try:
        async for response in stub.Generate(msg, metadata=metadata):
            record.message_times_s.append(time.perf_counter() - sent)
            record.message_tokens.append(len(response.token_ids))
            if response.usage.prompt_tokens:  # the last message's: the server's count of what it prefilled
                record.input_len = response.usage.prompt_tokens
    except grpc.aio.AioRpcError as e:
        record.status = e.code().name
        record.error = e.details() or ""
