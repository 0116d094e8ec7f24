"""One request, one meaning on both public APIs. Each case is a gRPC GenerateRequest and the OpenAI HTTP body that
asks for the same thing: the body converted as the HTTP API converts it (parse_request), each request built as the
router builds every request (build_request). Both are served alike (the same prompt ids, sampling, priority, SLOs
and cache salt) or refused alike (the same message, naming the field in each API's own terms)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest

from pdserve.engine.models import resolve_model
from pdserve.engine.tokenizer import Tokenizer
from pdserve.errors import InvalidRequestError
from pdserve.protocol.model_config import ModelConfig
from pdserve.protocol.request_checks import RequestLimits
from pdserve.v1 import generate_pb2 as pb
from services.router.http.openai_request import openai_param, parse_request
from services.router.request import RoutedRequest, build_request

FOLDER = resolve_model("tiny-random")
TOKENIZER = Tokenizer(FOLDER)
MODEL = ModelConfig.from_hf(json.loads((FOLDER / "config.json").read_text()))
PROMPT = [5, 6, 7]
# Greedy and 4 tokens on each: the APIs' defaults differ on purpose (temperature 0 on gRPC, OpenAI's 1.0 over HTTP).
GREEDY = {"max_tokens": 4, "temperature": 0}

# (gRPC request's fields, HTTP body's parameters past GREEDY): both ask for PROMPT, unless they give messages (a chat).
CASES = {
    "top_k -1 is off": ({"sampling": {"top_k": -1}}, {"top_k": -1}),
    "top_k below -1": ({"sampling": {"top_k": -2}}, {"top_k": -2}),
    "top_k on": ({"sampling": {"top_k": 5}}, {"top_k": 5}),
    "top_p past 1": ({"sampling": {"top_p": 1.5}}, {"top_p": 1.5}),
    "top_p below 0": ({"sampling": {"top_p": -0.5}}, {"top_p": -0.5}),
    "repetition_penalty below 0": ({"sampling": {"repetition_penalty": -1}}, {"repetition_penalty": -1}),
    "temperature below 0": ({"sampling": {"temperature": -1}}, {"temperature": -1}),
    "presence_penalty past 2": ({"sampling": {"presence_penalty": 3}}, {"presence_penalty": 3}),
    "logprobs past 20": ({"sampling": {"logprobs": 21}}, {"logprobs": 21}),
    "an empty stop string": ({"sampling": {"stop": [""]}}, {"stop": ""}),
    "a bias past 100": ({"sampling": {"logit_bias": {5: 200}}}, {"logit_bias": {"5": 200}}),
    "max_tokens past the context": ({"sampling": {"max_tokens": 5000}}, {"max_tokens": 5000}),
    "a negative SLO": ({"slo": {"ttft_ms": -1}}, {"slo": {"ttft_ms": -1}}),
    "a regex": ({"sampling": {"regex": "[ab]{3}"}}, {"regex": "[ab]{3}"}),
    "a regex that does not compile": ({"sampling": {"regex": "[ab"}}, {"regex": "[ab"}),
    "a regex past 64 KiB": ({"sampling": {"regex": "a" * 65537}}, {"regex": "a" * 65537}),
    "a regex and a JSON object": (
        {"sampling": {"regex": "a", "json_object": True}},
        {"regex": "a", "response_format": {"type": "json_object"}},
    ),
    "a cache salt": ({"cache_salt": "team-a"}, {"cache_salt": "team-a"}),
    "a cache salt past 256 bytes": ({"cache_salt": "s" * 257}, {"cache_salt": "s" * 257}),
    "a developer message": (
        {"messages": [pb.ChatMessage(role="developer", content="be brief"), pb.ChatMessage(role="user", content="hi")]},
        {"messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]},
    ),
    "an unknown role": (
        {"messages": [pb.ChatMessage(role="wizard", content="hi")]},
        {"messages": [{"role": "wizard", "content": "hi"}]},
    ),
}


def grpc_request(fields: dict[str, object]) -> pb.GenerateRequest:
    sampling = {"max_tokens": GREEDY["max_tokens"], **fields.get("sampling", {})}  # type: ignore[dict-item]
    msg = pb.GenerateRequest(**{**fields, "sampling": pb.SamplingParams(**sampling)})  # type: ignore[arg-type]
    if not msg.messages:
        msg.prompt_token_ids.extend(PROMPT)
    return msg


def served(msg: pb.GenerateRequest) -> RoutedRequest:
    routed = asyncio.run(build_request(msg, TOKENIZER, MODEL, 256, RequestLimits()))
    return replace(routed, request_id="")  # each API's own, or a uuid


def grpc_answer(fields: dict[str, object]) -> RoutedRequest | tuple[str, str]:
    try:
        return served(grpc_request(fields))
    except InvalidRequestError as e:
        return openai_param(e.field), str(e).removeprefix(f"{e.field}: ")


def http_answer(params: dict[str, object]) -> RoutedRequest | tuple[str, str]:
    chat = "messages" in params
    body = {"model": "m", **({} if chat else {"prompt": PROMPT}), **GREEDY, **params}
    try:
        req = parse_request(body, chat, limits=RequestLimits(), model_config=MODEL)
        return served(req.message)
    except InvalidRequestError as e:
        return openai_param(e.field), str(e).removeprefix(f"{e.field}: ")


@pytest.mark.parametrize(("grpc_fields", "http_params"), CASES.values(), ids=CASES.keys())
def test_both_apis_serve_or_refuse_a_request_alike(grpc_fields, http_params):
    assert http_answer(http_params) == grpc_answer(grpc_fields)


def test_a_developer_message_is_a_system_message_on_either_api():
    """OpenAI's newer name for the system role, which chat templates know by the older one."""
    developer = grpc_request({"messages": [pb.ChatMessage(role="developer", content="be brief")]})
    system = grpc_request({"messages": [pb.ChatMessage(role="system", content="be brief")]})
    assert served(developer) == served(system)
