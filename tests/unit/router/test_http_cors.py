"""CORS on the HTTP API: a page from an allowed origin reads every answer (a normal one, a stream, a 401, a 429, a
bug's 500) and the headers a client needs of it; its preflight passes without an API key while its request is still
held to one; another origin gets no Access-Control-Allow-Origin; a router without origins sends no CORS header, as
before. Real uvicorn on loopback (HttpServer), a real HTTP client, the real app and lifecycle before a stand-in
decode worker."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx2
import pytest

from pdserve.env import CLUSTER_SECRET_VAR
from pdserve.security.api_keys import KeyTable, Tenant, digest
from services.router.http.app import openai_app
from services.router.http.server import HttpServer
from services.router.lifecycle import RequestLifecycle
from tests.unit.router.router_builder import MODEL, Router, worker
from tests.unit.router.stand_in_decode import StandInDecode, serving

pytestmark = pytest.mark.timeout(60)

PAGE = "https://chat.example.com"
KEY = "k-1"
SLOW_KEY = "k-slow"  # one request in 100 s
BODY = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3}
ALLOW_ORIGIN = "access-control-allow-origin"
# The headers a page may read without their being exposed (CORS-safelisted), and those about the connection.
READABLE = {"cache-control", "content-language", "content-length", "content-type", "expires", "last-modified", "pragma"}
TRANSPORT = {"connection", "date", "server", "transfer-encoding", "vary"}
# What the browser OpenAI SDK (openai-node's buildHeaders) and a caller's own id send beside Content-Type.
SDK_HEADERS = (
    "authorization, content-type, openai-organization, openai-project, x-request-id, x-stainless-arch, "
    "x-stainless-lang, x-stainless-os, x-stainless-package-version, x-stainless-retry-count, x-stainless-runtime, "
    "x-stainless-runtime-version, x-stainless-timeout"
)


@pytest.fixture
async def decode_address(monkeypatch) -> AsyncIterator[str]:
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    async with serving(StandInDecode()) as address:
        yield address


async def served(decode_address: str, **config: object) -> tuple[HttpServer, RequestLifecycle]:
    """A router with API keys (KEY, and SLOW_KEY) and `config`, its HTTP API on a loopback port."""
    slow = Tenant("slow", "s", requests_per_second=0.01)
    keys = KeyTable({digest(KEY): Tenant("team", "k"), digest(SLOW_KEY): slow})
    lifecycle = Router([worker("p0"), worker("d0", "decode", address=decode_address)], **config).lifecycle(keys)
    server = HttpServer(openai_app(lifecycle), "127.0.0.1", 0)
    await server.start()
    return server, lifecycle


@pytest.fixture
async def http(decode_address: str) -> AsyncIterator[httpx2.AsyncClient]:
    """A client of a router that allows PAGE."""
    server, _ = await served(decode_address, http_cors_origins=(PAGE,))
    try:
        async with httpx2.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=30) as client:
            yield client
    finally:
        await server.stop()


def from_page(key: str | None = KEY, origin: str = PAGE) -> dict[str, str]:
    return {"origin": origin} | ({"authorization": f"Bearer {key}"} if key else {})


def preflight(method: str = "POST", origin: str = PAGE) -> dict[str, str]:
    """What a browser sends before a cross-origin request with a JSON body or an Authorization header: no key."""
    return {"origin": origin, "access-control-request-method": method, "access-control-request-headers": SDK_HEADERS}


def check_readable(response: httpx2.Response) -> None:
    """The page gets the answer, and may read every header the router sent with it."""
    assert response.headers.get(ALLOW_ORIGIN) == PAGE, response.headers
    assert "origin" in response.headers.get("vary", "").lower()  # a cache keeps one answer per origin
    exposed = {h.strip() for h in response.headers.get("access-control-expose-headers", "").split(",")}
    sent = {name for name in response.headers if not name.startswith("access-control-")} - READABLE - TRANSPORT
    assert sent <= exposed, f"the page cannot read {sent - exposed}"


async def test_a_preflight_passes_without_a_key_but_the_request_after_it_still_needs_one(http) -> None:
    answer = await http.options("/v1/chat/completions", headers=preflight())
    assert answer.status_code == 200, answer.text
    assert answer.headers[ALLOW_ORIGIN] == PAGE
    assert set(answer.headers["access-control-allow-methods"].split(", ")) == {"GET", "POST"}
    assert answer.headers["access-control-allow-headers"] == SDK_HEADERS  # every one the SDK sends
    assert "access-control-allow-credentials" not in answer.headers
    refused = await http.post("/v1/completions", json=BODY, headers=from_page(key=None))
    assert refused.status_code == 401, refused.text
    check_readable(refused)  # the SDK raises AuthenticationError, not a network error
    wrong = await http.get("/v1/models", headers=from_page(key="not-a-key"))
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    check_readable(wrong)


async def test_an_allowed_page_reads_a_completion_a_stream_and_the_models(http) -> None:
    whole = await http.post("/v1/completions", json=BODY, headers=from_page())
    assert whole.status_code == 200, whole.text
    assert "x-pdserve-predicted-ttft-ms" in whole.headers and "x-request-id" in whole.headers
    check_readable(whole)
    async with http.stream(
        "POST",
        "/v1/chat/completions",
        headers=from_page(),
        json={**BODY, "prompt": None, "stream": True, "messages": [{"role": "user", "content": "hi"}]},
    ) as stream:
        events = [line async for line in stream.aiter_lines() if line.startswith("data: ")]
    assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
    check_readable(stream)
    assert events[-1] == "data: [DONE]" and len(events) >= 3
    models = await http.get("/v1/models", headers=from_page())
    assert models.status_code == 200
    check_readable(models)


async def test_a_page_reads_a_shed_and_its_retry_hints(http) -> None:
    """A key's second request within 100 s is over its requests_per_second: a 429 whose Retry-After and
    retry-after-ms the SDK's retry waits for, which a page reads only where they are exposed."""
    assert (await http.post("/v1/completions", json=BODY, headers=from_page(SLOW_KEY))).status_code == 200
    shed = await http.post("/v1/completions", json=BODY, headers=from_page(SLOW_KEY))
    assert shed.status_code == 429, shed.text
    assert "retry-after" in shed.headers and "retry-after-ms" in shed.headers
    check_readable(shed)


async def test_another_origin_is_not_allowed(http) -> None:
    """CORS is no authentication: the router still answers it, but its browser keeps the answer from the page."""
    other = "https://evil.example"
    answer = await http.options("/v1/completions", headers=preflight(origin=other))
    assert answer.status_code == 400 and ALLOW_ORIGIN not in answer.headers
    served_anyway = await http.post("/v1/completions", json=BODY, headers=from_page(origin=other))
    assert served_anyway.status_code == 200 and ALLOW_ORIGIN not in served_anyway.headers
    assert (await http.options("/v1/completions", headers=preflight(method="DELETE"))).status_code == 400


async def test_without_origins_no_cors_header_is_sent(decode_address) -> None:
    server, _ = await served(decode_address)
    try:
        async with httpx2.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=30) as http:
            answers = [
                await http.post("/v1/completions", json=BODY, headers=from_page()),
                await http.post("/v1/completions", json=BODY, headers=from_page(key=None)),
                await http.options("/v1/completions", headers=preflight()),
            ]
    finally:
        await server.stop()
    assert [a.status_code for a in answers] == [200, 401, 405]  # no preflight answered: browsers send nothing
    for answer in answers:
        assert not [name for name in answer.headers if name.startswith("access-control-")], answer.headers


async def test_credentials_are_allowed_only_when_asked_and_a_drains_preflight_closes_its_connection(
    decode_address,
) -> None:
    server, lifecycle = await served(decode_address, http_cors_origins=(PAGE,), http_cors_allow_credentials=True)
    try:
        async with httpx2.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=30) as http:
            answer = await http.options("/v1/completions", headers=preflight())
            assert answer.headers["access-control-allow-credentials"] == "true"
            assert answer.headers[ALLOW_ORIGIN] == PAGE and "connection" not in answer.headers
            lifecycle.draining = True
            during = await http.options("/v1/completions", headers=preflight())
            refused = await http.post("/v1/completions", json=BODY, headers=from_page())
    finally:
        await server.stop()
    assert during.status_code == 200 and during.headers["connection"] == "close"  # the client retries elsewhere
    assert refused.status_code == 503 and refused.headers["connection"] == "close"
    check_readable(refused)


async def test_a_subdomain_origin_allows_every_host_under_its_domain_on_its_scheme_and_port(decode_address) -> None:
    """`https://*.preview.example.com` beside an exact origin: a branch's preview page is allowed, and answered with
    its own origin; the domain itself, a look-alike, a host that only begins so, another scheme or port are not."""
    server, _ = await served(decode_address, http_cors_origins=(PAGE, "https://*.preview.example.com"))
    allowed = ["https://pr-17.preview.example.com", "https://a.b.preview.example.com", PAGE]
    refused = [
        "https://preview.example.com",
        "https://evil-preview.example.com",
        "https://pr-17.preview.example.com.evil.net",
        "http://pr-17.preview.example.com",
        "https://pr-17.preview.example.com:8443",
        "https://pr-17.chat.example.com",
    ]
    try:
        async with httpx2.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=30) as http:
            answers = {
                origin: (
                    await http.options("/v1/completions", headers=preflight(origin=origin)),
                    await http.get("/v1/models", headers=from_page(origin=origin)),
                )
                for origin in allowed + refused
            }
    finally:
        await server.stop()
    for origin in allowed:
        asked, got = answers[origin]
        assert asked.status_code == 200 and asked.headers[ALLOW_ORIGIN] == origin, (origin, asked.headers)
        assert got.status_code == 200 and got.headers[ALLOW_ORIGIN] == origin, (origin, got.headers)
    for origin in refused:
        asked, got = answers[origin]
        assert asked.status_code == 400 and ALLOW_ORIGIN not in asked.headers, origin
        assert got.status_code == 200 and ALLOW_ORIGIN not in got.headers, origin


async def test_a_bugs_500_is_readable_too(decode_address) -> None:
    """Starlette's error middleware answers an exception no handler caught; CORS wraps it as well."""
    server, lifecycle = await served(decode_address, http_cors_origins=("*",))

    def broken() -> int:
        raise RuntimeError("a bug")

    lifecycle.placement.kv_capacity_tokens = broken  # type: ignore[method-assign]
    try:
        async with httpx2.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=30) as http:
            answer = await http.get("/v1/models", headers=from_page())
    finally:
        await server.stop()
    assert answer.status_code == 500
    assert answer.headers[ALLOW_ORIGIN] == "*"
