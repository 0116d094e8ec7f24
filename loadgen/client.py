"""Sending a workload through the public Generate API on one grpc.aio channel, timing every message."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

import grpc

from loadgen.record import RequestRecord
from loadgen.workload import Request
from pdserve.rpc.credentials import ClientCredentials
from pdserve.rpc.server import channel
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc

# grpc.aio starts cancelling calls when too many are in flight on one channel (measured: 2,000 unbounded
# calls gave 140 CANCELLED), so in-flight calls are always bounded: by this when --max-concurrency is not given.
DEFAULT_MAX_IN_FLIGHT = 256
CONNECT_TIMEOUT_S = 30.0


class Client:
    def __init__(
        self,
        address: str,
        max_concurrency: int | None = None,
        slo: pb.SLO | None = None,
        credentials: ClientCredentials | None = None,
    ) -> None:
        self.address = address
        self.credentials = credentials
        self.max_in_flight = max_concurrency or DEFAULT_MAX_IN_FLIGHT
        self.slo = slo  # sent with every request when set, for the router's admission; else the server's default

    async def run(
        self, requests: list[Request], on_done: Callable[[RequestRecord], None] = lambda r: None
    ) -> tuple[list[RequestRecord], float]:
        """Sends each request at its arrival offset; returns the records (in workload order) and the duration
        from the first send to the last answer."""
        tag = uuid.uuid4().hex[:8]
        metadata = self.credentials.metadata() if self.credentials else ()
        async with channel(self.address, credentials=self.credentials) as ch:
            await asyncio.wait_for(ch.channel_ready(), CONNECT_TIMEOUT_S)  # connecting is not the server's latency
            stub = generate_pb2_grpc.GenerationStub(ch)
            slots = asyncio.Semaphore(self.max_in_flight)
            start = time.perf_counter()

            async def one(i: int, req: Request) -> RequestRecord:
                record = RequestRecord(f"loadgen-{tag}-{i}", req.input_len, req.output_len, req.arrival_s)
                async with slots:
                    record.start_s = time.perf_counter() - start
                    await _stream(stub, req, record, self.slo, metadata)
                on_done(record)
                return record

            tasks = []
            for i, req in enumerate(requests):
                delay = start + req.arrival_s - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(i, req)))
            records = await asyncio.gather(*tasks)
            return list(records), time.perf_counter() - start

    async def check(self, request: Request) -> RequestRecord:
        """One request on its own, before a run: a cluster that cannot answer fails fast, not N times."""
        records, _ = await self.run([request])
        return records[0]


async def _stream(
    stub: generate_pb2_grpc.GenerationStub,
    req: Request,
    record: RequestRecord,
    slo: pb.SLO | None,
    metadata: tuple[tuple[str, str], ...] = (),
) -> None:
    msg = pb.GenerateRequest(
        request_id=record.request_id,
        prompt_token_ids=req.prompt_token_ids,
        sampling=pb.SamplingParams(max_tokens=req.output_len, ignore_eos=True),
        slo=slo,
    )
    sent = time.perf_counter()
    try:
        async for response in stub.Generate(msg, metadata=metadata):
            record.message_times_s.append(time.perf_counter() - sent)
            record.message_tokens.append(len(response.token_ids))
    except grpc.aio.AioRpcError as e:
        record.status = e.code().name
        record.error = e.details() or ""
