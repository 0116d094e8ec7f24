"""What the HTTP API generates when a request leaves max_tokens out, through the real ASGI app and lifecycle and a
stand-in decode worker that streams exactly max_tokens tokens: OpenAI's 16 for a completion, the router's
default for a chat, and neither past the router's default nor the context's room."""

from __future__ import annotations

import httpx2
import pytest

from pdserve.env import CLUSTER_SECRET_VAR
from services.router.http.app import openai_app
from tests.unit.router.router_builder import MODEL, Router, worker
from tests.unit.router.stand_in_decode import StandInDecode, serving

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def address(monkeypatch) -> str:
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    async with serving(StandInDecode()) as address:
        yield address


async def generated(address: str, path: str, body: dict[str, object], **config: object) -> int:
    """The completion tokens of one request to a router with `config`."""
    return (await usage(address, path, body, {}, **config))["completion_tokens"]


async def usage(
    address: str, path: str, body: dict[str, object], decode: dict[str, object], **config: object
) -> dict[str, int]:
    """The usage of one request to a router with `config`, its decode worker's state `decode`."""
    lifecycle = Router([worker("p0"), worker("d0", "decode", address=address, **decode)], **config).lifecycle()
    transport = httpx2.ASGITransport(app=openai_app(lifecycle))
    async with httpx2.AsyncClient(transport=transport, base_url="http://router", timeout=30) as http:
        response = await http.post(path, json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response.json()["usage"]


async def test_a_completion_gets_openais_16_and_a_chat_the_routers_default(address):
    assert await generated(address, "/v1/completions", {"prompt": [5, 6, 7]}, default_max_tokens=40) == 16
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert await generated(address, "/v1/chat/completions", chat, default_max_tokens=40) == 40


async def test_a_completions_default_is_capped_by_the_routers_and_by_the_contexts_room(address):
    assert await generated(address, "/v1/completions", {"prompt": [5, 6, 7]}, default_max_tokens=10) == 10
    context = Router([]).lifecycle().model.max_position_embeddings
    near_the_end = {"prompt": [5] * (context - 6)}
    assert await generated(address, "/v1/completions", near_the_end) == 6  # not a 400 over a max_tokens never sent


async def test_a_default_is_capped_by_the_room_in_the_largest_decode_workers_kv_too(address):
    """A KV smaller than the context bounds the default as the context does: 10 blocks of 16 hold 160 KV slots, so a
    150-token prompt gets 11 tokens (the last sampled takes no slot), a chat its room likewise, not a 400 naming a
    max_tokens never sent."""
    small = {"kv_blocks_total": 10, "kv_blocks_free": 10}
    assert (await usage(address, "/v1/completions", {"prompt": [5] * 150}, small))["completion_tokens"] == 11
    chat = {"messages": [{"role": "user", "content": "x" * 120}]}
    used = await usage(address, "/v1/chat/completions", chat, small, default_max_tokens=400)
    assert used["prompt_tokens"] > 120 and used["prompt_tokens"] + used["completion_tokens"] == 161


async def test_a_batchs_prompts_are_each_judged_with_the_default_their_kvs_room_leaves(address):
    """A completions batch is judged before any prompt runs (choices.py): with the default past the KV's room, a
    150-token prompt was a 400 there before its own admission could cap it."""
    small = {"address": address, "kv_blocks_total": 10, "kv_blocks_free": 10}
    lifecycle = Router([worker("p0"), worker("d0", "decode", **small), worker("d1", "decode", **small)]).lifecycle()
    transport = httpx2.ASGITransport(app=openai_app(lifecycle))
    async with httpx2.AsyncClient(transport=transport, base_url="http://router", timeout=30) as http:
        body = {"model": MODEL, "prompt": [[5] * 150, [5] * 155]}
        response = await http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 11 + 6
