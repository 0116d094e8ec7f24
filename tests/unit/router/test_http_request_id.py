"""An HTTP request sent without X-Request-Id gets one id for everything that names it: the response's `id`, its
X-Request-Id header and the `request_id` of the router's log line (the `id` was a uuid of its own, which no log line
named, so a caller quoting it to an operator led nowhere). One sent with the header keeps it, streamed or not, and a
refusal carries it too, and so does every other response."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import httpx2
import pytest

from pdserve.env import CLUSTER_SECRET_VAR
from pdserve.security.api_keys import KeyTable, Tenant, digest
from services.router.http.app import generated_request_id, openai_app
from tests.unit.router.json_lines import JsonLines
from tests.unit.router.router_builder import MODEL, Router, worker
from tests.unit.router.stand_in_decode import StandInDecode, serving

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def router_log(monkeypatch) -> Iterator[JsonLines]:
    """The lifecycle's log lines at INFO as the router writes them, for a router without a cluster secret."""
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    handler, logger = JsonLines(), logging.getLogger("services.router.lifecycle")
    logger.addHandler(handler)
    monkeypatch.setattr(logger, "level", logging.INFO)
    yield handler
    logger.removeHandler(handler)


async def test_the_response_id_header_and_log_line_name_one_id(router_log: JsonLines):
    async with serving(StandInDecode()) as address:
        lifecycle = Router([worker("p0"), worker("d0", "decode", address=address)]).lifecycle()
        transport = httpx2.ASGITransport(app=openai_app(lifecycle))
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3}
        async with httpx2.AsyncClient(transport=transport, base_url="http://router", timeout=30) as http:
            plain = await http.post("/v1/completions", json=body)
            mine = {"x-request-id": "mine"}
            named = await http.post("/v1/completions", json=body | {"stream": True}, headers=mine)
    assert plain.status_code == 200 and named.status_code == 200, (plain.text, named.text)
    given = plain.headers["x-request-id"]
    assert plain.json()["id"] == f"cmpl-{given}" and len(given) == 32
    logged = [line["request_id"] for line in router_log.lines if line["msg"] == "request finished"]
    assert logged == [given, "mine"], router_log.lines
    events = [json.loads(line[6:]) for line in named.text.splitlines() if line.startswith("data: {")]
    assert named.headers["x-request-id"] == "mine" and {e["id"] for e in events} == {"cmpl-mine"}


async def test_a_refusal_after_the_body_was_read_names_the_request_too(monkeypatch):
    """Streamed or not: a refusal has no body id to quote, only the header."""
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    lifecycle = Router([worker("p0"), worker("d0", "decode", draining=True)], no_workers_wait_s=0.1).lifecycle()
    transport = httpx2.ASGITransport(app=openai_app(lifecycle))
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3}
    async with httpx2.AsyncClient(transport=transport, base_url="http://router", timeout=30) as http:
        for stream in (False, True):
            refused = await http.post("/v1/completions", json=body | {"stream": stream}, headers={"x-request-id": "r"})
            assert refused.status_code == 503 and refused.headers.get("x-request-id") == "r", (stream, refused.text)


async def test_a_refusal_before_the_request_was_read_names_it_in_the_header_and_the_log_line(router_log: JsonLines):
    """A body that does not parse, a key refused: no request was made of it, yet OpenAI's SDK reads the header
    for its error's `request_id` (it was None on every such refusal), and the operator finds the log line by it.
    An id over the limit, the refusal's reason, is not echoed."""
    lifecycle = Router([worker("p0"), worker("d0", "decode")]).lifecycle()
    transport = httpx2.ASGITransport(app=openai_app(lifecycle))
    async with httpx2.AsyncClient(transport=transport, base_url="http://router", timeout=30) as http:
        mine = await http.post("/v1/completions", content=b"{not json", headers={"x-request-id": "bad-body"})
        plain = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": "hi"})
        long_id = "x" * (lifecycle.config.request_limits.max_request_id_chars + 1)
        too_long = await http.post(
            "/v1/completions", json={"model": MODEL, "prompt": "hi"}, headers={"x-request-id": long_id}
        )
    assert [r.status_code for r in (mine, plain, too_long)] == [400, 400, 400], (mine.text, plain.text, too_long.text)
    ids = [r.headers.get("x-request-id") for r in (mine, plain, too_long)]
    assert ids[0] == "bad-body" and len(ids[1]) == 32 and len(ids[2]) == 32 and ids[2] != long_id
    logged = [line["request_id"] for line in router_log.lines if line["outcome"] == "invalid"]
    assert logged == ids, router_log.lines


def test_a_generated_id_leaves_room_for_a_choices_index_within_the_limit():
    assert len(generated_request_id(256)) == 32
    assert len(generated_request_id(10)) == 10 - len("-15")  # sixteen choices at most: -0 ... -15
    assert len(generated_request_id(1)) == 1


async def test_an_x_request_id_of_other_than_printable_ascii_is_refused_naming_it(router_log: JsonLines):
    """A UTF-8 id came back garbled in the response's `id` and the log line (the header's bytes read as Latin-1:
    `café` as `cafÃ©`), while gRPC echoed it whole: both refuse such an id now, before any choice runs, and answer
    with an id of their own, as for one too long."""
    lifecycle = Router([worker("p0"), worker("d0", "decode")]).lifecycle()
    transport = httpx2.ASGITransport(app=openai_app(lifecycle))
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3}
    async with httpx2.AsyncClient(transport=transport, base_url="http://router", timeout=30) as http:
        refused = [
            await http.post("/v1/completions", json=body | {"stream": stream}, headers={"x-request-id": given})
            for given, stream in ((b"caf\xc3\xa9-1", False), (b"caf\xc3\xa9-2", True), (b"tab\there", False))
        ]
    for response in refused:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "x-request-id" and "printable ASCII" in error["message"], error
        assert len(response.headers["x-request-id"]) == 32  # the router's own, not the caller's bytes echoed
    logged = [line["request_id"] for line in router_log.lines if line["outcome"] == "invalid"]
    assert logged == [r.headers["x-request-id"] for r in refused], router_log.lines


async def test_every_response_names_a_request_id_the_model_routes_health_and_unknown_paths_too():
    """OpenAI's responses all carry one (its SDK's `request_id`); the router's carried one on generation's alone. The
    caller's id is echoed, else one of the router's own, on a 401 too, and a page from an allowed origin reads it."""
    page = "https://chat.example.com"
    router = Router([worker("p0"), worker("d0", "decode")], http_cors_origins=(page,))
    transport = httpx2.ASGITransport(app=openai_app(router.lifecycle(KeyTable({digest("k-1"): Tenant("t", "k-1")}))))
    statuses = {"/v1/models": 200, f"/v1/models/{MODEL}": 200, "/v1/models/gpt-4o": 404, "/health": 200}
    async with httpx2.AsyncClient(transport=transport, base_url="http://router", timeout=30) as http:
        for path in [*statuses, "/v1/embeddings"]:
            for key in ({"authorization": "Bearer k-1"}, {}):
                mine = await http.get(path, headers=key | {"origin": page, "x-request-id": "mine"})
                plain = await http.get(path, headers=key | {"origin": page, "x-request-id": "x" * 257})  # too long
                assert (mine.headers.get("x-request-id"), len(plain.headers.get("x-request-id", ""))) == ("mine", 32)
                assert "x-request-id" in mine.headers["access-control-expose-headers"].split(", ")
                status = statuses.get(path, 404) if key or path == "/health" else 401 if path in statuses else 404
                assert mine.status_code == plain.status_code == status, (path, key, mine.text)
