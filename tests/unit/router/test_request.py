"""Building a RoutedRequest: every cap and every bad value is INVALID_ARGUMENT naming its field, checked
before tokenizing; large prompts are tokenized off the event loop."""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import replace

import pytest

from pdserve.engine.models import resolve_model
from pdserve.engine.tokenizer import Tokenizer
from pdserve.errors import InvalidRequestError
from pdserve.protocol.model_config import ModelConfig
from pdserve.protocol.request_checks import RequestLimits
from pdserve.telemetry import request_id_var
from pdserve.v1 import generate_pb2 as pb
from services.router.generation import generate
from services.router.request import INLINE_TOKENIZE_BYTES, build_request
from tests.unit.router.router_builder import Router, worker

LIMITS = RequestLimits()
DEFAULT_MAX_TOKENS = 256


@pytest.fixture(scope="module")
def tiny() -> tuple[Tokenizer, ModelConfig]:
    folder = resolve_model("tiny-random")  # byte-level tokenizer, 259 ids, a 4096-token context
    return Tokenizer(folder), ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))


class NoTokenizer:
    """Raises Tokenized on any use: what the caps reject must never reach the tokenizer."""

    def __getattr__(self, name: str) -> object:
        raise Tokenized(f"tokenizer.{name} used")


def build(msg: pb.GenerateRequest, tokenizer: object, model: ModelConfig, limits: RequestLimits = LIMITS):
    return asyncio.run(build_request(msg, tokenizer, model, DEFAULT_MAX_TOKENS, limits))  # type: ignore[arg-type]


def hi(**sampling: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(**sampling))


def chat(*contents: str, role: str = "user") -> pb.GenerateRequest:
    return pb.GenerateRequest(messages=[pb.ChatMessage(role=role, content=c) for c in contents])


TEXT_CAP = LIMITS.prompt_bytes_per_token * 4096  # tiny-random's context
REJECTED_BEFORE_TOKENIZING = {
    "request_id too long": (
        pb.GenerateRequest(request_id="r" * (LIMITS.max_request_id_chars + 1), prompt="hi"),
        "request_id",
    ),
    # Echoed in metadata and HTTP headers (printable ASCII) and recorded in every log line and span: a newline
    # or a non-ASCII id came back only in the messages, and over HTTP garbled.
    "request_id not ASCII": (pb.GenerateRequest(request_id="café-1", prompt="hi"), "request_id"),
    "request_id with a newline": (pb.GenerateRequest(request_id="a\nrequest finished", prompt="hi"), "request_id"),
    "request_id with a DEL": (pb.GenerateRequest(request_id="a\x7f", prompt="hi"), "request_id"),
    "too many stop strings": (hi(stop=[f"s{i}" for i in range(LIMITS.max_stop + 1)]), "sampling.stop"),
    "stop string too long": (hi(stop=["ok", "x" * (LIMITS.max_stop_bytes + 1)]), "sampling.stop[1]"),
    "stop string too long in UTF-8 bytes": (hi(stop=["€" * (LIMITS.max_stop_bytes // 3 + 1)]), "sampling.stop[0]"),
    "too many stop token ids": (hi(stop_token_ids=[5] * (LIMITS.max_stop_token_ids + 1)), "sampling.stop_token_ids"),
    "too many logit biases": (
        hi(logit_bias=dict.fromkeys(range(LIMITS.max_logit_bias + 1), 1.0)),
        "sampling.logit_bias",
    ),
    "logit bias out of range": (hi(logit_bias={5: -101.0}), "sampling.logit_bias[5]"),
    "too many messages": (chat(*["hi"] * (LIMITS.max_messages + 1)), "messages"),
    "one message too large": (chat("hi", "x" * (TEXT_CAP + 1)), "messages[1].content"),
    "messages together too large": (chat("x" * (TEXT_CAP // 2 + 1), "y" * (TEXT_CAP // 2)), "messages"),
    "unknown role, however long": (chat("hi", role="wizard" * 10_000), "messages[0].role"),
    "prompt too large": (pb.GenerateRequest(prompt="x" * (TEXT_CAP + 1)), "prompt"),
    "prompt too large in UTF-8 bytes": (pb.GenerateRequest(prompt="é" * (TEXT_CAP // 2 + 1)), "prompt"),
    "prompt ids fill the context": (pb.GenerateRequest(prompt_token_ids=[5] * 4096), "prompt_token_ids"),
    "+inf temperature": (hi(temperature=math.inf), "sampling.temperature"),
    "-inf temperature": (hi(temperature=-math.inf), "sampling.temperature"),
    "nan temperature": (hi(temperature=math.nan), "sampling.temperature"),
    "negative temperature": (hi(temperature=-1), "sampling.temperature"),
    "+inf top_p": (hi(top_p=math.inf), "sampling.top_p"),
    "-inf top_p": (hi(top_p=-math.inf), "sampling.top_p"),
    "nan top_p": (hi(top_p=math.nan), "sampling.top_p"),
    "negative top_p": (hi(top_p=-0.5), "sampling.top_p"),
    "top_p above 1": (hi(top_p=1.5), "sampling.top_p"),
    "negative top_k": (hi(top_k=-3), "sampling.top_k"),
    "empty stop string": (hi(stop=[""]), "sampling.stop"),
    "+inf ttft slo": (pb.GenerateRequest(prompt="hi", slo=pb.SLO(ttft_ms=math.inf)), "slo.ttft_ms"),
    "-inf ttft slo": (pb.GenerateRequest(prompt="hi", slo=pb.SLO(ttft_ms=-math.inf)), "slo.ttft_ms"),
    "nan ttft slo": (pb.GenerateRequest(prompt="hi", slo=pb.SLO(ttft_ms=math.nan)), "slo.ttft_ms"),
    "+inf tpot slo": (pb.GenerateRequest(prompt="hi", slo=pb.SLO(tpot_ms=math.inf)), "slo.tpot_ms"),
    "-inf tpot slo": (pb.GenerateRequest(prompt="hi", slo=pb.SLO(tpot_ms=-math.inf)), "slo.tpot_ms"),
    "nan tpot slo": (pb.GenerateRequest(prompt="hi", slo=pb.SLO(tpot_ms=math.nan)), "slo.tpot_ms"),
    "negative tpot slo": (pb.GenerateRequest(prompt="hi", slo=pb.SLO(tpot_ms=-1)), "slo.tpot_ms"),
    "no input": (pb.GenerateRequest(), "prompt"),
    "two inputs": (pb.GenerateRequest(prompt="hi", prompt_token_ids=[1, 2]), "prompt_token_ids"),
}


@pytest.mark.parametrize("case", list(REJECTED_BEFORE_TOKENIZING))
def test_rejected_naming_the_field_before_any_tokenizing(tiny, case):
    msg, field = REJECTED_BEFORE_TOKENIZING[case]
    with pytest.raises(InvalidRequestError) as err:
        build(msg, NoTokenizer(), tiny[1])
    assert err.value.field == field
    assert len(str(err.value)) < 500  # a huge value is measured, never echoed back


REJECTED_AFTER_TOKENIZING = {
    "ids outside the vocabulary": (pb.GenerateRequest(prompt_token_ids=[1, 259]), "prompt_token_ids"),
    "stop id outside the vocabulary": (hi(stop_token_ids=[259]), "sampling.stop_token_ids"),
    "prompt + max_tokens beyond the context": (hi(max_tokens=4095), "sampling.max_tokens"),
    "text prompt fills the context": (pb.GenerateRequest(prompt="x" * 4096), "prompt"),
    "chat fills the context": (chat("x" * 4096), "messages"),
}


@pytest.mark.parametrize("case", list(REJECTED_AFTER_TOKENIZING))
def test_model_checks_name_the_field(tiny, case):
    msg, field = REJECTED_AFTER_TOKENIZING[case]
    with pytest.raises(InvalidRequestError) as err:
        build(msg, *tiny)
    assert err.value.field == field


def test_max_tokens_past_the_context_is_told_the_most_this_prompt_allows(tiny):
    with pytest.raises(InvalidRequestError) as err:
        build(hi(max_tokens=4095), *tiny)  # "hi": 2 tokens of tiny-random's byte-level 4096
    assert "= 4097 exceeds the model's context of 4096 tokens: at most 4094 for this prompt" in str(err.value)


AT_THE_CAPS = {
    "request_id": pb.GenerateRequest(request_id="r" * LIMITS.max_request_id_chars, prompt="hi"),
    "request_id of every printable ASCII character": pb.GenerateRequest(
        request_id="".join(map(chr, range(0x20, 0x7F))), prompt="hi"
    ),
    "stop strings": hi(stop=["x" * LIMITS.max_stop_bytes] + [f"s{i}" for i in range(LIMITS.max_stop - 1)]),
    "stop string in UTF-8 bytes": hi(stop=["€" * (LIMITS.max_stop_bytes // 3)]),
    "stop token ids": hi(stop_token_ids=[5] * LIMITS.max_stop_token_ids),
    "messages": chat(*["hi"] * LIMITS.max_messages),
    "one message": chat("x" * TEXT_CAP),
    "messages together": chat("x" * (TEXT_CAP // 2), "y" * (TEXT_CAP // 2)),
    "prompt": pb.GenerateRequest(prompt="x" * TEXT_CAP),
    "prompt in UTF-8 bytes": pb.GenerateRequest(prompt="é" * (TEXT_CAP // 2)),
    "prompt ids": pb.GenerateRequest(prompt_token_ids=[5] * 4095),
    "large finite values": pb.GenerateRequest(
        prompt="hi", sampling=pb.SamplingParams(temperature=1e30), slo=pb.SLO(ttft_ms=1e30, tpot_ms=1e30)
    ),
}


class Tokenized(Exception):
    """Raised by NoTokenizer: the request got past every cap."""


@pytest.mark.parametrize("case", list(AT_THE_CAPS))
def test_exactly_at_each_cap_the_request_goes_on(tiny, case):
    """The caps are `at most`: a request at each bound gets past them to the tokenizer (or, already
    tokenized, all the way)."""
    try:
        build(AT_THE_CAPS[case], NoTokenizer(), tiny[1])
    except Tokenized:
        return
    assert AT_THE_CAPS[case].prompt_token_ids, "only ids need no tokenizer"


def test_a_request_at_the_caps_builds_whole(tiny):
    stops = ["€" * (LIMITS.max_stop_bytes // 3)] + [f"s{i}" for i in range(LIMITS.max_stop - 1)]
    msg = pb.GenerateRequest(
        request_id="r" * LIMITS.max_request_id_chars,
        prompt="x" * 4000,
        sampling=pb.SamplingParams(max_tokens=4, stop=stops, stop_token_ids=[5] * LIMITS.max_stop_token_ids),
    )
    req = build(msg, *tiny)
    assert req.request_id == msg.request_id
    assert req.sampling.stop == tuple(stops)
    assert req.sampling.stop_token_ids == (5,) * LIMITS.max_stop_token_ids
    assert len(req.prompt_token_ids) == 4000


def test_limits_are_configurable(tiny):
    strict = RequestLimits(max_stop=1, max_request_id_chars=3, prompt_bytes_per_token=1)
    cases = [
        (hi(stop=["a", "b"]), "sampling.stop"),
        (pb.GenerateRequest(request_id="abcd", prompt="hi"), "request_id"),
        (pb.GenerateRequest(prompt="x" * 4097), "prompt"),  # 1 byte per token of a 4096-token context
    ]
    for msg, field in cases:
        with pytest.raises(InvalidRequestError) as err:
            build(msg, NoTokenizer(), tiny[1], strict)
        assert err.value.field == field
        with pytest.raises(Tokenized):  # the defaults let each of them through
            build(msg, NoTokenizer(), tiny[1])


def test_a_limit_below_one_is_a_configuration_error():
    with pytest.raises(ValueError, match="max_stop_token_ids"):
        RequestLimits(max_stop_token_ids=0)


def test_sampling_is_converted_once_with_the_default_max_tokens_bounded_by_the_context(tiny):
    tokenizer, model = tiny
    req = build(pb.GenerateRequest(prompt="x" * 4000, sampling=pb.SamplingParams(temperature=0.5, seed=7)), *tiny)
    assert req.sampling.max_tokens == 96  # 4096 - 4000 < the default of 256
    assert (req.sampling.temperature, req.sampling.seed, req.sampling.top_p) == (0.5, 7, 1.0)
    assert build(hi(), tokenizer, model).sampling.max_tokens == DEFAULT_MAX_TOKENS
    assert build(hi(max_tokens=3), tokenizer, model).sampling.max_tokens == 3
    assert len(build(hi(), tokenizer, model).request_id) == 32  # made by the router when the client sets none


def _steps_to_finish(msg: pb.GenerateRequest, tokenizer: Tokenizer, model: ModelConfig) -> int:
    """How many times the build suspends before it returns: 0 means it never yielded the loop."""

    async def count() -> int:
        task = asyncio.ensure_future(build_request(msg, tokenizer, model, DEFAULT_MAX_TOKENS))
        steps = 0
        while not task.done():
            await asyncio.sleep(0)
            steps += 1
        task.result()
        return steps

    return asyncio.run(count())


def test_small_prompts_are_tokenized_inline_large_ones_on_a_thread(tiny):
    tokenizer, model = tiny[0], replace(tiny[1], max_position_embeddings=2 * INLINE_TOKENIZE_BYTES)
    small = pb.GenerateRequest(prompt="x" * INLINE_TOKENIZE_BYTES)
    assert _steps_to_finish(small, tokenizer, model) == 1  # the task ran to its end in its first step
    large = pb.GenerateRequest(prompt="x" * (INLINE_TOKENIZE_BYTES + 1))
    assert _steps_to_finish(large, tokenizer, model) > 1
    large_chat = chat("x" * (INLINE_TOKENIZE_BYTES + 1))
    assert _steps_to_finish(large_chat, tokenizer, model) > 1


@pytest.mark.latency
def test_tokenizing_a_huge_prompt_leaves_the_loop_free(tiny):
    """Another coroutine keeps running while a cap-sized prompt tokenizes: its longest wait is a small share
    of the tokenizing time measured in the same run (inline, it would wait all of it)."""
    tokenizer, model = tiny
    big = replace(model, max_position_embeddings=TEXT_CAP * 4 + 8)
    msg = pb.GenerateRequest(
        prompt="The quick brown fox. " * (TEXT_CAP * 4 // 21), sampling=pb.SamplingParams(max_tokens=1)
    )
    start = time.perf_counter()
    tokenizer.encode(msg.prompt)
    tokenize_s = time.perf_counter() - start

    async def race() -> tuple[float, int]:
        gaps: list[float] = []
        build = asyncio.ensure_future(build_request(msg, tokenizer, big, DEFAULT_MAX_TOKENS))
        while not build.done():
            t = time.perf_counter()
            await asyncio.sleep(0)
            gaps.append(time.perf_counter() - t)
        assert len(build.result().prompt_token_ids) == len(msg.prompt)  # the byte tokenizer: one id per byte
        return max(gaps), len(gaps)

    # The best of three races: a CPU-starved moment can stall one, while inline tokenizing would stall all three.
    races = [asyncio.run(race()) for _ in range(3)]
    longest_gap_s, ticks = min(races)
    assert ticks > 10
    assert longest_gap_s < tokenize_s / 4, f"loop stalled {longest_gap_s * 1e3:.1f} ms of {tokenize_s * 1e3:.1f} ms"


def test_an_oversized_request_id_is_refused_before_it_tags_the_log_lines():
    async def run() -> str | None:
        lc = Router([worker("p0"), worker("d0", "decode")]).lifecycle()
        msg = pb.GenerateRequest(request_id="r" * 1_000_000, prompt="hi")
        with pytest.raises(InvalidRequestError, match="request_id"):
            async for _ in generate(lc, msg, {}, lambda: 10.0, lambda ticket: asyncio.sleep(0)):
                pass
        return request_id_var.get()

    assert asyncio.run(run()) is None


def test_an_empty_prompt_is_refused_saying_it_counts_as_unset(tiny):
    """proto3 cannot tell an empty prompt from none: the message said only "none is set" to a caller who sent one."""
    with pytest.raises(InvalidRequestError) as err:
        build(pb.GenerateRequest(prompt=""), NoTokenizer(), tiny[1])
    assert err.value.field == "prompt"
    assert str(err.value).endswith("none is set (an empty prompt counts as unset)")
