"""A key's tokens_per_minute through a real lifecycle against stand-in decode workers on real gRPC servers: a request
every worker refused before its first message (a full batch: RESOURCE_EXHAUSTED, a retry may succeed) leaves the
key's tokens as they were, so retrying as told is not refused for them; a request served, lost after its first
message, or failed for its own fault (an output its constraint could not be held to), spends them."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import httpx2
import pytest

from pdserve.env import CLUSTER_SECRET_VAR
from pdserve.errors import InvalidRequestError, OverloadedError, UnavailableError
from pdserve.protocol.compatibility import WORKER_FEATURES
from pdserve.security.api_keys import KeyTable, Tenant, digest
from pdserve.security.quotas import LocalQuotas
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import worker_pb2 as wpb
from services.router.generation import generate
from services.router.http.app import openai_app
from services.router.ticket import Ticket
from tests.unit.router.router_builder import MODEL, Router, worker
from tests.unit.router.stand_in_decode import StandInDecode, serving

pytestmark = pytest.mark.timeout(60)
KEY = {"authorization": "Bearer k1"}
REQUEST = pb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=pb.SamplingParams(max_tokens=297))  # 300 tokens


class Decode(StandInDecode):
    """Refuses every hand-off as a decode worker whose batch is full does (`mode` "full"), serves it ("serves"),
    sends one token and is lost ("breaks"), or sends all but the last token and fails the request's constraint
    ("unheld")."""

    def __init__(self) -> None:
        super().__init__()
        self.mode = "full"

    async def Generate(  # noqa: N802
        self, request: wpb.WorkerGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        if self.mode == "serves":
            async for msg in super().Generate(request, context):
                yield msg
            return
        self.calls += 1
        if self.mode == "unheld":  # as a worker whose grammar ran past its limits late in the output
            for _ in range(request.sampling.max_tokens - 1):
                yield pb.GenerateResponse(token_ids=[3])
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sampling.regex: the output could not be held to it")
        if self.mode == "breaks":
            yield pb.GenerateResponse(token_ids=[3])
            await context.abort(grpc.StatusCode.UNAVAILABLE, "lost")
        context.set_trailing_metadata((("grpc-retry-pushback-ms", "200"),))
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "its batch is full (4 sequences, max_num_seqs 4)")


async def test_a_request_refused_by_every_worker_spends_none_of_its_keys_tokens() -> None:
    async def admitted(ticket: Ticket) -> None:
        pass

    decode = Decode()
    async with serving(decode) as address:
        router = Router([worker("p0"), worker("d0", "decode", address=address)], migration_limit=0)
        tenant = Tenant("team", "k", tokens_per_minute=1000)
        lifecycle = router.lifecycle(KeyTable({digest("k1"): tenant}), quotas=LocalQuotas())
        for _ in range(4):  # 1200 tokens asked in all: the fourth is refused for the key's tokens unless refunded
            with pytest.raises(OverloadedError, match="batch is full"):
                async for _ in generate(lifecycle, REQUEST, KEY, lambda: 10.0, admitted):
                    pass
        assert decode.calls == 4
        decode.mode = "serves"
        assert len([m async for m in generate(lifecycle, REQUEST, KEY, lambda: 10.0, admitted)]) == 297
        decode.mode = "breaks"
        for _ in range(2):  # a message reached the caller: lost after it, the request spent its tokens too
            with pytest.raises(UnavailableError, match="lost"):
                async for _ in generate(lifecycle, REQUEST, KEY, lambda: 10.0, admitted):
                    pass
        with pytest.raises(OverloadedError, match="tokens_per_minute"):
            async for _ in generate(lifecycle, REQUEST, KEY, lambda: 10.0, admitted):
                pass


async def test_a_request_no_worker_can_hold_is_invalid_before_the_keys_tokens_are_counted() -> None:
    """A 429 for the key's tokens would send the caller to wait for a retry that can only be refused 400."""

    async def admitted(ticket: Ticket) -> None:
        pass

    decode = Decode()
    decode.mode = "serves"
    async with serving(decode) as address:
        small = worker("d0", "decode", address=address, kv_blocks_total=30, kv_blocks_free=30)  # 480 tokens
        lifecycle = Router([worker("p0"), small]).lifecycle(
            KeyTable({digest("k1"): Tenant("team", "k", tokens_per_minute=1000)}), quotas=LocalQuotas()
        )
        for _ in range(3):  # 900 of the key's 1000 tokens spent
            assert len([m async for m in generate(lifecycle, REQUEST, KEY, lambda: 10.0, admitted)]) == 297
        too_big = pb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=pb.SamplingParams(max_tokens=597))
        with pytest.raises(InvalidRequestError, match="38 KV blocks; the largest worker has 30"):
            async for _ in generate(lifecycle, too_big, KEY, lambda: 10.0, admitted):
                pass


async def test_a_whole_http_answer_lost_after_its_first_token_gives_back_its_keys_tokens(monkeypatch) -> None:
    """A non-streamed answer delivers nothing before its end: a 503 (a retry may succeed) leaves the key's tokens
    as they were, as it does for a request of several choices."""
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    decode = Decode()
    decode.mode = "breaks"
    async with serving(decode) as address:
        router = Router([worker("p0"), worker("d0", "decode", address=address)], migration_limit=0)
        lifecycle = router.lifecycle(KeyTable({digest("k1"): Tenant("team", "k", tokens_per_minute=1000)}))
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 297}  # 300 tokens
        transport = httpx2.ASGITransport(app=openai_app(lifecycle))
        async with httpx2.AsyncClient(transport=transport, base_url="http://router", timeout=30) as http:
            for _ in range(4):  # 1200 tokens asked in all: the fourth is a 429 unless each 503 gave them back
                r = await http.post("/v1/completions", json=body, headers=KEY)
                assert r.status_code == 503, r.text
            decode.mode = "serves"
            assert (await http.post("/v1/completions", json=body, headers=KEY)).status_code == 200


async def test_a_whole_http_answer_its_constraint_failed_late_keeps_its_keys_tokens_spent(monkeypatch) -> None:
    """The caller's own fault (a 400), after the cluster generated its tokens: given back, a key could have its
    requests generate up to max_tokens and fail, again and again, its tokens_per_minute never spent."""
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    decode = Decode()
    decode.mode = "unheld"
    async with serving(decode) as address:
        workers = [
            worker(w, role, address=address, features=WORKER_FEATURES)
            for w, role in (("p0", "prefill"), ("d0", "decode"))
        ]
        router = Router(workers, migration_limit=0)
        lifecycle = router.lifecycle(KeyTable({digest("k1"): Tenant("team", "k", tokens_per_minute=1000)}))
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 297, "regex": "[a-z]+"}  # 300 tokens
        transport = httpx2.ASGITransport(app=openai_app(lifecycle))
        async with httpx2.AsyncClient(transport=transport, base_url="http://router", timeout=30) as http:
            for _ in range(3):  # 900 of the key's 1000 tokens spent, 296 generated for each
                r = await http.post("/v1/completions", json=body, headers=KEY)
                assert r.status_code == 400 and "could not be held" in r.text, r.text
            r = await http.post("/v1/completions", json=body, headers=KEY)
    assert r.status_code == 429 and "tokens_per_minute" in r.text, r.text
    assert decode.calls == 3
