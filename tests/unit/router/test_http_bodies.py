"""Bodies the OpenAI HTTP API cannot take, through its real ASGI app on a real request lifecycle (tiny-random's
tokenizer, no workers): each is refused in OpenAI's error shape naming what is wrong and counted as an invalid
request, never a plain-text 500."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import httpx2
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from pdserve.security.api_keys import KeyTable, Tenant, digest
from pdserve.telemetry import Telemetry
from services.router.http import app as http_app
from services.router.http.app import openai_app
from services.router.lifecycle import RequestLifecycle
from tests.unit.router.json_lines import JsonLines
from tests.unit.router.request_counts import requests_by_outcome
from tests.unit.router.router_builder import MODEL, Router, worker

pytestmark = pytest.mark.timeout(60)
PROMPT = f'"model": "{MODEL}", "prompt": "x", "max_tokens": 2'
CHAT = f'"model": "{MODEL}", "messages": [{{"role": "user", "content": "x"}}], "max_tokens": 2'


@pytest.fixture
def lifecycle() -> RequestLifecycle:
    return Router([], no_workers_wait_s=0.1).lifecycle()


async def post(lifecycle: RequestLifecycle, path: str, body: bytes) -> httpx2.Response:
    transport = httpx2.ASGITransport(app=openai_app(lifecycle), raise_app_exceptions=False)
    async with httpx2.AsyncClient(transport=transport, base_url="http://router") as http:
        return await http.post(path, content=body, headers={"content-type": "application/json"})


def outcomes(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.outcome for r in caplog.records if hasattr(r, "outcome")]


BAD_BODIES = [  # raw, as sent: JSON's \u escapes, Python's NaN, integers no float holds
    ("completions", f'{{{PROMPT}, "temperature": 1{"0" * 400}}}', "temperature"),
    ("completions", f'{{{PROMPT}, "logit_bias": {{"5": -1{"0" * 400}}}}}', "logit_bias.5"),
    ("completions", f'{{{PROMPT}, "logit_bias": {{"{"7" * 5000}": 1}}}}', "logit_bias"),
    ("completions", f'{{{PROMPT}, "temperature": 1e300}}', "temperature"),  # a float, past a float32: the shared path
    ("completions", f'{{{PROMPT}, "top_p": NaN}}', "top_p"),
    ("completions", f'{{{PROMPT}, "top_p": 1e-300}}', "top_p"),  # 0 ("off") in a float32
    ("completions", f'{{{PROMPT}, "repetition_penalty": 1e-300}}', "repetition_penalty"),
    ("completions", f'{{"model": "{MODEL}", "prompt": "hi \\ud800"}}', "prompt"),
    ("completions", f'{{{PROMPT}, "stop": ["a", "\\udfff"]}}', "stop[1]"),
    ("completions", f'{{{PROMPT}, "user": "\\ud800"}}', "user"),
    ("completions", f'{{{PROMPT}, "\\ud800": 1}}', "\\ud800"),  # an unknown parameter, named as it was escaped
    ("completions", "[" * 100_000 + "]" * 100_000, "body"),
    (
        "chat/completions",
        f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "\\ud83d"}}]}}',
        "messages[0].content",
    ),
    ("chat/completions", f'{{{CHAT}, "stop": [["a"]]}}', "stop"),
]


@pytest.mark.parametrize(("path", "raw", "param"), BAD_BODIES, ids=[f"{i}-{p}" for i, (*_, p) in enumerate(BAD_BODIES)])
async def test_a_bad_value_is_a_400_naming_it_and_counted_invalid(lifecycle, caplog, path, raw, param):
    with caplog.at_level(logging.INFO, logger="services.router.lifecycle"):
        r = await post(lifecycle, f"/v1/{path}", raw.encode())
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error
    assert outcomes(caplog) == ["invalid"]


async def test_a_bug_converting_a_body_is_a_json_500_without_its_text(lifecycle, caplog, monkeypatch):
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("/secret/path of another tenant")

    monkeypatch.setattr(http_app, "parse_request", broken)
    with caplog.at_level(logging.INFO):
        r = await post(lifecycle, "/v1/completions", f"{{{PROMPT}}}".encode())
    assert r.status_code == 500 and r.json()["error"]["type"] == "internal_error"
    assert "secret" not in r.text and r.json()["error"]["message"].startswith("internal error (error id ")
    assert outcomes(caplog) == ["failed"]


class Upload:
    """A request body sent in chunks, counting how many the server took."""

    def __init__(self, chunk: bytes, chunks: int) -> None:
        self.chunk, self.chunks, self.taken = chunk, chunks, 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for _ in range(self.chunks):
            self.taken += 1
            yield self.chunk


async def upload(lifecycle: RequestLifecycle, body: Upload, headers: dict[str, str]) -> httpx2.Response:
    transport = httpx2.ASGITransport(app=openai_app(lifecycle), raise_app_exceptions=False)
    async with httpx2.AsyncClient(transport=transport, base_url="http://router") as http:
        return await http.post("/v1/completions", content=body, headers=headers)


LIMIT = 1000


@pytest.fixture
def limited() -> RequestLifecycle:
    return Router([], no_workers_wait_s=0.1, max_http_body_bytes=LIMIT).lifecycle()


def too_large(r: httpx2.Response) -> None:
    assert r.status_code == 413, r.text
    assert r.json()["error"] == {
        "message": f"body: is larger than this router's limit of {LIMIT} bytes",
        "type": "invalid_request_error",
        "param": "body",
        "code": None,
    }
    assert r.headers["connection"] == "close"  # the rest of the body is never read


async def test_a_content_length_past_the_limit_is_a_413_before_any_of_the_body_is_read(limited, caplog):
    body = Upload(b" " * 100, 1000)
    with caplog.at_level(logging.INFO, logger="services.router.lifecycle"):
        too_large(await upload(limited, body, {"content-length": str(LIMIT + 1)}))
    assert body.taken == 0 and outcomes(caplog) == ["invalid"]


async def test_a_body_without_a_length_is_refused_once_what_came_would_pass_the_limit(limited, caplog):
    body = Upload(b" " * 100, 10**6)  # 100 MB, chunked
    with caplog.at_level(logging.INFO, logger="services.router.lifecycle"):
        too_large(await upload(limited, body, {}))
    assert body.taken == LIMIT // 100 + 1 and outcomes(caplog) == ["invalid"]  # what came to the limit, and one more
    at_limit = await upload(limited, Upload(b" " * 100, LIMIT // 100), {})
    assert at_limit.status_code == 400 and at_limit.json()["error"]["param"] == "body"  # read, then not JSON


async def test_a_known_callers_bad_body_is_counted_under_its_tenant(caplog):
    lc = Router([], no_workers_wait_s=0.1).lifecycle(KeyTable({digest("k-1"): Tenant("team-a", "k-1")}))
    transport = httpx2.ASGITransport(app=openai_app(lc), raise_app_exceptions=False)
    with caplog.at_level(logging.INFO, logger="services.router.lifecycle"):
        async with httpx2.AsyncClient(transport=transport, base_url="http://router") as http:
            r = await http.post("/v1/completions", content=b"{", headers={"authorization": "Bearer k-1"})
            anonymous = await http.post("/v1/completions", content=b"{")
    assert (r.status_code, anonymous.status_code) == (400, 401)
    counted = [(rec.outcome, rec.tenant) for rec in caplog.records if hasattr(rec, "outcome")]
    assert counted == [("invalid", "team-a"), ("unauthenticated", "")]


async def test_the_http_span_is_an_error_only_for_the_servers_own_failures():
    exporter = InMemorySpanExporter()
    telemetry = Telemetry("test-router", span_processor=SimpleSpanProcessor(exporter))
    lc = Router([], no_workers_wait_s=0.1).lifecycle(telemetry=telemetry)
    too_long = f'"model": "{MODEL}", "prompt": "x", "max_tokens": 1000000'  # past the model's context: a 400
    no_workers = PROMPT  # a valid request no worker can take: a 503
    bodies = [f"{{{b}}}" for b in (too_long, no_workers)]
    bodies += [f'{{{b}, "stream": true}}' for b in (too_long, no_workers)]  # refused before the first event
    statuses = [(await post(lc, "/v1/completions", body.encode())).status_code for body in bodies]
    assert statuses == [400, 503] * 2
    spans = [s for s in exporter.get_finished_spans() if s.name == "POST /v1/completions"]
    assert [s.attributes["http.response.status_code"] for s in spans] == [400, 503] * 2
    assert [s.status.status_code for s in spans] == [StatusCode.UNSET, StatusCode.ERROR] * 2
    assert [s.attributes.get("error.type") for s in spans] == [None, "NoWorkersError"] * 2
    # So are the steps under them: a bad request's admission is no failure; a placement without workers is.
    steps = {(s.name, s.status.status_code) for s in exporter.get_finished_spans() if s.name != spans[0].name}
    assert steps == {("admission", StatusCode.UNSET), ("admission", StatusCode.ERROR), ("placement", StatusCode.ERROR)}
    shed = Router([worker("p0", queued_prefill_tokens=30_000), worker("d0", "decode")]).lifecycle(telemetry=telemetry)
    exporter.clear()
    assert (await post(shed, "/v1/completions", f"{{{PROMPT}}}".encode())).status_code == 429
    assert {s.name: s.status.status_code for s in exporter.get_finished_spans()} == dict.fromkeys(
        ("admission", "placement", "POST /v1/completions"), StatusCode.UNSET
    )
    telemetry.shutdown()


@pytest.mark.parametrize("stream", [False, True])
async def test_the_http_span_starts_as_the_head_arrives_with_opentelemetrys_http_attributes(stream):
    """A slow upload is in the request's span, as it is in a gRPC call's (it started once the body was read), and
    the span carries the HTTP semantic conventions' attributes that a backend's HTTP views read."""
    exporter = InMemorySpanExporter()
    telemetry = Telemetry("test-router", span_processor=SimpleSpanProcessor(exporter))
    lc = Router([], no_workers_wait_s=0.1, trace_enduser_id=True).lifecycle(telemetry=telemetry)  # `user` kept

    body_sent_ns: list[int] = []

    async def slow_body() -> AsyncIterator[bytes]:
        await asyncio.sleep(0.3)
        body_sent_ns.append(time.time_ns())
        yield f'{{{CHAT}, "stream": {str(stream).lower()}, "user": "u-1"}}'.encode()

    transport = httpx2.ASGITransport(app=openai_app(lc), raise_app_exceptions=False)
    headers = {"content-type": "application/json", "user-agent": "probe/1.0"}
    async with httpx2.AsyncClient(transport=transport, base_url="http://router.example:8000") as http:
        r = await http.post("/v1/chat/completions", content=slow_body(), headers=headers)
    assert r.status_code == 503, r.text  # no workers
    (span,) = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER]
    assert span.start_time < body_sent_ns[0] < span.end_time  # the upload inside it, by order, not by a bound
    attrs = dict(span.attributes)
    assert span.name == "POST /v1/chat/completions" and attrs.pop("client.address") and attrs.pop("client.port")
    assert attrs == {
        "http.request.method": "POST",
        "http.route": "/v1/chat/completions",
        "url.path": "/v1/chat/completions",
        "url.scheme": "http",
        "server.address": "router.example",
        "server.port": 8000,
        "user_agent.original": "probe/1.0",
        "enduser.id": "u-1",
        "http.response.status_code": 503,
        "error.type": "NoWorkersError",
        **{k: v for k, v in attrs.items() if k.startswith("request.")},  # the lifecycle's, as on a gRPC span
    }
    telemetry.shutdown()


async def test_a_body_refused_before_it_parsed_has_a_span_in_its_callers_trace():
    """A bad key, JSON or field over HTTP is in the caller's trace (its traceparent), as the same refusal over
    gRPC is in the server span: it had none."""
    exporter = InMemorySpanExporter()
    telemetry = Telemetry("test-router", span_processor=SimpleSpanProcessor(exporter))
    lc = Router([]).lifecycle(KeyTable({digest("k-1"): Tenant("team-a", "k-1")}), telemetry=telemetry)
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    caller = {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}
    transport = httpx2.ASGITransport(app=openai_app(lc))
    async with httpx2.AsyncClient(transport=transport, base_url="http://router") as http:
        bad_json = await http.post("/v1/completions", content=b"{", headers=caller | {"authorization": "Bearer k-1"})
        no_key = await http.post("/v1/completions", content=b"{", headers=caller)
    assert (bad_json.status_code, no_key.status_code) == (400, 401)
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["POST /v1/completions"] * 2
    assert {f"{s.context.trace_id:032x}" for s in spans} == {trace_id}
    assert [s.attributes["http.response.status_code"] for s in spans] == [400, 401]
    assert all(s.status.status_code == StatusCode.UNSET and "refused" in s.attributes for s in spans)
    telemetry.shutdown()


@pytest.mark.parametrize(
    ("key", "body", "draining", "status"),
    [
        ("k-1", b"{", False, 400),  # a body that does not parse
        ("", b"{}", False, 401),  # no key
        ("k-slow", b"{}", False, 429),  # its second request, past the key's requests_per_second
        ("k-1", b"{}", True, 503),  # a draining router's
    ],
)
async def test_a_refused_requests_log_line_leads_to_its_span(key, body, draining, status):
    """The one line a refused request logs carries its span's trace_id and span_id (it was logged before its span
    started, with neither), as a request that was served does."""
    exporter = InMemorySpanExporter()
    telemetry = Telemetry("test-router", span_processor=SimpleSpanProcessor(exporter))
    keys = {
        digest("k-1"): Tenant("team-a", "k-1"),
        digest("k-slow"): Tenant("team-b", "k-slow", requests_per_second=0.01),
    }
    lc = Router([]).lifecycle(KeyTable(keys), telemetry=telemetry)
    lc.draining = draining
    logger, handler = logging.getLogger("services.router.lifecycle"), JsonLines()
    logger.addHandler(handler)
    level, logger.level = logger.level, logging.INFO
    try:
        transport = httpx2.ASGITransport(app=openai_app(lc))
        async with httpx2.AsyncClient(transport=transport, base_url="http://router") as http:
            headers = {"authorization": f"Bearer {key}"} if key else {}
            for _ in range(2 if status == 429 else 1):
                r = await http.post("/v1/completions", content=body, headers=headers)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert r.status_code == status, r.text
    span = exporter.get_finished_spans()[-1]
    line = [line for line in handler.lines if "outcome" in line][-1]
    assert line["trace_id"] == f"{span.context.trace_id:032x}" and line["span_id"] == f"{span.context.span_id:016x}"
    telemetry.shutdown()


async def test_an_empty_prompt_is_a_400_saying_so(lifecycle):
    for prompt in ('""', '[""]'):
        r = await post(lifecycle, "/v1/completions", f'{{"model": "{MODEL}", "prompt": {prompt}}}'.encode())
        assert r.status_code == 400 and r.json()["error"]["message"] == "prompt: must not be empty", r.text


async def test_max_completion_tokens_past_the_context_is_told_by_that_name_not_as_max_tokens(lifecycle):
    body = f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "x"}}], "max_completion_tokens": 5000}}'
    r = await post(lifecycle, "/v1/chat/completions", body.encode())
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "max_completion_tokens", r.text
    assert "+ max_completion_tokens (5000) = " in error["message"] and "max_tokens" not in error["message"], error


async def test_an_x_request_id_too_long_for_its_choices_is_a_400_before_any_choice_runs(lifecycle, caplog):
    """With n choices each runs as `{id}-{index}`: an id that fits alone but not with its suffix is refused at
    once, naming the header, instead of after the choices before the first too long one ran."""
    limit = lifecycle.config.request_limits.max_request_id_chars
    body = f'{{{PROMPT}, "n": 11}}'.encode()
    transport = httpx2.ASGITransport(app=openai_app(lifecycle), raise_app_exceptions=False)
    async with httpx2.AsyncClient(transport=transport, base_url="http://router") as http:
        with caplog.at_level(logging.INFO, logger="services.router.lifecycle"):
            refused = await http.post("/v1/completions", content=body, headers={"x-request-id": "r" * (limit - 2)})
            tried = outcomes(caplog)  # before the next request's (the logger may log at INFO after this block too)
        fits = await http.post("/v1/completions", content=body, headers={"x-request-id": "r" * (limit - 3)})
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["param"] == "x-request-id", error
    suffix = "with n=11 (each choice's id ends with -<index>)"
    assert error["message"] == f"x-request-id: {limit - 2} characters; at most {limit - 3} are accepted {suffix}"
    assert tried == ["invalid"]  # no choice was tried
    assert fits.status_code == 503  # the id passed; no worker serves here


async def test_a_caller_gone_while_it_sent_its_body_is_counted_cancelled_not_a_server_error(lifecycle, caplog):
    messages = [{"type": "http.request", "body": b'{"model": ', "more_body": True}, {"type": "http.disconnect"}]
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0)

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b""}
    with caplog.at_level(logging.INFO):
        await openai_app(lifecycle)(scope | {"http_version": "1.1", "scheme": "http"}, receive, send)
    assert outcomes(caplog) == ["cancelled"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert sent[0]["status"] == 499


async def test_without_the_access_log_a_request_logs_no_line_and_is_still_counted(caplog):
    """--no-access-log: at 1000 req/s the line per request is ~24 GB a day; the metrics count every request still."""
    lifecycle = Router([], no_workers_wait_s=0.1, access_log=False).lifecycle(telemetry=Telemetry("test-router"))
    with caplog.at_level(logging.INFO, logger="services.router.lifecycle"):
        r = await post(lifecycle, "/v1/completions", BAD_BODIES[0][1].encode())
    assert r.status_code == 400 and outcomes(caplog) == []
    assert requests_by_outcome(lifecycle.telemetry) == {("invalid", "anonymous"): 1}


@pytest.mark.parametrize("encoding", ["gzip", "br, gzip", "Deflate"])
async def test_a_compressed_body_is_a_415_before_any_of_it_is_read(limited, caplog, encoding):
    """A fuzz finding: a gzip body was read, then refused as "not valid JSON", as if the JSON were at fault."""
    body = Upload(b" " * 100, 5)
    with caplog.at_level(logging.INFO, logger="services.router.lifecycle"):
        r = await upload(limited, body, {"content-encoding": encoding, "content-type": "application/json"})
    assert r.status_code == 415, r.text
    error = r.json()["error"]
    assert error["param"] == "body" and "this API takes bodies uncompressed" in error["message"], error
    assert repr(encoding.lower()) in error["message"] and r.headers["connection"] == "close"
    assert body.taken == 0 and outcomes(caplog) == ["invalid"]
    plain = await upload(limited, Upload(b'{"model": "m", "prompt": "x"}', 1), {"content-encoding": "identity"})
    assert plain.status_code != 415


@pytest.mark.parametrize(
    "content_type", ["application/x-www-form-urlencoded", "text/plain;charset=UTF-8", "multipart/form-data; b=x"]
)
async def test_a_body_not_sent_as_json_is_a_415_before_any_of_it_is_read(limited, caplog, content_type):
    """The types a browser sends cross-origin without asking first, and `curl -d`'s form: read as JSON before, so a web
    page could have a visitor's browser use a router without API keys."""
    body = Upload(b'{"model": "m", "prompt": "x"}', 1)
    with caplog.at_level(logging.INFO, logger="services.router.lifecycle"):
        r = await upload(limited, body, {"content-type": content_type})
    assert r.status_code == 415, r.text
    error = r.json()["error"]
    assert error == {
        "message": f"body: is sent as Content-Type {content_type!r}; this API takes application/json",
        "type": "invalid_request_error",
        "param": "body",
        "code": None,
    }
    assert r.headers["connection"] == "close" and body.taken == 0 and outcomes(caplog) == ["invalid"]


async def test_a_body_of_no_type_from_a_browser_is_a_415(limited, caplog):
    """`fetch(url, {method: "POST", body: new Blob([json])})` sends no Content-Type, and no CORS preflight first."""
    body = Upload(b'{"model": "m", "prompt": "x"}', 1)
    with caplog.at_level(logging.INFO, logger="services.router.lifecycle"):
        r = await upload(limited, body, {"origin": "https://elsewhere.example"})
    assert r.status_code == 415, r.text
    assert r.json()["error"]["message"] == (
        "body: is sent by a browser (an Origin header) with no Content-Type; send application/json"
    )
    assert body.taken == 0 and outcomes(caplog) == ["invalid"]


@pytest.mark.parametrize(
    "headers", [{}, {"content-type": "Application/JSON; charset=utf-8"}, {"content-type": "application/vnd.x+json"}]
)
async def test_a_body_sent_as_json_or_with_no_type_is_read(lifecycle, headers):
    """FastAPI's rule (vLLM's server): no Content-Type is JSON, as is any `application/*+json`."""
    r = await upload(lifecycle, Upload(f"{{{PROMPT}}}".encode(), 1), headers)
    assert r.status_code == 503, r.text  # read, parsed and checked: no worker to serve it
