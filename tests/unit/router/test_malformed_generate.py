"""A gRPC Generate whose message does not parse is answered INVALID_ARGUMENT and counted in pdserve_requests_total
as `invalid`, after the caller's key is checked, as the same mistake over HTTP is (it was answered before the
router's accounting ran, and never counted). Through a real gRPC server and lifecycle."""

from __future__ import annotations

import grpc
import pytest

from pdserve.env import CLUSTER_SECRET_VAR
from pdserve.rpc.server import Server
from pdserve.security.api_keys import KeyTable, Tenant, digest
from pdserve.telemetry import Telemetry
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc
from services.router.servicer import GENERATE_METHOD, GenerationServicer
from tests.unit.router.request_counts import requests_by_outcome
from tests.unit.router.router_builder import Router, worker
from tests.unit.router.stand_in_decode import StandInDecode, serving

pytestmark = pytest.mark.timeout(60)


async def test_a_message_that_does_not_parse_is_counted_invalid_under_its_callers_tenant(monkeypatch) -> None:
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    telemetry = Telemetry("test-router")
    async with serving(StandInDecode()) as d0:
        router = Router([worker("p0"), worker("d0", "decode", address=d0)])
        lifecycle = router.lifecycle(KeyTable({digest("k1"): Tenant("team", "k")}), telemetry=telemetry)
        server = Server("127.0.0.1", 0, checked_by_handler=[GENERATE_METHOD])
        server.add(lambda s: generate_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(lifecycle), s), [])
        await server.start()
        good = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=2)).SerializeToString()
        answers = []
        try:
            async with grpc.aio.insecure_channel(server.address) as ch:
                call = ch.unary_stream(GENERATE_METHOD, request_serializer=bytes)
                for key in ("k1", "k1", "nope"):
                    try:
                        async for _ in call(
                            good.replace(b"hi", b"\xff\xfe"), metadata=(("authorization", f"Bearer {key}"),)
                        ):
                            pass
                    except grpc.aio.AioRpcError as e:
                        answers.append((e.code(), e.details()))
        finally:
            await server.stop(None)
    assert answers[0] == (grpc.StatusCode.INVALID_ARGUMENT, answers[1][1])
    assert answers[0][1].startswith("request: the message does not parse")
    assert answers[2][0] == grpc.StatusCode.UNAUTHENTICATED  # an unknown caller learns nothing of its message
    assert requests_by_outcome(telemetry) == {("invalid", "team"): 2, ("unauthenticated", ""): 1}
    telemetry.shutdown()
