"""The openai backends against a real HTTP server on loopback (Starlette under uvicorn, as pdserve's API): one
connection carries request after request, a malformed event fails its request only, every chat chunk with a
choice is timed, a shed's time to reject counts from its send, and TLS (with a client certificate) uses the
credentials given."""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from loadgen import metrics
from loadgen.client import Client
from loadgen.openai_backend import OpenAIBackend
from loadgen.record import CLIENT_ERROR, OK, REJECTED
from loadgen.workload import Request
from pdserve.rpc.credentials import ClientCredentials
from tests.certs import make_certs

GAP_S = 0.02  # between two chunks


def sse(chunk: dict[str, Any] | str) -> bytes:
    return b"data: " + (chunk if isinstance(chunk, str) else json.dumps(chunk)).encode() + b"\n\n"


class FakeServer:
    """Streams `chunks(body)` for each request, GAP_S apart, then the usage and [DONE]; records each request's
    client port (one per connection)."""

    def __init__(self, chunks: Callable[[dict[str, Any]], list[dict[str, Any] | str]], linger_s: float = 0.0) -> None:
        self.chunks = chunks
        self.linger_s = linger_s  # keeps the body open this long after [DONE], sending keep-alive comments
        self.ports: list[int] = []
        self.warm_ports: list[int] = []  # of the GETs loadgen opens its connections with

    async def completions(self, request: HttpRequest) -> StreamingResponse:
        assert request.client is not None
        self.ports.append(request.client.port)
        body = await request.json()
        chunks = self.chunks(body)

        async def events() -> AsyncIterator[bytes]:
            for chunk in chunks:
                await asyncio.sleep(GAP_S)
                yield sse(chunk)
            tokens = body.get("max_tokens") or body["max_completion_tokens"]
            yield sse({"choices": [], "usage": {"completion_tokens": tokens}})
            yield sse("[DONE]")
            for _ in range(int(self.linger_s / 0.1)):
                await asyncio.sleep(0.1)
                yield b": keep-alive\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def models(self, request: HttpRequest) -> JSONResponse:
        assert request.client is not None
        self.warm_ports.append(request.client.port)
        return JSONResponse({"object": "list", "data": []})


class SheddingServer(FakeServer):
    """Refuses every request at once, as pdserve's HTTP API sheds one under load."""

    async def completions(self, request: HttpRequest) -> JSONResponse:  # type: ignore[override]
        return JSONResponse({"error": {"message": "shed", "type": "rate_limit_error"}}, status_code=429)


@asynccontextmanager
async def serving(fake: FakeServer, **tls: Any) -> AsyncIterator[int]:
    routes = [Route(p, fake.completions, methods=["POST"]) for p in ("/v1/completions", "/v1/chat/completions")]
    routes.append(Route("/v1/models", fake.models, methods=["GET"]))
    config = uvicorn.Config(Starlette(routes=routes), host="127.0.0.1", port=0, log_level="warning", **tls)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.02)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        await task


def text_chunks(body: dict[str, Any]) -> list[dict[str, Any] | str]:
    return [{"choices": [{"index": 0, "text": "x"}]} for _ in range(body["max_tokens"])]


async def test_one_connection_carries_every_request_in_turn() -> None:
    fake = FakeServer(text_chunks)
    async with serving(fake) as port:
        client = Client(OpenAIBackend(f"http://127.0.0.1:{port}", "m"), max_concurrency=1)
        records, _ = await client.run([Request([5, 6, 7], 4, 0.0) for _ in range(8)])
    assert [r.status for r in records] == [OK] * 8
    assert len(set(fake.ports)) == 1  # no request paid for a connect


async def test_the_connections_are_open_before_the_run_so_no_request_pays_a_connect() -> None:
    """As the gRPC backend waits for its channel: over HTTP/1.1 a connection opened for a request put its connect
    (and TLS handshake) into that request's TTFT."""
    fake = FakeServer(text_chunks)
    async with serving(fake) as port:
        client = Client(OpenAIBackend(f"http://127.0.0.1:{port}", "m"), max_concurrency=8)
        records, _ = await client.run([Request([5, 6, 7], 4, 0.0) for _ in range(4)])  # all in flight together
    assert [r.status for r in records] == [OK] * 4
    assert len(fake.warm_ports) == 4  # as many as the run can have in flight: its 4 requests, under the bound of 8
    assert sorted(fake.ports) == sorted(fake.warm_ports)  # each request on a connection opened before the run


async def test_a_malformed_event_fails_its_request_and_the_others_complete() -> None:
    def chunks(body: dict[str, Any]) -> list[dict[str, Any] | str]:
        return ["{truncated"] if body["max_tokens"] == 3 else text_chunks(body)

    async with serving(FakeServer(chunks)) as port:
        client = Client(OpenAIBackend(f"http://127.0.0.1:{port}", "m"))
        records, _ = await client.run([Request([5, 6, 7], n, 0.0) for n in (4, 3, 4)])
    assert [r.status for r in records] == [OK, CLIENT_ERROR, OK]
    assert "JSONDecodeError" in records[1].error


async def test_every_chat_chunk_with_a_choice_is_timed_even_with_empty_content() -> None:
    """A chat delta's content is empty while a multi-byte character is incomplete, and on the closing chunk."""

    def chunks(body: dict[str, Any]) -> list[dict[str, Any] | str]:
        opener: dict[str, Any] = {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}  # no content field
        deltas = [{"content": ""}, {"content": "ab"}, {"content": ""}, {"content": "c"}]
        tokens = [{"choices": [{"index": 0, "delta": d}]} for d in deltas]
        closing = {"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "length"}]}
        return [opener, *tokens, closing]

    async with serving(FakeServer(chunks)) as port:
        backend = OpenAIBackend(f"http://127.0.0.1:{port}", "m", chat=True, detokenize=lambda ids: "hi")
        records, _ = await Client(backend).run([Request([5, 6, 7], 5, 0.0)])
    (record,) = records
    assert record.status == OK and record.message_tokens == [1, 1, 1, 1, 1]
    times = record.message_times_s
    assert times[0] >= 2 * GAP_S  # the opener (the first chunk) is not the first token; the empty delta after it is
    assert times[-1] - times[0] >= 3 * GAP_S  # the closing chunk ends the stream


async def test_a_sheds_time_to_reject_counts_from_its_send_as_its_ttft_would() -> None:
    """Its error_ms counted from when it took its concurrency slot, so the body's building (a chat prompt's
    detokenizing, here 0.5 s), which its TTFT would leave out, was in its time to reject."""
    build_s = 0.5

    def slow_detokenize(ids: list[int]) -> str:
        time.sleep(build_s)
        return "hi"

    async with serving(SheddingServer(text_chunks)) as port:
        backend = OpenAIBackend(f"http://127.0.0.1:{port}", "m", chat=True, detokenize=slow_detokenize)
        (record,), _ = await Client(backend).run([Request([5, 6, 7], 3, 0.0)])
    assert record.status == REJECTED and record.error_s is not None
    assert record.error_s < build_s / 2


async def test_tls_with_a_client_certificate_uses_the_credentials_given(tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
    tls = {
        "ssl_certfile": str(certs.server_cert),
        "ssl_keyfile": str(certs.server_key),
        "ssl_ca_certs": str(certs.ca),
        "ssl_cert_reqs": ssl.CERT_REQUIRED,
    }
    fake = FakeServer(text_chunks)
    async with serving(fake, **tls) as port:
        url = f"https://127.0.0.1:{port}"
        creds = ClientCredentials(str(certs.ca), str(certs.client_cert), str(certs.client_key))
        records, _ = await Client(OpenAIBackend(url, "m", credentials=creds)).run([Request([5], 4, 0.0)])
        assert records[0].status == OK and records[0].output_tokens == 4
        no_cert = ClientCredentials(str(certs.ca))  # the server requires a client certificate
        records, _ = await Client(OpenAIBackend(url, "m", credentials=no_cert)).run([Request([5], 4, 0.0)])
        assert records[0].status != OK


async def test_a_body_left_open_after_done_ends_the_request_anyway() -> None:
    async with serving(FakeServer(text_chunks, linger_s=30.0)) as port:
        client = Client(OpenAIBackend(f"http://127.0.0.1:{port}", "m"))
        records, _ = await asyncio.wait_for(client.run([Request([5, 6, 7], 4, 0.0)]), 10)
    assert records[0].status == OK and records[0].output_tokens == 4


async def test_vllms_chat_opener_is_one_more_itl_gap_and_the_usage_is_the_token_count() -> None:
    """vLLM opens a chat stream with {"role": "assistant", "content": ""}: four chunks for three tokens."""

    def chunks(body: dict[str, Any]) -> list[dict[str, Any] | str]:
        opener = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
        return [opener] + [{"choices": [{"index": 0, "delta": {"content": "a"}}]} for _ in range(3)]

    async with serving(FakeServer(chunks)) as port:
        backend = OpenAIBackend(f"http://127.0.0.1:{port}", "m", chat=True, detokenize=lambda ids: "hi")
        (record,), _ = await Client(backend).run([Request([5, 6, 7], 3, 0.0)])
    assert (record.status, record.output_tokens, len(metrics.itls_s(record))) == (OK, 3, 3)
