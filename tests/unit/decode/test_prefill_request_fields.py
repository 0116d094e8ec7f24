"""What a request's tenant and priority become on their way to the engines that queue it: the decode worker's
gRPC request, its engine request, the Prefill call it makes over real gRPC, and the prefill worker's engine
request, each carrying both (a worker's waiting queue orders prompts by them: engine/fair_queue.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from pdserve.protocol.handoff import KVTarget
from pdserve.protocol.sampling import SamplingParams
from pdserve.rpc.convert import engine_request_from_pb, sampling_to_pb
from pdserve.rpc.server import Server
from pdserve.security.cluster_secret import ClusterSecret
from pdserve.telemetry import Telemetry
from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc
from services.decode.handoff import HandoffRequest
from services.decode.prefill_client import PrefillClient

pytestmark = pytest.mark.timeout(30)


class RecordingPrefill(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self) -> None:
        self.requests: list[wpb.PrefillRequest] = []

    async def Prefill(  # noqa: N802
        self, request: wpb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[wpb.PrefillEvent]:
        self.requests.append(request)
        yield wpb.PrefillEvent(first_token=wpb.FirstToken(token_id=7))


async def test_tenant_and_priority_reach_both_engines(monkeypatch):
    monkeypatch.delenv("PDSERVE_CLUSTER_SECRET", raising=False)
    forward = wpb.WorkerGenerateRequest(
        request_id="k", prompt_token_ids=[5, 6, 7], sampling=sampling_to_pb(SamplingParams(max_tokens=2)),
        tenant="team-b", priority=3,
    )  # fmt: skip
    decode_side = engine_request_from_pb(forward)
    assert (decode_side.tenant, decode_side.priority) == ("team-b", 3)
    prefill = RecordingPrefill()
    server = Server("127.0.0.1", 0, cluster=ClusterSecret())
    server.add(lambda s: worker_pb2_grpc.add_PrefillWorkerServicer_to_server(prefill, s), [])
    await server.start()
    client = PrefillClient(Telemetry("test", enabled=False))
    try:
        target = KVTarget("d0", "127.0.0.1:1", [0], 1, "fp", 16)
        call = client.prefill(server.address, HandoffRequest(decode_side, server.address), target, 5.0, 5.0)
        assert (await call.first_token()).token_id == 7
    finally:
        await client._channels.close()  # a worker keeps its channels for its life; a test closes them
        await server.stop(None)
    (sent,) = prefill.requests
    prefill_side = engine_request_from_pb(sent)
    assert (prefill_side.tenant, prefill_side.priority) == ("team-b", 3)
