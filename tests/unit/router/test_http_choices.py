"""The HTTP API's `n` choices against an API key's quotas, through the real ASGI app, lifecycle and LocalQuotas, and
a stand-in decode worker: n that the key's limits can never let in at once is a 400 naming `n`, not a 429 no retry
fixes; the key's tokens let all n choices in together or none."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator

import grpc
import httpx2
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from pdserve.env import CLUSTER_SECRET_VAR
from pdserve.security.api_keys import KeyTable, Tenant, digest
from pdserve.telemetry import Telemetry
from services.router.http.app import openai_app
from services.router.key_reload import KeyReload
from services.router.lifecycle import RequestLifecycle
from tests.unit.router.request_counts import requests_by_outcome
from tests.unit.router.router_builder import MODEL, Router, worker
from tests.unit.router.stand_in_decode import StandInDecode, serving

pytestmark = pytest.mark.timeout(60)
KEY = "choices-key"
PROMPT = [5, 6, 7, 8]  # 4 tokens: with max_tokens 196, 200 charged per choice


async def complete(lifecycle: RequestLifecycle, n: int, max_tokens: int = 196) -> httpx2.Response:
    transport = httpx2.ASGITransport(app=openai_app(lifecycle))
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "n": n, "ignore_eos": True}
    async with httpx2.AsyncClient(transport=transport, base_url="http://router", timeout=30) as http:
        return await http.post("/v1/completions", json=body, headers={"authorization": f"Bearer {KEY}"})


@pytest.fixture
async def decode(monkeypatch) -> tuple[StandInDecode, str]:
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    stand_in = StandInDecode(gap_s=0.005)
    async with serving(stand_in) as address:
        yield stand_in, address


def lifecycle(address: str, tenant: Tenant) -> RequestLifecycle:
    router = Router([worker("p0"), worker("d0", "decode", address=address)])
    return router.lifecycle(KeyTable({digest(KEY): tenant}))


async def test_more_choices_than_the_keys_streams_are_a_400_naming_n(decode):
    stand_in, address = decode
    lc = lifecycle(address, Tenant("team", "k", max_concurrent=2))
    r = await complete(lc, n=3)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "n" and "retry-after" not in r.headers
    assert stand_in.calls == 0  # refused before any choice ran
    assert (await complete(lc, n=2, max_tokens=4)).status_code == 200


@pytest.mark.parametrize(
    ("decode_worker", "router", "held"),
    [
        ({"kv_blocks_total": 30, "kv_blocks_free": 30}, {}, "hold 2 such requests"),  # 13 blocks a choice
        ({"max_num_seqs": 2}, {}, "hold 2 such requests"),
        ({}, {"max_in_flight": 2}, "the router allows 2"),
    ],
)
async def test_more_choices_than_the_cluster_holds_at_once_are_a_400_naming_n(decode, decode_worker, router, held):
    """Every choice streams while the next starts: n past what the decode workers' KV or batches hold together,
    or past the router's in-flight limit, would shed a later choice on an idle cluster, every time (it was a 429)."""
    stand_in, address = decode
    workers = [worker("p0"), worker("d0", "decode", address=address, **decode_worker)]
    lc = Router(workers, **router).lifecycle()
    for _ in range(2):
        r = await complete(lc, n=3)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "n" and held in r.json()["error"]["message"]
    assert stand_in.calls == 0 and lc.in_flight == 0
    assert (await complete(lc, n=2)).status_code == 200


@pytest.mark.parametrize(
    ("decode_worker", "tenant"),
    [
        ({"kv_blocks_total": 30, "kv_blocks_free": 30}, Tenant("team", "k")),
        ({}, Tenant("t", "k", tokens_per_minute=600)),
    ],
)
async def test_choices_refused_over_their_n_name_the_max_tokens_field_the_chat_sent(decode, decode_worker, tenant):
    """n times prompt plus max_completion_tokens past the decode workers' KV, or the key's minute: a chat sent no
    max_tokens, and its refusal says what it sent (it read "prompt plus max_tokens")."""
    stand_in, address = decode
    lc = Router([worker("p0"), worker("d0", "decode", address=address, **decode_worker)]).lifecycle(
        KeyTable({digest(KEY): tenant})
    )
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 196, "n": 4}
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=openai_app(lc)), base_url="http://router") as http:
        r = await http.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    assert "prompt plus max_completion_tokens" in r.json()["error"]["message"] and stand_in.calls == 0, r.text


async def test_choices_the_keys_bucket_cannot_hold_together_are_refused_before_any_runs(decode):
    """600 tokens a minute: n=3 of 200 fits the key, but with 200 spent just before, the bucket cannot hold all
    three: the request is a 429 before any choice runs (the first charges for all), not two choices run and then
    cancelled by the refused third; n=2 fits what is left."""
    stand_in, address = decode
    lc = lifecycle(address, Tenant("team", "k", tokens_per_minute=600))
    assert (await complete(lc, n=1)).status_code == 200  # 400 left
    refused = await complete(lc, n=3)
    assert refused.status_code == 429 and "tokens_per_minute" in refused.json()["error"]["message"], refused.text
    assert lc.in_flight == 0 and stand_in.calls == 1
    fits = await complete(lc, n=2)
    assert fits.status_code == 200, fits.text
    assert [c["finish_reason"] for c in fits.json()["choices"]] == ["length", "length"]
    assert (await complete(lc, n=1)).status_code == 429  # the minute is spent


async def test_each_choice_has_its_own_span_under_the_requests(decode):
    _, address = decode
    exporter = InMemorySpanExporter()
    telemetry = Telemetry("test-router", span_processor=SimpleSpanProcessor(exporter))
    router = Router([worker("p0"), worker("d0", "decode", address=address)])
    lc = router.lifecycle(KeyTable({digest(KEY): Tenant("team", "k")}), telemetry=telemetry)
    assert (await complete(lc, n=2, max_tokens=4)).status_code == 200
    spans = exporter.get_finished_spans()
    (http,) = [s for s in spans if s.name == "POST /v1/completions"]
    choices = sorted((s for s in spans if s.name == "choice"), key=lambda s: s.attributes["choice.index"])
    assert [c.attributes["choice.index"] for c in choices] == [0, 1]
    assert all(c.parent.span_id == http.context.span_id for c in choices)
    assert len({c.attributes["request.id"] for c in choices}) == 2  # each its own request, its own id
    assert "request.id" not in http.attributes
    telemetry.shutdown()


class FailsChoiceOne(StandInDecode):
    """Serves the first choice of `x-request-id: r`, refuses the second (UNAVAILABLE, as a lost worker)."""

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
        if request.client_request_id == "r-1":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "lost")
        async for msg in super().Generate(request, context):
            yield msg


async def with_choice_one_failing(telemetry: Telemetry, n: int, max_tokens: int, gap_s: float = 0.0) -> None:
    """A completion of `n` choices whose second fails (no retry): the caller gets a 503."""
    async with serving(FailsChoiceOne(gap_s=gap_s)) as address:
        router = Router([worker("p0"), worker("d0", "decode", address=address)], max_attempts=1)
        lc = router.lifecycle(KeyTable({digest(KEY): Tenant("team", "k")}), telemetry=telemetry)
        transport = httpx2.ASGITransport(app=openai_app(lc))
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "n": n, "ignore_eos": True}
        headers = {"authorization": f"Bearer {KEY}", "x-request-id": "r"}
        async with httpx2.AsyncClient(transport=transport, base_url="http://router", timeout=30) as http:
            assert (await http.post("/v1/completions", json=body, headers=headers)).status_code == 503


async def test_a_failed_choices_span_is_an_error_with_its_exception(monkeypatch):
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    exporter = InMemorySpanExporter()
    telemetry = Telemetry("test-router", span_processor=SimpleSpanProcessor(exporter))
    await with_choice_one_failing(telemetry, n=2, max_tokens=4)
    (failed,) = [s for s in exporter.get_finished_spans() if s.name == "choice" and s.attributes["choice.index"] == 1]
    assert failed.status.status_code is StatusCode.ERROR and [e.name for e in failed.events] == ["exception"]
    telemetry.shutdown()


class RefusesChoiceOne(StandInDecode):
    """Serves the first call; refuses the next with `code`: as a full batch does, or as a constraint the output
    could not be held to."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(gap_s=0.005)
        self.code, self.details = code, details

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
        if self.calls:
            await context.abort(self.code, self.details)
        async for msg in super().Generate(request, context):
            yield msg


@pytest.mark.parametrize(
    "code, details, failed",
    [
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "its batch is full (1 sequences, max_num_seqs 1)", True),
        (grpc.StatusCode.INVALID_ARGUMENT, "response_format: the output could not be held to it past 3 tokens", False),
    ],
)
async def test_a_stream_a_later_choice_breaks_is_an_error_on_its_span_unless_the_callers(
    monkeypatch, code, details, failed
):
    """Choice 0's events went out (a 200): the shed of choice 1 breaks what the caller was given, the server's
    failure however the shed reads on its own (a shed before the first event is a 429, no error). A refusal that
    is the caller's own (its constraint, its revoked key) is none of the server's mid-stream either, as on gRPC."""
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    exporter = InMemorySpanExporter()
    telemetry = Telemetry("test-router", span_processor=SimpleSpanProcessor(exporter))
    async with serving(RefusesChoiceOne(code, details)) as address:
        router = Router([worker("p0"), worker("d0", "decode", address=address)], max_attempts=1)
        transport = httpx2.ASGITransport(app=openai_app(router.lifecycle(telemetry=telemetry)))
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "n": 2, "ignore_eos": True, "stream": True}
        async with httpx2.AsyncClient(transport=transport, base_url="http://router", timeout=30) as http:
            r = await http.post("/v1/completions", json=body)
    assert r.status_code == 200 and '"error"' in r.text
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "POST /v1/completions"]
    if failed:
        assert span.status.status_code is StatusCode.ERROR and [e.name for e in span.events] == ["exception"]
    else:
        assert span.status.status_code is StatusCode.UNSET and not span.events, span.status
        assert details in str(span.attributes["refused"])
    telemetry.shutdown()


async def test_choices_a_failed_choice_ends_are_counted_as_failed_not_as_the_callers_cancels(monkeypatch):
    """n=4, choice 1 fails while choice 0 streams: choice 0 is cancelled for it and 2-3 never start. The caller
    cancelled nothing: four requests counted, all failed (choice 0 was counted `cancelled`, 2-3 not at all)."""
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    telemetry = Telemetry("test-router")
    await with_choice_one_failing(telemetry, n=4, max_tokens=40, gap_s=0.05)
    assert requests_by_outcome(telemetry) == {("failed", "team"): 4}
    telemetry.shutdown()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_drain_begun_after_the_first_choice_was_admitted_waits_for_every_choice(decode, stream: bool):
    """The router starts draining (what `drain_and_stop` does: refuse new requests, wait for `in_flight`) while
    choice 0 streams: the later choices are part of a request already in, so they run, and the drain waits for them;
    a new request is refused."""
    _, address = decode
    lc = lifecycle(address, Tenant("team", "k"))
    transport = httpx2.ASGITransport(app=openai_app(lc))
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 20, "n": 3, "ignore_eos": True, "stream": stream}
    async with httpx2.AsyncClient(transport=transport, base_url="http://router", timeout=30) as http:
        headers = {"authorization": f"Bearer {KEY}"}
        task = asyncio.ensure_future(http.post("/v1/completions", json=body, headers=headers))
        while not lc.admission.in_flight:
            await asyncio.sleep(0.001)
        lc.draining = True
        held = []
        while not task.done():
            held.append(lc.in_flight)
            await asyncio.sleep(0.002)
        r = task.result()
        assert r.status_code == 200 and "error" not in r.text, r.text
        # Held from the start to the end of the choices (the response is written a few loop turns after): a drain
        # would have waited for all three.
        started = len(list(itertools.takewhile(bool, held)))
        assert started and not any(held[started:]) and lc.in_flight == 0, held
        assert (await http.post("/v1/completions", json=body, headers=headers)).status_code == 503
    if stream:
        events = [json.loads(line.removeprefix("data: ")) for line in r.text.splitlines() if line.startswith("data: {")]
        indices = {c["index"] for e in events for c in e["choices"]}
    else:
        indices = {c["index"] for c in r.json()["choices"]}
    assert indices == {0, 1, 2}


class RefusesTheSecond(StandInDecode):
    """Serves one hand-off, then refuses the next ones (and their retries) as a full batch does, or as a worker that
    lost them (`refusing` turned off after)."""

    refusing = True

    def __init__(self, code: grpc.StatusCode) -> None:
        super().__init__(gap_s=0.005)
        self.code = code

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
        if self.calls >= 1 and self.refusing:
            self.calls += 1
            context.set_trailing_metadata((("grpc-retry-pushback-ms", "100"),))
            await context.abort(self.code, "its batch is full (1 sequences, max_num_seqs 1)")
        async for msg in super().Generate(request, context):
            yield msg


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("code", "status"), [(grpc.StatusCode.RESOURCE_EXHAUSTED, 429), (grpc.StatusCode.UNAVAILABLE, 503)]
)
async def test_a_request_whose_later_choice_the_cluster_fails_gives_back_its_tokens_unless_a_choice_was_sent(
    monkeypatch, stream: bool, code: grpc.StatusCode, status: int
):
    """n=2 of 500 tokens on a key of 1000 a minute: choice 1 is refused by its decode worker (a full batch), or
    lost, so the request is a 429 or a 503, both saying a retry may succeed. Non-streamed, the caller got
    nothing: its 1000 tokens come back and the retry runs, as a request of one choice gets them back. Streamed,
    choice 0's tokens went out: they stay spent."""
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    stand_in = RefusesTheSecond(code)
    async with serving(stand_in) as address:
        lc = lifecycle(address, Tenant("team", "k", tokens_per_minute=1000))
        transport = httpx2.ASGITransport(app=openai_app(lc))
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 496, "n": 2, "ignore_eos": True, "stream": stream}
        headers = {"authorization": f"Bearer {KEY}"}
        async with httpx2.AsyncClient(transport=transport, base_url="http://router", timeout=30) as http:
            refused = await http.post("/v1/completions", json=body, headers=headers)
            if stream:
                assert refused.status_code == 200 and "batch is full" in refused.text, refused.text
            else:
                assert refused.status_code == status and "batch is full" in refused.text, refused.text
            stand_in.refusing = False
            retried = await http.post("/v1/completions", json=body, headers=headers)
    assert stand_in.calls >= 2 and lc.in_flight == 0
    if stream:
        assert retried.status_code == 429 and "tokens_per_minute" in retried.text, retried.text
    else:
        assert retried.status_code == 200 and len(retried.json()["choices"]) == 2, retried.text


class SlowFirstToken(StandInDecode):
    """Each choice's first token comes 0.2 s after its call."""

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
        await asyncio.sleep(0.2)
        async for msg in super().Generate(request, context):
            yield msg


async def test_every_choices_latencies_count_from_the_requests_arrival(monkeypatch):
    """Choice i starts after choice i-1's first token, so the caller waits at least 0.2 (i + 1) s for its own:
    the router's TTFT and end-to-end samples (one per choice) say so, not 0.2 s each from when each started."""
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    telemetry = Telemetry("test-router")
    async with serving(SlowFirstToken()) as address:
        router = Router([worker("p0"), worker("d0", "decode", address=address)])
        lc = router.lifecycle(KeyTable({digest(KEY): Tenant("team", "k")}), telemetry=telemetry)
        assert (await complete(lc, n=3, max_tokens=2)).status_code == 200
    samples = {s.name: s.value for f in telemetry.registry.collect() for s in f.samples}
    for histogram in ("pdserve_time_to_first_token_seconds", "pdserve_e2e_request_latency_seconds"):
        assert samples[f"{histogram}_count"] == 3
        assert samples[f"{histogram}_sum"] >= 0.2 + 0.4 + 0.6, (histogram, samples[f"{histogram}_sum"])
    telemetry.shutdown()


async def test_latencies_count_from_the_requests_head_its_bodys_upload_included(decode):
    """The caller's clock starts when it sends: a body uploaded over 0.5 s is in the TTFT and end-to-end
    latency the router records, not left out as if the request came once its body was in."""
    _, address = decode
    telemetry = Telemetry("test-router")
    router = Router([worker("p0"), worker("d0", "decode", address=address)])
    lc = router.lifecycle(KeyTable({digest(KEY): Tenant("team", "k")}), telemetry=telemetry)
    raw = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 2}).encode()

    async def slow_body() -> AsyncIterator[bytes]:
        for i in range(0, len(raw), len(raw) // 5 + 1):
            await asyncio.sleep(0.1)
            yield raw[i : i + len(raw) // 5 + 1]

    transport = httpx2.ASGITransport(app=openai_app(lc))
    async with httpx2.AsyncClient(transport=transport, base_url="http://router", timeout=30) as http:
        headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
        assert (await http.post("/v1/completions", content=slow_body(), headers=headers)).status_code == 200
    sums = {s.name: s.value for f in telemetry.registry.collect() for s in f.samples if s.name.endswith("_sum")}
    assert sums["pdserve_time_to_first_token_seconds_sum"] >= 0.45
    assert sums["pdserve_e2e_request_latency_seconds_sum"] >= 0.45
    telemetry.shutdown()


@pytest.mark.parametrize(("kept", "status"), [(False, 401), (True, 200)])
async def test_a_key_revoked_while_its_request_runs_ends_all_of_its_choices(monkeypatch, tmp_path, kept, status):
    """Every choice is the tenant the request was admitted as while a reload keeps its key (new caps change
    nothing); a reload that revokes it ends the whole request, the choices running and those yet to start alike
    (once, a later choice checked the key again: 401 after the first had streamed, the first running on)."""
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    revoked, finished = asyncio.Event(), []

    class ReloadedAtFirstCall(StandInDecode):
        async def Generate(self, request, context):  # noqa: N802
            revoked.set()
            async for msg in super().Generate(request, context):
                yield msg
            finished.append(request.client_request_id)

    path = tmp_path / "keys.toml"
    entry = '[[keys]]\nname = "{}"\nsha256 = "{}"\ntenant = "team"\nmax_concurrent = {}\n'
    path.write_text(entry.format("k", digest(KEY), 2))
    keys = KeyReload(str(path))
    stand_in = ReloadedAtFirstCall(gap_s=0.05)
    async with serving(stand_in) as address:
        lc = Router([worker("p0"), worker("d0", "decode", address=address)]).lifecycle(keys.table)

        async def reload() -> None:
            await revoked.wait()
            path.write_text(entry.format("k", digest(KEY), 3) if kept else entry.format("other", digest("other"), 2))
            keys.reload(lc)

        _, r = await asyncio.gather(reload(), complete(lc, n=2, max_tokens=20))
        assert r.status_code == status, r.text
        if kept:
            assert len(r.json()["choices"]) == 2 and len(finished) == 2
        else:  # the first choice too, mid-stream
            assert "API key was revoked" in r.json()["error"]["message"] and not finished
            assert (await complete(lc, n=1)).status_code == 401
        assert lc.in_flight == 0
