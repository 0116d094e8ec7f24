"""Calls into a cluster that serves TLS and requires API keys: one stream's messages, or the status it ended
with (and its trailers), and its workers' KV state, as a test sees them."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc

from pdserve.rpc.credentials import ClientCredentials
from pdserve.rpc.errors import retry_after_ms
from pdserve.rpc.server import channel
from pdserve.v1 import admin_pb2, admin_pb2_grpc, generate_pb2_grpc
from pdserve.v1 import generate_pb2 as pb
from tests.integration.worker_view import idle


@dataclass
class Answer:
    code: grpc.StatusCode = grpc.StatusCode.OK
    details: str = ""
    retry_after_ms: int | None = None
    token_ids: list[int] = field(default_factory=list)
    usage: pb.Usage | None = None


async def ask(address: str, creds: ClientCredentials, request: pb.GenerateRequest, timeout_s: float = 60) -> Answer:
    answer = Answer()
    async with channel(address, credentials=creds) as ch:
        call = generate_pb2_grpc.GenerationStub(ch).Generate(request, timeout=timeout_s, metadata=creds.metadata())
        try:
            async for msg in call:
                answer.token_ids += msg.token_ids
                if msg.HasField("usage"):
                    answer.usage = msg.usage
        except grpc.aio.AioRpcError as e:
            answer.code, answer.details = e.code(), e.details() or ""
            answer.retry_after_ms = retry_after_ms(e.trailing_metadata())
    return answer


def ask_sync(address: str, creds: ClientCredentials, request: pb.GenerateRequest) -> Answer:
    return asyncio.run(ask(address, creds, request))


async def cluster_status(address: str, creds: ClientCredentials) -> admin_pb2.ClusterStatusResponse:
    async with channel(address, credentials=creds) as ch:
        stub = admin_pb2_grpc.AdminStub(ch)
        return await stub.ClusterStatus(admin_pb2.ClusterStatusRequest(), timeout=5, metadata=creds.metadata())


async def all_blocks_free(address: str, admin: ClientCredentials, timeout_s: float = 15) -> None:
    """Returns once every worker is SERVING and idle (no KV block held, nothing queued) by a report made after this
    call (an older one may predate the last request's blocks and a newer one still count them); fails past
    `timeout_s`."""
    called_at = time.monotonic()
    deadline = called_at + timeout_s

    def free(w: admin_pb2.WorkerStatus) -> bool:
        return idle(w) and w.health == "SERVING" and time.monotonic() - w.state_age_s > called_at

    while True:
        workers = (await cluster_status(address, admin)).workers
        if all(free(w) for w in workers) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    assert all(free(w) for w in workers), workers


async def decode_state(address: str, admin: ClientCredentials, since: float) -> tuple[int, int, bool]:
    """(free KV blocks, running sequences) of the cluster's one decode worker as its last heartbeat reported them, and
    whether that report came after `since` (time.monotonic())."""
    (decode,) = [w for w in (await cluster_status(address, admin)).workers if w.role == "decode"]
    fresh = time.monotonic() - decode.state_age_s > since
    return decode.kv_blocks_total - decode.kv_blocks_used, decode.running, fresh
