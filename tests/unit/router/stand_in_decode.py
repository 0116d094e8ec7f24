"""Stand-in decode workers for router tests: pdserve's own gRPC server (its cluster-secret check included) answering
DecodeWorker.Generate with made-up tokens, so a router's lifecycle runs its real relay, retries and ejections."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc

from pdserve.rpc.server import Server
from pdserve.security.cluster_secret import ClusterSecret
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc
from services.router.generation import generate
from services.router.lifecycle import RequestLifecycle
from services.router.ticket import Ticket


class StandInDecode(worker_pb2_grpc.DecodeWorkerServicer):
    """Streams `max_tokens` tokens, one every `gap_s`, the last with finish reason LENGTH."""

    def __init__(self, gap_s: float = 0.0) -> None:
        self.gap_s = gap_s
        self.calls = 0  # the ones past the server's cluster-secret check
        self.requests: list[wpb.WorkerGenerateRequest] = []  # what those calls asked

    async def Generate(  # noqa: N802
        self, request: wpb.WorkerGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.calls += 1
        self.requests.append(request)
        n = request.sampling.max_tokens
        for i in range(n):
            if i:
                await asyncio.sleep(self.gap_s)
            finish = pb.FINISH_REASON_LENGTH if i == n - 1 else pb.FINISH_REASON_UNSPECIFIED
            yield pb.GenerateResponse(token_ids=[3 + i % 200], finish_reason=finish)


@asynccontextmanager
async def serving(decode: StandInDecode, secret: bytes = b"") -> AsyncIterator[str]:
    """`decode` on a loopback port, refusing calls without this cluster secret's token (b"": none); its address."""
    server = Server("127.0.0.1", 0, cluster=ClusterSecret(secret))
    server.add(lambda s: worker_pb2_grpc.add_DecodeWorkerServicer_to_server(decode, s), [])
    await server.start()
    try:
        yield server.address
    finally:
        await server.stop(None)


class OpenStreams:
    """Streams through a router's lifecycle, each held open (its first message in) until `close`."""

    def __init__(self, lifecycle: RequestLifecycle) -> None:
        self.lifecycle = lifecycle
        self.tasks: list[asyncio.Task[None]] = []

    async def open(self, msg: pb.GenerateRequest, metadata: dict[str, str] | None = None) -> None:
        """Returns once the stream's first message is in; raises what refused it."""
        first = asyncio.get_running_loop().create_future()

        async def stream() -> None:
            try:
                async for _ in generate(self.lifecycle, msg, metadata or {}, lambda: 60.0, _nothing):
                    if not first.done():
                        first.set_result(None)
            except Exception as e:
                if not first.done():
                    first.set_exception(e)

        self.tasks.append(asyncio.create_task(stream()))
        await first

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def _nothing(ticket: Ticket) -> None:
    pass
