"""The OpenAI-compatible HTTP API of a real `pdserve up --http-port` (tiny-random), through the official `openai`
client: the same answers as the gRPC path, OpenAI's shapes for streams, usage and errors, and loadgen over it.

One cluster for the module. Its prefill queue bound (40 tokens, 32 at priority 0) admits any request that
arrives alone and sheds the ones queued behind another: requests here go one at a time except the burst."""

from __future__ import annotations

import asyncio
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
from pdserve import cli
from pdserve.cluster.local_process import ClusterProcess, free_port
from pdserve.engine.models import resolve_model
from pdserve.engine.tokenizer import Tokenizer
from pdserve.rpc.client import StreamResult, generate
from pdserve.v1 import generate_pb2 as pb
from tests.integration.cluster_view import scrape, status_json, total
from tests.integration.reference import MAX_TOKENS, PROMPT, greedy, greedy_completion

pytestmark = pytest.mark.timeout(180)
MODEL = "tiny-random"
TOKENIZER = Tokenizer(resolve_model(MODEL))


@pytest.fixture(scope="module")
def cluster(collector, tmp_path_factory):
    log = tmp_path_factory.mktemp("openai_http") / "cluster.log"
    args = ["--model", MODEL, "--kv-cache-gb", "0.05", "--prefill", "1", "--decode", "1"]
    http_port, metrics_port = free_port(), free_port()
    args += ["--max-queued-prefill-tokens", "40", "--http-port", str(http_port), "--metrics-port", str(metrics_port)]
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.port}", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    proc = ClusterProcess(*args, log_path=log, env=env | {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    proc.base_url = f"http://127.0.0.1:{http_port}/v1"
    proc.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0, timeout=60)


def grpc_text(cluster, **fields) -> tuple[str, pb.Usage]:
    async def run() -> tuple[str, pb.Usage]:
        text, usage = "", None
        async for _msg, result in generate(cluster.address, pb.GenerateRequest(**fields), 60):
            text, usage = result.text, result.usage
        return text, usage

    return asyncio.run(run())


IGNORE_EOS = {"ignore_eos": True}
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS, "extra_body": IGNORE_EOS}
GRPC_GREEDY = pb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("prompt", [PROMPT, "The capital of France is"], ids=["token-ids", "text"])
def test_completion_is_the_grpc_paths_greedy_answer(cluster, client, prompt):
    field = {"prompt_token_ids": prompt} if isinstance(prompt, list) else {"prompt": prompt}
    expected, usage = grpc_text(cluster, sampling=GRPC_GREEDY, **field)
    answer = client.completions.create(model=MODEL, prompt=prompt, **GREEDY)
    assert answer.choices[0].text == expected and expected
    assert answer.choices[0].finish_reason == "length"
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (usage.prompt_tokens, MAX_TOKENS)
    assert answer.usage.total_tokens == usage.prompt_tokens + MAX_TOKENS

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None


def test_chat_is_the_grpc_paths_greedy_answer_and_streams_usage_last(cluster, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    grpc_messages = [pb.ChatMessage(**m) for m in messages]
    expected, usage = grpc_text(cluster, messages=grpc_messages, sampling=GRPC_GREEDY)
    kwargs = {"temperature": 0, "max_completion_tokens": MAX_TOKENS, "extra_body": {"ignore_eos": True}}
    answer = client.chat.completions.create(model=MODEL, messages=messages, **kwargs)
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == expected and expected
    assert answer.usage.prompt_tokens == usage.prompt_tokens

    stream = client.chat.completions.create(
        model=MODEL, messages=messages, stream=True, stream_options={"include_usage": True}, **kwargs
    )
    chunks = list(stream)
    *content, last = chunks
    assert content[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content for c in content) == expected
    assert content[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in content)
    assert last.choices == [] and last.usage.completion_tokens == MAX_TOKENS
    assert last.usage.prompt_tokens == usage.prompt_tokens


def test_penalties_reach_the_engine_as_the_single_process_engine_applies_them(cluster, client):
    """OpenAI's presence and frequency penalties and vLLM's repetition_penalty, through prefill (first token)
    and decode (the rest): the gRPC path's tokens are the single-process engine's, the HTTP path's text theirs."""
    penalties = {"presence_penalty": 0.5, "frequency_penalty": 1.0, "repetition_penalty": 1.25}
    expected = greedy(PROMPT, MAX_TOKENS, **penalties)
    assert expected != greedy(PROMPT, MAX_TOKENS)  # they matter for this prompt

    async def grpc_tokens() -> tuple[list[int], str]:
        sampling = pb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **penalties)
        request = pb.GenerateRequest(prompt_token_ids=PROMPT, sampling=sampling)
        result = None
        async for _msg, result in generate(cluster.address, request, 60):  # noqa: B007 (the last one is the answer)
            pass
        assert result is not None
        return result.token_ids, result.text

    tokens, text = asyncio.run(grpc_tokens())
    assert tokens == expected
    extra = {"ignore_eos": True, "repetition_penalty": 1.25}
    answer = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        presence_penalty=0.5,
        frequency_penalty=1.0,
        extra_body=extra,
    )
    assert answer.choices[0].text == text


def test_logprobs_are_the_single_process_engines_over_grpc_and_in_openais_shapes(cluster, client):
    """The first token's come from the prefill worker, the rest from the decode worker."""
    expected = greedy_completion(PROMPT, MAX_TOKENS, logprobs=2)

    async def grpc_result() -> StreamResult:
        sampling = pb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
        request = pb.GenerateRequest(prompt_token_ids=PROMPT, sampling=sampling)
        result = None
        async for _msg, result in generate(cluster.address, request, 60):  # noqa: B007 (the last one is the answer)
            pass
        assert result is not None
        return result

    result = asyncio.run(grpc_result())
    assert result.token_ids == expected.token_ids and len(result.logprobs) == MAX_TOKENS
    for got, want in zip(result.logprobs, expected.logprobs, strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert list(got.top_token_ids) == list(want.top_token_ids)
        assert list(got.top_logprobs) == pytest.approx(want.top_logprobs, abs=1e-4)
    grpc_logprobs = [lp.logprob for lp in result.logprobs]

    completion = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=2, extra_body=IGNORE_EOS
    ).choices[0]
    lp = completion.logprobs
    assert lp.token_logprobs == pytest.approx(grpc_logprobs, abs=1e-6)
    # Each token decoded alone (so a piece of a UTF-8 character reads as U+FFFD, as vLLM's do).
    tokens = [TOKENIZER.decode([t], skip_special_tokens=False) for t in result.token_ids]
    assert lp.tokens == tokens and lp.text_offset == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    for token, top, logprob in zip(lp.tokens, lp.top_logprobs, lp.token_logprobs, strict=True):
        assert len(top) <= 3 and top[token] == logprob  # the two most likely and the sampled one

    messages = [{"role": "user", "content": "Hello there"}]
    chat = {"model": MODEL, "messages": messages, "max_completion_tokens": MAX_TOKENS, "temperature": 0}
    chat |= {"logprobs": True, "top_logprobs": 2, "extra_body": IGNORE_EOS}
    whole = client.chat.completions.create(**chat).choices[0]
    content = whole.logprobs.content
    assert len(content) == MAX_TOKENS
    assert all(c.bytes == list(c.token.encode()) and len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)  # greedy: the top token
    streamed = [
        e for chunk in client.chat.completions.create(**chat, stream=True) for e in chunk.choices[0].logprobs.content
    ]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]


def test_echo_returns_the_prompt_and_its_logprobs_computed_on_the_prefill_worker(cluster, client):
    expected = greedy_completion(PROMPT, MAX_TOKENS, logprobs=1, prompt_logprobs=1)
    assert len(expected.prompt_logprobs) == len(PROMPT) - 1
    request = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "extra_body": IGNORE_EOS}
    answer = client.completions.create(**request, echo=True, logprobs=1).choices[0]
    prompt_text = TOKENIZER.decode(PROMPT, skip_special_tokens=False)
    assert answer.text.startswith(prompt_text) and len(answer.text) > len(prompt_text)
    lp = answer.logprobs
    assert len(lp.tokens) == len(PROMPT) + MAX_TOKENS
    assert lp.tokens[: len(PROMPT)] == [TOKENIZER.decode([t], skip_special_tokens=False) for t in PROMPT]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first prompt token has no context
    want = [x.logprob for x in expected.prompt_logprobs] + [x.logprob for x in expected.logprobs]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]

    chunks = list(client.completions.create(**request, echo=True, stream=True))
    assert chunks[0].choices[0].text.startswith(prompt_text)
    assert "".join(c.choices[0].text for c in chunks) == answer.text

    text = client.completions.create(**(request | {"prompt": "Once upon"}), echo=True).choices[0].text
    assert text.startswith("Once upon") and len(text) > len("Once upon")


def test_n_choices_are_n_seeded_requests_streamed_side_by_side(cluster, client):
    """Choice i is the gRPC path's answer with seed + i; usage counts the prompt once and every choice's
    tokens; a stream interleaves the choices, each chunk naming its index."""
    request = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 11}
    answer = client.completions.create(**request, n=3, extra_body=IGNORE_EOS)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    for choice in answer.choices:
        sampling = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=11 + choice.index, ignore_eos=True)
        assert choice.text == grpc_text(cluster, prompt_token_ids=PROMPT, sampling=sampling)[0]
    assert len({c.text for c in answer.choices}) > 1
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(PROMPT), 3 * MAX_TOKENS)

    chunks = list(client.completions.create(**request, n=3, stream=True, extra_body=IGNORE_EOS))
    for choice in answer.choices:
        mine = [c.choices[0] for c in chunks if c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text and mine[-1].finish_reason == "length"

    messages = [{"role": "user", "content": "Hello there"}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=MAX_TOKENS, temperature=0, n=2, extra_body=IGNORE_EOS
    )
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy: the same answer twice


def test_logit_bias_and_stop_token_ids_reach_both_workers(cluster, client):
    """A bias of 100 forces its token on the first token (the prefill worker's) and the rest (the decode
    worker's); a bias of -100 bans the greedy answer's first token; a stop token id ends the stream on it."""
    request = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    expected = greedy(PROMPT, MAX_TOKENS)
    forced = client.completions.create(**request, logit_bias={"42": 100}, extra_body=IGNORE_EOS).choices[0]
    assert forced.text == TOKENIZER.decode([42] * MAX_TOKENS)
    banned = greedy(PROMPT, MAX_TOKENS, logit_bias=((expected[0], -100.0),))
    assert banned[0] != expected[0]
    text = client.completions.create(**request, logit_bias={str(expected[0]): -100}, extra_body=IGNORE_EOS)
    assert text.choices[0].text == TOKENIZER.decode(banned)
    stop = expected[3]
    stopped = client.completions.create(**request, extra_body=IGNORE_EOS | {"stop_token_ids": [stop]})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == expected.index(stop) + 1  # the stop token is the last one


def test_pdserve_client_takes_the_sampling_flags_of_pdserve_generate(cluster, capsys):
    flags = ["client", "--addr", cluster.address, "--prompt", "Once upon a time", "--max-tokens", str(MAX_TOKENS)]
    flags += ["--ignore-eos", "--frequency-penalty", "1.0", "--logprobs", "1", "--json"]
    assert cli.main(flags) == 0
    record = json.loads(capsys.readouterr().out)
    expected = greedy_completion(TOKENIZER.encode("Once upon a time"), MAX_TOKENS, frequency_penalty=1.0, logprobs=1)
    assert record["token_ids"] == expected.token_ids
    assert [lp["logprob"] for lp in record["logprobs"]] == pytest.approx([lp.logprob for lp in expected.logprobs])
    assert cli.main([*flags, "--top-p", "0"]) == 2  # checked before anything is sent
    assert "invalid sampling.top_p" in capsys.readouterr().err


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
    assert attrs["enduser.id"] == "user-7"


BAD_COMPLETIONS = [
    ({"n": 17}, "n"),
    ({"logit_bias": {"5": 101}}, "logit_bias[5]"),
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
    ({"seed": -1}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"extra_body": {"top_k": -2}}, "top_k"),
    ({"extra_body": {"priority": "high"}}, "priority"),
    ({"extra_body": {"slo": {"ttft_ms": -1}}}, "slo.ttft_ms"),
    ({"extra_body": {"slo": {"e2e_ms": 5}}}, "slo.e2e_ms"),
    ({"extra_body": {"best_of": 2}}, "best_of"),
    ({"prompt": [10**6]}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
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
    meanwhile /health says 503 and a new request is refused with 503, as gRPC is while draining."""
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
    *rest, last = list(stream)
    assert [first, *rest][-1].choices[0].finish_reason == "length"
    assert last.usage.completion_tokens == 400
    assert cluster.proc.wait(timeout=60) == 0
