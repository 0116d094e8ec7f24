"""A known key's request is charged one of its requests_per_second before its body is parsed, so a key past its
rate costs the router no parse (a 16 MiB body holds the event loop ~40 ms): its next request, whose body would not
parse, is refused for the rate (RESOURCE_EXHAUSTED with its retry hint, HTTP 429 with Retry-After), not for the
body, which was never read. Under the rate, the same body is refused naming what is wrong, and that request has
used its token. Through a real gRPC server (the router's interceptors) and the real HTTP app."""

from __future__ import annotations

import grpc
import httpx2
import pytest

from pdserve.env import CLUSTER_SECRET_VAR
from pdserve.rpc.errors import RETRY_PUSHBACK_KEY
from pdserve.rpc.server import Server
from pdserve.security.api_keys import KeyTable, Tenant, digest
from pdserve.security.quotas import LocalQuotas
from pdserve.telemetry import Telemetry
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc
from services.router.http.app import openai_app
from services.router.lifecycle import RequestLifecycle
from services.router.parse_after_key import ParseAfterKeyCheck
from services.router.servicer import GENERATE_METHOD, GenerationServicer
from tests.unit.router.request_counts import requests_by_outcome
from tests.unit.router.router_builder import MODEL, Router, worker
from tests.unit.router.stand_in_decode import StandInDecode, serving

pytestmark = pytest.mark.timeout(60)
SLOW = Tenant("team", "slow", requests_per_second=0.01)  # a burst of one, the next 100 s away


def lifecycle(telemetry: Telemetry | None = None) -> RequestLifecycle:
    keys = KeyTable({digest("slow"): SLOW, digest("other"): Tenant("team-b", "other")})
    return Router([], no_workers_wait_s=0.1).lifecycle(keys, telemetry=telemetry)


async def test_a_grpc_message_past_its_keys_rate_is_refused_for_the_rate_unparsed(monkeypatch) -> None:
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    telemetry = Telemetry("test-router")
    router = lifecycle(telemetry)
    server = Server("127.0.0.1", 0, checked_by_handler=[GENERATE_METHOD], inner=[ParseAfterKeyCheck([GENERATE_METHOD])])
    server.add(lambda s: generate_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(router), s), [])
    await server.start()
    good = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=2)).SerializeToString()
    malformed = good.replace(b"hi", b"\xff\xfe")  # invalid UTF-8 in a string: it does not parse
    answers = []
    try:
        async with grpc.aio.insecure_channel(server.address) as ch:
            call = ch.unary_stream(GENERATE_METHOD, request_serializer=bytes)
            for key in ("slow", "slow", "other"):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    async for _ in call(malformed, metadata=(("authorization", f"Bearer {key}"),)):
                        pass
                e = caught.value
                answers.append((e.code(), e.details(), dict(e.trailing_metadata() or ())))
    finally:
        await server.stop(None)
    (code, details, _), (over, over_details, trailers), (other, _, _) = answers
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("request: the message does not parse")
    assert over == grpc.StatusCode.RESOURCE_EXHAUSTED and "requests_per_second" in over_details, over_details
    assert 1000 < int(trailers[RETRY_PUSHBACK_KEY]) <= 100_000  # when the bucket has the next request
    assert other == grpc.StatusCode.INVALID_ARGUMENT  # another key's rate is its own
    counted = requests_by_outcome(telemetry)
    assert counted == {("invalid", "team"): 1, ("rejected", "team"): 1, ("invalid", "team-b"): 1}
    telemetry.shutdown()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_an_http_body_past_its_keys_rate_is_a_429_unparsed(path: str) -> None:
    transport = httpx2.ASGITransport(app=openai_app(lifecycle()), raise_app_exceptions=False)
    headers = {"authorization": "Bearer slow", "content-type": "application/json"}
    async with httpx2.AsyncClient(transport=transport, base_url="http://router") as http:
        bad = await http.post(path, content=b"{not json", headers=headers)
        over = await http.post(path, content=b"{not json", headers=headers)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "body", bad.text
    assert over.status_code == 429, over.text
    error = over.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    assert "requests_per_second" in error["message"]
    assert 1 < int(over.headers["retry-after"]) <= 100 and 1000 < int(over.headers["retry-after-ms"]) <= 100_000


async def test_each_http_choice_is_charged_one_request_the_first_before_its_body_is_read(monkeypatch) -> None:
    """n = 2 from a key with a burst of two and a clock that never refills it: the first choice uses the request
    charged before the body was read (charged again, the second choice would be refused), the second is charged
    its own (not charged, the next request's body would be read, and refused as no JSON)."""
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    async with serving(StandInDecode()) as d0:
        router = Router([worker("p0"), worker("d0", "decode", address=d0)])
        pair = Tenant("team", "pair", requests_per_second=2)
        lc = router.lifecycle(KeyTable({digest("pair"): pair}), quotas=LocalQuotas(clock=lambda: 0.0))
        transport = httpx2.ASGITransport(app=openai_app(lc))
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2, "n": 2}
        async with httpx2.AsyncClient(transport=transport, base_url="http://router", timeout=30) as http:
            both = await http.post("/v1/completions", json=body, headers={"authorization": "Bearer pair"})
            headers = {"authorization": "Bearer pair", "content-type": "application/json"}
            next_one = await http.post("/v1/completions", content=b"{not json", headers=headers)
    assert both.status_code == 200 and len(both.json()["choices"]) == 2, both.text
    assert next_one.status_code == 429 and "requests_per_second" in next_one.json()["error"]["message"]


async def test_a_draining_routers_refusal_leaves_the_keys_rate_untaken(monkeypatch) -> None:
    """A draining router's 503 / UNAVAILABLE says: retry on another replica. With quotas shared in Redis that
    retry meets the same bucket, so the refusal must not have taken the key's request (here: its only one)."""
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    router = lifecycle()
    server = Server("127.0.0.1", 0, checked_by_handler=[GENERATE_METHOD], inner=[ParseAfterKeyCheck([GENERATE_METHOD])])
    server.add(lambda s: generate_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(router), s), [])
    await server.start()
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    headers = {"authorization": "Bearer slow"}
    transport = httpx2.ASGITransport(app=openai_app(router), raise_app_exceptions=False)
    request = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=2))
    try:
        async with (
            httpx2.AsyncClient(transport=transport, base_url="http://router") as http,
            grpc.aio.insecure_channel(server.address) as ch,
        ):
            generate = generate_pb2_grpc.GenerationStub(ch).Generate
            router.draining = True
            assert (await http.post("/v1/completions", json=body, headers=headers)).status_code == 503
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in generate(request, metadata=(("authorization", "Bearer slow"),)):
                    pass
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value.details()
            router.draining = False
            taken = await http.post("/v1/completions", content=b"{not json", headers=headers)
        assert taken.status_code == 400, taken.text  # its one request: a 429 had the refusals taken it
    finally:
        await server.stop(None)
