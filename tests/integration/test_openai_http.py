"""The OpenAI-compatible HTTP API of a real `pdserve up --http-port` (tiny-random), through the official `openai`
client: the same answers as the gRPC path, OpenAI's shapes for streams, usage and errors, tracing, shedding,
cancellation and draining, and loadgen over it. The sampling controls have their own module
(`test_openai_sampling.py`).

One cluster for the module. Its prefill queue bound (40 tokens, 32 at priority 0) admits any request that
arrives alone and sheds the ones queued behind another: requests here go one at a time except the burst."""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import time
import urllib.error
import urllib.request
import uuid

import openai
import pytest

from loadgen.__main__ import main as loadgen_main
from loadgen.report import load_runs
from pdserve.v1 import generate_pb2 as pb
from tests.integration.cluster_view import scrape, status_json, total
from tests.integration.openai_cluster import IGNORE_EOS, MODEL, grpc_result, http_cluster, openai_client
from tests.integration.reference import MAX_TOKENS, PROMPT

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster(collector, tmp_path_factory):
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.port}", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    env |= {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    log = tmp_path_factory.mktemp("openai_http") / "cluster.log"
    with http_cluster(log, "--max-queued-prefill-tokens", "40", env=env) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai_client(cluster)


GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS, "extra_body": IGNORE_EOS}
GRPC_GREEDY = pb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("prompt", [PROMPT, "The capital of France is"], ids=["token-ids", "text"])
def test_completion_is_the_grpc_paths_greedy_answer(cluster, client, prompt):
    field = {"prompt_token_ids": prompt} if isinstance(prompt, list) else {"prompt": prompt}
    grpc = grpc_result(cluster, sampling=GRPC_GREEDY, **field)
    expected, usage = grpc.text, grpc.usage
    answer = client.completions.create(model=MODEL, prompt=prompt, **GREEDY)
    assert answer.choices[0].text == expected and expected
    assert answer.choices[0].finish_reason == "length"
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (usage.prompt_tokens, MAX_TOKENS)
    assert answer.usage.total_tokens == usage.prompt_tokens + MAX_TOKENS

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None


def test_a_batch_answers_each_prompt_as_sent_alone(cluster, client):
    """2 prompts × n=2, greedy: choice i is prompt i // 2's answer, streamed or not; usage counts each prompt's
    tokens once and every choice's completion."""
    prompts = [PROMPT, [10, 11, 12, 13] * 5]
    alone = [client.completions.create(model=MODEL, prompt=p, **GREEDY) for p in prompts]
    expected = [a.choices[0].text for a in alone for _ in range(2)]
    assert expected[0] != expected[2] and all(expected)
    prompt_tokens = sum(a.usage.prompt_tokens for a in alone)
    answer = client.completions.create(model=MODEL, prompt=prompts, n=2, **GREEDY)
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    assert [c.text for c in answer.choices] == expected
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (prompt_tokens, 4 * MAX_TOKENS)

    options = {"include_usage": True}
    *chunks, last = client.completions.create(
        model=MODEL, prompt=prompts, n=2, stream=True, stream_options=options, **GREEDY
    )
    assert ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(4)] == expected
    usage = (last.usage.prompt_tokens, last.usage.completion_tokens)
    assert last.choices == [] and usage == (prompt_tokens, 4 * MAX_TOKENS)


def test_chat_is_the_grpc_paths_greedy_answer_and_streams_usage_last(cluster, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    grpc_messages = [pb.ChatMessage(**m) for m in messages]
    grpc = grpc_result(cluster, messages=grpc_messages, sampling=GRPC_GREEDY)
    expected, usage = grpc.text, grpc.usage
    kwargs = {"temperature": 0, "max_completion_tokens": MAX_TOKENS, "extra_body": {"ignore_eos": True}}
    answer = client.chat.completions.create(model=MODEL, messages=messages, **kwargs)
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == expected and expected
    assert answer.usage.prompt_tokens == usage.prompt_tokens

    # include_obfuscation false (OpenAI's padding off, which pdserve never adds) was a 400 for the stock client
    options = {"include_usage": True, "include_obfuscation": False}
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, stream=True, stream_options=options, **kwargs
    )
    chunks = list(stream)
    *content, last = chunks
    assert content[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content for c in content) == expected
    assert content[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in content)
    assert last.choices == [] and last.usage.completion_tokens == MAX_TOKENS
    assert last.usage.prompt_tokens == usage.prompt_tokens


def test_models_lists_the_served_model_and_health_answers(cluster, client):
    assert [m.id for m in client.models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert e.value.param == "model" and e.value.code == "model_not_found"
    with urllib.request.urlopen(cluster.base_url.removesuffix("/v1") + "/health", timeout=10) as r:
        assert (r.status, json.loads(r.read())) == (200, {"status": "ok"})


def test_http_requests_are_traced_and_counted_as_grpc_ones(cluster, client, collector):
    """The caller's traceparent starts the trace; the router's HTTP span holds the same admission and placement
    spans as a gRPC call's, the workers' spans join it; the router's metrics count the request (and a body it
    could not read) by outcome."""
    before = scrape(cluster.metrics_url)
    trace_id, request_id = uuid.uuid4().hex, uuid.uuid4().hex
    headers = {"traceparent": f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01", "x-request-id": request_id}
    answer = client.completions.create(
        model=MODEL, prompt="trace me", max_tokens=3, user="user-7", extra_headers=headers
    )
    assert answer.id == f"cmpl-{request_id}"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"beam_width": 2})
    after = scrape(cluster.metrics_url)
    for outcome in ("finished", "invalid"):
        count = total(after, "pdserve_requests_total", outcome=outcome)
        assert count - total(before, "pdserve_requests_total", outcome=outcome) == 1, outcome
    ttft = "pdserve_time_to_first_token_seconds_count"
    assert total(after, ttft) - total(before, ttft) == 1

    want = {"POST /v1/completions", "admission", "placement", "prefill.compute", "decode.stream"}
    deadline = time.monotonic() + 20
    while not want <= {s.name for _, s in collector.trace(bytes.fromhex(trace_id))} and time.monotonic() < deadline:
        time.sleep(0.2)
    spans = collector.trace(bytes.fromhex(trace_id))
    assert want <= {s.name for _, s in spans}, sorted(s.name for _, s in spans)
    assert {svc for svc, _ in spans} == {"pdserve-router", "pdserve-prefill", "pdserve-decode"}
    (http_span,) = [s for _, s in spans if s.name == "POST /v1/completions"]
    attrs = {a.key: a.value.string_value for a in http_span.attributes}
    assert attrs["request.client_id"] == request_id and attrs["decode.worker.id"] == "decode-1"
    assert "enduser.id" not in attrs  # the body's user: an end user's id, dropped (trace_enduser_id is off)


BAD_COMPLETIONS = [
    ({"n": 17}, "n"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),  # past the vocabulary
    ({"extra_body": {"stop_token_ids": [-1]}}, "stop_token_ids"),
    ({"logprobs": 21}, "logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10**6}, "max_tokens"),
    ({"seed": 2**64}, "seed"),  # past uint64 (a negative one is taken, as vLLM takes it)
    ({"stop": [""]}, "stop"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"extra_body": {"top_k": -2}}, "top_k"),
    ({"extra_body": {"priority": "high"}}, "priority"),
    ({"extra_body": {"slo": {"ttft_ms": -1}}}, "slo.ttft_ms"),
    ({"extra_body": {"slo": {"e2e_ms": 5}}}, "slo.e2e_ms"),
    ({"extra_body": {"best_of": 2}}, "best_of"),
    ({"prompt": [10**6]}, "prompt"),
    ({"prompt": ["a", [5]]}, "prompt"),  # a batch mixing strings and token lists
    ({"prompt": ["a", ""]}, "prompt"),
    ({"prompt": [[5], [10**6]]}, "prompt"),  # prompt 1 past the vocabulary
    ({"prompt": ["a"] * 9, "n": 2}, "prompt"),  # 18 choices
]


@pytest.mark.parametrize(("kwargs", "param"), BAD_COMPLETIONS, ids=[p for _, p in BAD_COMPLETIONS])
def test_a_bad_completion_parameter_is_a_400_naming_it(client, kwargs, param):
    request = {"model": MODEL, "prompt": "hello", "max_tokens": 2} | kwargs
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**request)
    assert e.value.param == param, e.value.message
    assert e.value.type == "invalid_request_error" and f"- {param}: " in e.value.message


BAD_CHATS = [
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages[0].content[0]",
    ),
    ({"messages": []}, "messages"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"extra_body": {"prompt": "hi"}}, "prompt"),
]


@pytest.mark.parametrize(("kwargs", "param"), BAD_CHATS, ids=[p for _, p in BAD_CHATS])
def test_a_bad_chat_parameter_is_a_400_naming_it(client, kwargs, param):
    request = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2} | kwargs
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**request)
    assert e.value.param == param, e.value.message


RAW_BODIES = [  # as sent on the wire: no SDK would serialize these
    (f'{{"model": "{MODEL}", "prompt": "x", "temperature": 1{"0" * 400}}}', "temperature"),
    (f'{{"model": "{MODEL}", "prompt": "\\ud800"}}', "prompt"),
    ("[" * 100_000 + "]" * 100_000, "body"),
]


def test_a_raw_body_no_parameter_takes_is_a_400_and_one_past_the_size_limit_a_413(cluster, client):
    """Through the real HTTP server: values JSON allows and no parameter takes are OpenAI-shaped 400s naming the
    parameter, counted invalid; a Content-Length past the body limit is a 413 before any of it is sent; the
    router serves on."""
    before = scrape(cluster.metrics_url)
    host = cluster.base_url.removeprefix("http://").removesuffix("/v1")
    for raw, param in RAW_BODIES:
        status, body, _ = post_raw(host, raw.encode())
        assert (status, body["error"]["param"], body["error"]["type"]) == (400, param, "invalid_request_error"), body
    status, body, headers = post_raw(host, b"", content_length=16 * 2**20 + 1)
    assert (status, body["error"]["param"], headers["connection"]) == (413, "body", "close"), body
    after = scrape(cluster.metrics_url)
    invalid = total(after, "pdserve_requests_total", outcome="invalid")
    assert invalid - total(before, "pdserve_requests_total", outcome="invalid") == len(RAW_BODIES) + 1
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].finish_reason


def post_raw(host: str, body: bytes, content_length: int | None = None) -> tuple[int, dict, dict[str, str]]:
    """(status, JSON body, headers) of a POST /v1/completions of these bytes under this Content-Length."""
    conn = http.client.HTTPConnection(host, timeout=30)
    try:
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("content-type", "application/json")
        conn.putheader("content-length", str(len(body) if content_length is None else content_length))
        conn.endheaders(body)
        r = conn.getresponse()
        return r.status, json.loads(r.read()), {k.lower(): v for k, v in r.getheaders()}
    finally:
        conn.close()


def test_a_burst_is_shed_with_retry_after(cluster):
    """Sixteen prompts at once against a queue bound below two of them: the ones queued behind another are
    shed, each as a RateLimitError whose response carries both retry hints; the rest complete."""

    async def burst() -> list[object]:
        client = openai.AsyncOpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0, timeout=60)
        prompts = [[3 + (seed * 7 + i) % 250 for i in range(35)] for seed in range(16)]
        calls = [client.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0) for p in prompts]
        return await asyncio.gather(*calls, return_exceptions=True)

    results = asyncio.run(burst())
    shed = [r for r in results if isinstance(r, openai.RateLimitError)]
    done = [r for r in results if isinstance(r, openai.types.Completion)]
    assert len(shed) + len(done) == 16 and shed and done, results
    for e in shed:
        ms = int(e.response.headers["retry-after-ms"])
        assert ms >= 100 and int(e.response.headers["retry-after"]) == -(-ms // 1000)
        assert e.code == "rate_limit_exceeded" and e.type == "rate_limit_error"


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_loadgen_runs_over_http(cluster, tmp_path, backend):
    path = tmp_path / "result.json"
    flags = ["--backend", backend, "--base-url", cluster.base_url.removesuffix("/v1"), "--model", MODEL]
    flags += ["--num-prompts", "5", "--random-input-len", "12", "--random-output-len", "6", "--max-concurrency", "1"]
    assert loadgen_main([*flags, "--result-json", str(path)]) == 0
    (run,) = load_runs(path)
    assert run["backend"] == backend
    errors = [r["error"] for r in run["requests"] if r["status"] != "OK"]
    assert (run["completed"], run["rejected"], run["failed"]) == (5, 0, 0), errors
    assert run["total_output_tokens"] == 5 * 6  # ignore_eos: exactly what was asked, counted from usage
    for r in run["requests"]:
        assert r["output_tokens"] == 6 and r["ttft_ms"] > 0 and r["e2el_ms"] >= r["ttft_ms"]
    # Streamed: timed per chunk, not once at the end. A chat chunk whose tokens detokenize to no text yet is not
    # counted, so one random stream may show a single timed chunk; five cannot all do.
    assert max(len(r["message_times_ms"]) for r in run["requests"]) >= 2


@pytest.mark.parametrize("n", [1, 2])
def test_a_non_streamed_request_whose_client_left_is_cancelled(cluster, n):
    """The client gives up on a long non-streamed completion: the router cancels it (its KV freed on both
    workers) instead of generating for nobody until max_tokens; with n choices, every one of them."""
    before = scrape(cluster.metrics_url)
    impatient = openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0, timeout=1.5)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(
            model=MODEL, prompt="x", max_tokens=2000, temperature=0, n=n, extra_body=IGNORE_EOS
        )
    deadline = time.monotonic() + 30
    while (after := scrape(cluster.metrics_url)) and cancelled(after) < cancelled(before) + n:
        assert time.monotonic() < deadline, "the request was not cancelled when its client left"
        time.sleep(0.2)
    assert finished(after) == finished(before), "it ran to its end"
    assert status_json(cluster.address)["in_flight"] == 0


def test_a_streamed_request_whose_client_left_is_cancelled(cluster, client):
    """The client reads a few SSE events of a long stream and hangs up: the router cancels the request (its KV
    freed on both workers) instead of generating for nobody until max_tokens."""
    before = scrape(cluster.metrics_url)
    stream = client.completions.create(
        model=MODEL, prompt="x", max_tokens=2000, temperature=0, stream=True, extra_body=IGNORE_EOS
    )
    for _, _chunk in zip(range(3), stream, strict=False):
        pass
    stream.close()
    deadline = time.monotonic() + 30
    while (after := scrape(cluster.metrics_url)) and cancelled(after) < cancelled(before) + 1:
        assert time.monotonic() < deadline, "the stream was not cancelled when its client left"
        time.sleep(0.2)
    assert finished(after) == finished(before), "it ran to its end"
    assert status_json(cluster.address)["in_flight"] == 0


def cancelled(samples: dict) -> float:
    return total(samples, "pdserve_requests_total", outcome="cancelled")


def finished(samples: dict) -> float:
    return total(samples, "pdserve_requests_total", outcome="finished")


def health_status(cluster) -> int:
    try:
        with urllib.request.urlopen(cluster.base_url.removesuffix("/v1") + "/health", timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_sigterm_drains_http_too_an_open_stream_finishes(cluster, client):
    """Last in the module: it stops the cluster. An HTTP stream open when SIGTERM arrives runs to its end;
    meanwhile /health says 503 and a new request is refused with 503, as gRPC is while draining, on a connection
    the router then closes (a keep-alive connection would bring the retry back to it)."""
    stream = client.completions.create(
        model=MODEL,
        prompt="x",
        max_tokens=400,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    first = next(stream)
    cluster.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while health_status(cluster) != 503:
        assert time.monotonic() < deadline, "/health never turned 503 while draining"
        time.sleep(0.05)
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert e.value.status_code == 503 and "draining" in e.value.message
    assert e.value.response.headers.get("connection") == "close"  # the client's pool reconnects, elsewhere
    *rest, last = list(stream)
    assert [first, *rest][-1].choices[0].finish_reason == "length"
    assert last.usage.completion_tokens == 400
    assert cluster.proc.wait(timeout=60) == 0
