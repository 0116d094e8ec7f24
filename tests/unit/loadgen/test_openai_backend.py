"""The openai backends' request bodies and their token counting from SSE chunks and the usage chunk."""

from __future__ import annotations

import json

import httpx2
import pytest

from loadgen import metrics, openai_backend
from loadgen.openai_backend import OpenAIBackend
from loadgen.record import RequestRecord
from loadgen.workload import Request


def test_bodies_are_what_vllms_benchmark_sends():
    req = Request([5, 6, 7], 4)
    body = OpenAIBackend("http://h", "m").payload(req)
    assert body == {
        "model": "m",
        "prompt": [5, 6, 7],
        "max_tokens": 4,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chat = OpenAIBackend("http://h", "m", chat=True, slo={"ttft_ms": 100}, detokenize=lambda ids: f"t{len(ids)}")
    body = chat.payload(req)
    assert body["messages"] == [{"role": "user", "content": "t3"}] and body["max_completion_tokens"] == 4
    assert body["slo"] == {"ttft_ms": 100} and "prompt" not in body and "max_tokens" not in body


def record(tokens: list[int]) -> RequestRecord:
    r = RequestRecord("r", 3, 8, 0.0)
    r.message_times_s, r.message_tokens = [0.1 * (i + 1) for i in range(len(tokens))], list(tokens)
    return r


def test_the_usage_count_is_the_outputs_and_every_chunk_stays_one_itl_gap():
    """vLLM's chat stream opens with {"role": "assistant", "content": ""}: five chunks for four tokens. TPOT divides
    by the server's four; the ITLs are the five chunks' gaps, the last one (the slowest here) included."""
    fewer = record([1, 1, 1, 1, 1])
    fewer.message_times_s[-1] += 0.3
    fewer.reported_tokens = 4
    assert fewer.output_tokens == 4
    assert metrics.itls_s(fewer) == pytest.approx([0.1, 0.1, 0.1, 0.4])
    assert metrics.tpot_s(fewer) == pytest.approx((0.8 - 0.1) / 3)
    more = record([1, 1, 1])
    more.reported_tokens = 5  # a server that packed tokens into chunks
    assert (more.output_tokens, len(metrics.itls_s(more))) == (5, 2)
    assert record([1, 1]).output_tokens == 2  # no usage chunk: one token per chunk stands


async def stream_of(events: list[dict]) -> RequestRecord:
    """One request through the backend against a server that sends these SSE events, then [DONE]."""
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    transport = httpx2.MockTransport(lambda request: httpx2.Response(200, text=body))
    async with httpx2.AsyncClient(base_url="http://h", transport=transport) as http:
        r = RequestRecord("r", 3, 8, 0.0)
        await OpenAIBackend("http://h", "m")._stream(http, Request([5, 6, 7], 8), r)
        return r


async def test_the_body_is_built_before_the_timer_starts(monkeypatch):
    """Detokenizing a chat prompt (and encoding the body) is loadgen's work, not the server's: it was in the TTFT."""
    clock = [0.0]
    monkeypatch.setattr(openai_backend.time, "perf_counter", lambda: clock[0])

    def slow_detokenize(ids: list[int]) -> str:
        clock[0] += 100.0  # a detokenizer that took 100 s on this clock
        return "hi"

    body = 'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\ndata: [DONE]\n\n'
    transport = httpx2.MockTransport(lambda request: httpx2.Response(200, text=body))
    async with httpx2.AsyncClient(base_url="http://h", transport=transport) as http:
        r = RequestRecord("r", 3, 1, 0.0)
        backend = OpenAIBackend("http://h", "m", chat=True, detokenize=slow_detokenize)
        await backend._stream(http, Request([5, 6, 7], 1), r)
    assert r.message_times_s == [0.0]


@pytest.mark.parametrize(
    ("kind", "status"),
    [("service_unavailable_error", "UNAVAILABLE"), ("rate_limit_error", "RESOURCE_EXHAUSTED"), ("other", "INTERNAL")],
)
async def test_an_error_event_mid_stream_is_counted_under_the_status_its_type_stands_for(kind, status):
    token = {"choices": [{"index": 0, "text": "a"}]}
    r = await stream_of([token, {"error": {"message": "worker lost", "type": kind, "param": None, "code": None}}])
    assert (r.status, r.error, r.message_tokens) == (status, "worker lost", [1])
