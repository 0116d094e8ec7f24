"""What a request holds leaves a real in-process router (gRPC and HTTP on loopback, spans kept in memory, every log
line at DEBUG) only in that request's own answer. A refusal's message that quotes the request back to its caller (a
regex or a schema that does not compile, an unknown role, a logit_bias key, ids outside the vocabulary) is
answered in full, and its span and log lines keep the message less the quote
(docs/security.md#what-pdserve-records-of-a-request)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import httpx2
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve.config import RouterConfig
from pdserve.errors import WITHHELD
from pdserve.log_setup import JsonFormatter
from pdserve.registry.memory import InMemoryPrefixIndex, InMemoryRegistry
from pdserve.telemetry import Telemetry
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc
from services.router.server import RouterServer, start_router

pytestmark = pytest.mark.timeout(60)
MODEL = "tiny-random"
PROMPT = "SECRET-CANARY-prompt my diagnosis is"
OUT_OF_VOCABULARY = 987654  # tiny-random's vocabulary is 259 ids: another tokenizer's id, that prompt's text
QUOTING_GRPC = {  # what each request quotes back to its caller -> the request
    "CANARY-regex": pb.GenerateRequest(prompt=PROMPT, sampling=pb.SamplingParams(regex="CANARY-regex([")),
    "CANARY-ref": pb.GenerateRequest(
        prompt=PROMPT, sampling=pb.SamplingParams(json_schema=json.dumps({"$ref": "#/CANARY-ref"}))
    ),
    "CANARY-role": pb.GenerateRequest(messages=[pb.ChatMessage(role="CANARY-role", content=PROMPT)]),
    str(OUT_OF_VOCABULARY): pb.GenerateRequest(prompt_token_ids=[5, OUT_OF_VOCABULARY]),
}
REF = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/CANARY-ref"}}}
QUOTING_HTTP = {  # (path, body past the model)
    "CANARY-regex": ("/v1/completions", {"prompt": PROMPT, "regex": "CANARY-regex(["}),
    "CANARY-ref": ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "response_format": REF}),
    "CANARY-role": ("/v1/chat/completions", {"messages": [{"role": "CANARY-role", "content": PROMPT}]}),
    "CANARY-key": ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"CANARY-key": 1}}),
    str(OUT_OF_VOCABULARY): ("/v1/completions", {"prompt": [[7, OUT_OF_VOCABULARY], [5, 6]]}),  # two: each checked
}


@asynccontextmanager
async def serving(**config: object) -> AsyncIterator[RouterServer]:
    """A router without workers (a request past its checks waits 0.1 s for one, then 503), its spans in `.exporter`."""
    exporter = InMemorySpanExporter()
    telemetry = Telemetry("pdserve-router", SimpleSpanProcessor(exporter))
    settings = RouterConfig(no_workers_wait_s=0.1, **config)  # type: ignore[arg-type]
    server, _ = await start_router(
        MODEL, InMemoryRegistry(), InMemoryPrefixIndex(), settings, "127.0.0.1", 0, telemetry, http_port=0
    )
    server.exporter = exporter  # type: ignore[attr-defined]
    try:
        yield server
    finally:
        await server.stop(None)
        telemetry.shutdown()


@pytest.fixture
async def router():
    async with serving() as server:
        yield server


def recorded(exporter: InMemorySpanExporter, caplog: pytest.LogCaptureFixture) -> str:
    """Every span's attributes, events and status, and every log line as the router writes it."""
    spans = [
        f"{s.name} {dict(s.attributes or {})} {[(e.name, dict(e.attributes or {})) for e in s.events]} "
        f"{s.status.description}"
        for s in exporter.get_finished_spans()
    ]
    return "\n".join(spans + [JsonFormatter().format(r) for r in caplog.records])


async def test_a_refusal_quoting_the_request_is_answered_whole_and_recorded_without_the_quote(router, caplog):
    caplog.set_level(logging.DEBUG)
    answers = {}
    async with grpc.aio.insecure_channel(router.address) as ch:
        for quote, request in QUOTING_GRPC.items():
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in generate_pb2_grpc.GenerationStub(ch).Generate(request, timeout=10):
                    pass
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            answers[f"gRPC {quote}"] = refused.value.details()
    async with httpx2.AsyncClient(base_url=f"http://{router.http.address}", timeout=10) as http:
        for quote, (path, body) in QUOTING_HTTP.items():
            r = await http.post(path, json={"model": MODEL, "max_tokens": 4} | body)
            assert r.status_code == 400, r.text
            answers[f"HTTP {quote}"] = r.json()["error"]["message"]
    for asked, message in answers.items():
        assert asked.split()[1] in message, (asked, message)  # the caller is told what it sent
    kept = recorded(router.exporter, caplog)
    for quote in (*QUOTING_GRPC, *QUOTING_HTTP, "CANARY"):
        assert quote not in kept, (quote, [line for line in kept.splitlines() if quote in line])
    assert kept.count(WITHHELD) >= len(QUOTING_GRPC) + len(QUOTING_HTTP) - 2  # the ids' are counted instead
    assert "1 ids are outside the vocabulary [0, 259)" in kept


@pytest.mark.parametrize("traced", [False, True])
async def test_the_http_bodys_user_is_on_the_span_only_where_the_router_says_so(traced, caplog):
    """An end user's id, which OpenTelemetry's registry marks as personal data: `enduser.id` with the router's
    `trace_enduser_id`, else read and dropped (not in any span or log line). OpenAI split `user` into
    `safety_identifier`, the end user's id where a client sends both, and `prompt_cache_key`, never recorded."""
    caplog.set_level(logging.DEBUG)
    ids = (
        {"user": "CANARY-user"},
        {"user": "CANARY-old", "safety_identifier": "CANARY-user", "prompt_cache_key": "CANARY-cache-key"},
    )
    async with serving(trace_enduser_id=traced) as router:
        async with httpx2.AsyncClient(base_url=f"http://{router.http.address}", timeout=10) as http:
            for stream, given in zip((False, True), ids, strict=True):
                body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": stream, **given}
                assert (await http.post("/v1/completions", json=body)).status_code == 503  # no worker: placed nowhere
        spans = [s for s in router.exporter.get_finished_spans() if s.name == "POST /v1/completions"]
        kept = recorded(router.exporter, caplog)
    assert len(spans) == 2
    assert [(s.attributes or {}).get("enduser.id") for s in spans] == ["CANARY-user" if traced else None] * 2
    assert kept.count("CANARY-user") == (2 if traced else 0) and "CANARY-prompt" not in kept
    assert "CANARY-old" not in kept and "CANARY-cache-key" not in kept
