"""The HTTP API's routes besides generation, as the `openai` SDK reads them: a model by id, and paths or methods
the API does not have answered in OpenAI's error shape."""

from __future__ import annotations

import httpx2

from services.router.http.app import openai_app
from tests.unit.router.router_builder import MODEL, Router, worker


async def get(path: str, **decode: object) -> httpx2.Response:
    app = openai_app(Router([worker("p0"), worker("d0", "decode", **decode)]).lifecycle())
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://router") as http:
        return await http.get(path)


async def test_the_served_model_is_retrieved_by_id_and_another_is_model_not_found():
    served = await get(f"/v1/models/{MODEL}")
    assert served.status_code == 200 and served.json()["id"] == MODEL and served.json()["object"] == "model"
    context = Router([worker("p0")]).lifecycle().model.max_position_embeddings
    assert served.json()["max_model_len"] == context > 0  # vLLM's: how long a prompt and its answer may be
    other = await get("/v1/models/gpt-4o")
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
    assert other.json()["error"]["type"] == "invalid_request_error"  # OpenAI's: no not_found_error type


async def test_max_model_len_is_what_the_largest_decode_workers_kv_holds_where_that_is_less_than_the_context():
    """A client sizing max_tokens by it must not be refused for KV the cluster lacks: 10 blocks of 16 hold a prompt
    and max_tokens of 161 tokens (the last sampled token takes no KV slot), not tiny-random's 4096."""
    served = await get(f"/v1/models/{MODEL}", kv_blocks_total=10, kv_blocks_free=10)
    assert served.json()["max_model_len"] == 161


async def test_the_model_list_is_served_with_a_trailing_slash_too():
    for path in ("/v1/models", "/v1/models/"):
        listed = await get(path)
        assert listed.status_code == 200 and [m["id"] for m in listed.json()["data"]] == [MODEL], path


async def test_a_path_or_method_the_api_lacks_is_an_openai_error_body():
    for path, status in (("/v1/embeddings", 404), ("/v1/chat/completions", 405)):
        response = await get(path)
        error = response.json()["error"]
        assert response.status_code == status and path in error["message"]
        assert error["type"] == "invalid_request_error"  # OpenAI's for an unknown URL too
