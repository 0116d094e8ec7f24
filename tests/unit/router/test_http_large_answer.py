"""A large whole HTTP answer leaves the router's loop running: 16 choices of an echoed prompt with 20 alternatives a
token, through the real ASGI app and lifecycle and a stand-in decode worker over gRPC. Each choice's echoed prompt's
alternatives were decoded on the loop, and the 28 MB of JSON encoded in one `json.dumps` there, which stalled every
other stream of the router 0.6-0.9 s (tiny-random, a 4000-token prompt)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import httpx2
import pytest

from pdserve.env import CLUSTER_SECRET_VAR
from pdserve.security.api_keys import KeyTable, Tenant, digest
from pdserve.v1 import generate_pb2 as pb
from services.router.http.app import openai_app
from services.router.lifecycle import RequestLifecycle
from tests.loop_gaps import longest_loop_gap
from tests.unit.router.router_builder import MODEL, Router, worker
from tests.unit.router.stand_in_decode import StandInDecode, serving

pytestmark = pytest.mark.timeout(120)
KEY = "echo-key"
PROMPT = [5 + i % 250 for i in range(4000)]
CHOICES, ALTERNATIVES = 16, 20


class EchoesLogprobs(StandInDecode):
    """Answers each call with one token and the prompt's log probabilities, 20 alternatives each: the message is
    built once, so that making it costs this process's loop nothing while the router's is measured."""

    def __init__(self) -> None:
        super().__init__()
        top = pb.TokenLogprobs(
            logprob=-1.0, top_token_ids=range(3, 3 + ALTERNATIVES), top_logprobs=[-2.0] * ALTERNATIVES
        )
        self.answer = pb.GenerateResponse(
            token_ids=[7],
            text="x",
            logprobs=[top],
            prompt_logprobs=[top] * (len(PROMPT) - 1),
            finish_reason=pb.FINISH_REASON_LENGTH,
            usage=pb.Usage(prompt_tokens=len(PROMPT), completion_tokens=1),
        )

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
        self.calls += 1
        yield self.answer


@pytest.fixture
async def lifecycle(monkeypatch) -> AsyncIterator[RequestLifecycle]:
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    async with serving(EchoesLogprobs()) as address:
        router = Router([worker("p0"), worker("d0", "decode", address=address)])
        yield router.lifecycle(KeyTable({digest(KEY): Tenant("team", "k")}))


async def test_sixteen_echoed_prompts_with_their_alternatives_leave_the_loop_running(lifecycle):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "n": CHOICES, "echo": True, "logprobs": ALTERNATIVES}

    async def ask() -> httpx2.Response:
        transport = httpx2.ASGITransport(app=openai_app(lifecycle))
        async with httpx2.AsyncClient(transport=transport, base_url="http://router", timeout=60) as http:
            return await http.post("/v1/completions", json=body, headers={"authorization": f"Bearer {KEY}"})

    gap, answer = await longest_loop_gap(ask)
    assert answer.status_code == 200, answer.text[:300]
    whole = answer.json()
    assert [c["index"] for c in whole["choices"]] == list(range(CHOICES))
    assert all(len(c["logprobs"]["top_logprobs"]) == len(PROMPT) + 1 for c in whole["choices"])  # prompt and token
    start = time.perf_counter()
    json.dumps(whole, ensure_ascii=False)  # what one encoding of it all, as the loop ran it, takes on this machine
    whole_s = time.perf_counter() - start
    assert gap < 0.6 * whole_s, f"the loop stalled {gap:.3f} s; the answer encodes in {whole_s:.3f} s"
