"""A completions batch (`prompt` as a list of prompts) through the real ASGI app, lifecycle and LocalQuotas, and a
stand-in decode worker that answers each prompt with its own tokens: one choice per prompt × n, in OpenAI's and
vLLM's order, each prompt's usage counted once, every prompt checked and charged before any choice runs."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx2
import pytest

from pdserve.env import CLUSTER_SECRET_VAR
from pdserve.security.api_keys import KeyTable, Tenant, digest
from pdserve.v1 import generate_pb2 as pb
from services.router.http.app import openai_app
from services.router.lifecycle import RequestLifecycle
from tests.unit.router.router_builder import MODEL, Router, worker
from tests.unit.router.stand_in_decode import StandInDecode, serving

pytestmark = pytest.mark.timeout(60)
KEY = "batch-key"
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]  # 4 and 6 tokens


class EchoesItsPrompt(StandInDecode):
    """Each token is the prompt's last id plus its place, its text the id: each prompt's choices are told apart."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, list[int], int]] = []  # each call's client id, prompt and seed

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
        self.calls += 1
        self.seen.append((request.client_request_id, list(request.prompt_token_ids), request.sampling.seed))
        n = request.sampling.max_tokens
        for i in range(n):
            finish = pb.FINISH_REASON_LENGTH if i == n - 1 else pb.FINISH_REASON_UNSPECIFIED
            token = request.prompt_token_ids[-1] + i
            yield pb.GenerateResponse(token_ids=[token], text=f"<{token}>", finish_reason=finish)


@pytest.fixture
async def decode(monkeypatch) -> AsyncIterator[tuple[EchoesItsPrompt, str]]:
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    stand_in = EchoesItsPrompt()
    async with serving(stand_in) as address:
        yield stand_in, address


def lifecycle(address: str, tenant: Tenant | None = None) -> RequestLifecycle:
    router = Router([worker("p0"), worker("d0", "decode", address=address)])
    return router.lifecycle(KeyTable({digest(KEY): tenant or Tenant("team", "k")}))


async def complete(lc: RequestLifecycle, **body: object) -> httpx2.Response:
    transport = httpx2.ASGITransport(app=openai_app(lc))
    body = {"model": MODEL, "prompt": PROMPTS, "max_tokens": 3, "ignore_eos": True} | body
    headers = {"authorization": f"Bearer {KEY}", "x-request-id": "r"}
    async with httpx2.AsyncClient(transport=transport, base_url="http://router", timeout=30) as http:
        return await http.post("/v1/completions", json=body, headers=headers)


def events(r: httpx2.Response) -> list[dict]:
    lines = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


async def test_a_batch_has_each_prompts_n_choices_in_order_and_each_prompt_counted_once_in_usage(decode):
    stand_in, address = decode
    lc = lifecycle(address)
    whole = await complete(lc, n=2, seed=7)
    assert whole.status_code == 200, whole.text
    expected = ["<8><9><10>", "<8><9><10>", "<14><15><16>", "<14><15><16>"]
    choices = whole.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["text"] for c in choices] == expected
    usage = whole.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (10, 12, 22)
    # Choice i is prompt i // n's, with its own id; choice j of each prompt takes seed + j, as that prompt alone.
    assert sorted(stand_in.seen) == [
        ("r-0", PROMPTS[0], 7),
        ("r-1", PROMPTS[0], 8),
        ("r-2", PROMPTS[1], 7),
        ("r-3", PROMPTS[1], 8),
    ]
    streamed = await complete(lc, n=2, seed=7, stream=True, stream_options={"include_usage": True})
    chunks = events(streamed)
    texts = ["".join(c["choices"][0]["text"] for c in chunks[:-1] if c["choices"][0]["index"] == i) for i in range(4)]
    assert texts == expected
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == 10
    assert chunks[-1]["usage"]["completion_tokens"] == 12 and lc.in_flight == 0


async def test_a_batch_of_text_prompts_echoes_each_its_own(decode):
    _, address = decode
    r = await complete(lifecycle(address), prompt=["Once upon", "a time"], echo=True, max_tokens=1)
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in r.json()["choices"]]
    assert texts[0].startswith("Once upon") and texts[1].startswith("a time"), texts


@pytest.mark.parametrize("stream", [False, True])
async def test_a_bad_prompt_anywhere_in_a_batch_is_a_400_naming_its_index_before_any_choice_runs(decode, stream):
    """Found once prompt 0's choices had streamed, it could only have broken the stream."""
    stand_in, address = decode
    lc = lifecycle(address)
    r = await complete(lc, prompt=[[5, 6], [7, 10**6]], stream=stream)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt" and error["message"].startswith("prompt: prompt 1: ids [1000000]"), error
    assert stand_in.calls == 0 and lc.in_flight == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_a_prompt_no_worker_could_hold_is_a_400_naming_its_index_before_any_choice_runs(decode, stream):
    """A later prompt past the largest decode worker's KV (a worker's limit, not the model's) was found only when
    its own choice was placed, once prompt 0's had streamed or run to its end."""
    stand_in, address = decode
    router = Router([worker("p0"), worker("d0", "decode", address=address, kv_blocks_total=8, kv_blocks_free=8)])
    lc = router.lifecycle(KeyTable({digest(KEY): Tenant("team", "k")}))
    r = await complete(lc, prompt=[PROMPTS[0], list(range(5, 205))], stream=stream)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt" and error["message"].startswith("prompt: prompt 1: the prompt (200 tokens)")
    assert stand_in.calls == 0 and lc.in_flight == 0


async def test_a_batch_is_charged_every_prompts_tokens_by_its_first_choice(decode):
    """4 + 97 and 100 + 97 tokens: 298 in all, past a key of 250 a minute, though the first prompt's cost times
    the choices (202) is not: a 400 naming `prompt` before any choice runs, not a later prompt's 429 once the
    first streamed. A batch the key holds is charged all of it: nothing is left for a third request."""
    stand_in, address = decode
    lc = lifecycle(address, Tenant("team", "k", tokens_per_minute=250))
    refused = await complete(lc, prompt=[PROMPTS[0], list(range(5, 105))], max_tokens=97)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "prompt" and "2 choices (2 prompts, n=1 each)" in error["message"], error
    assert "are 298," in error["message"] and stand_in.calls == 0
    fits = await complete(lc, prompt=[PROMPTS[0], PROMPTS[0]], max_tokens=100)  # 2 × 104 of 250
    assert fits.status_code == 200 and len(fits.json()["choices"]) == 2, fits.text
    assert (await complete(lc, prompt=PROMPTS[0], max_tokens=100)).status_code == 429  # 42 left


async def test_a_batch_past_the_keys_streams_is_a_400_naming_prompt(decode):
    stand_in, address = decode
    r = await complete(lifecycle(address, Tenant("team", "k", max_concurrent=3)), n=2)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt" and error["message"].startswith("prompt: 4 choices (2 prompts, n=2 each)")
    assert stand_in.calls == 0
