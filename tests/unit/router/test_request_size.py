"""The router's public size bounds, derived from what a valid request can hold: the largest valid request of each
shape fits (JSON escaped byte for byte, a full completions batch, every list at its cap; a protobuf message likewise),
the bounds stay within [1, 16] MiB whatever the model, an explicit `max_http_body_bytes` wins, and the HTTP API refuses
a body past the default unread."""

from __future__ import annotations

import dataclasses
import json
import logging

from pdserve.config import MAX_MESSAGE_BYTES, RouterConfig
from pdserve.engine.model_files import locate_model, read_model_config
from pdserve.protocol.request_checks import RequestLimits
from pdserve.v1 import generate_pb2 as pb
from services.router.http.openai_prompts import MAX_CHOICES
from services.router.lifecycle import RequestLifecycle
from services.router.request_size import (
    MIN_REQUEST_BYTES,
    http_body_limit,
    max_grpc_request_bytes,
    max_json_body_bytes,
)
from tests.unit.router.router_builder import Router
from tests.unit.router.test_http_bodies import Upload, outcomes, upload

LIMITS = RequestLimits()
MODELS = [read_model_config(locate_model(m)) for m in ("tiny-random", "smollm2-135m")]
UINT32 = 2**32 - 1


def _lists(limits: RequestLimits) -> dict[str, object]:
    """Every list a body may carry, at its cap, its items as long as they may be and escaped where text."""
    return {
        "stop": ["\x01" * limits.max_stop_bytes] * limits.max_stop,
        "stop_token_ids": [UINT32] * limits.max_stop_token_ids,
        "logit_bias": {str(UINT32 - i): -99.99999999999999 for i in range(limits.max_logit_bias)},
    }


def test_the_largest_valid_json_bodies_fit() -> None:
    for model in MODELS:
        text = LIMITS.max_prompt_bytes(model)
        contents = ["\x01" * (text // LIMITS.max_messages)] * LIMITS.max_messages
        bodies = {
            "chat, every byte escaped": {
                "model": "m",
                "messages": [{"role": "assistant", "content": [{"type": "text", "text": c}]} for c in contents],
            },
            "one prompt, every byte escaped": {"model": "m", "prompt": "\x01" * text},
            "a batch of full prompts": {"model": "m", "prompt": ["x" * text] * MAX_CHOICES},
            "a batch of full token-id prompts": {
                "model": "m",
                "prompt": [[model.vocab_size - 1] * (model.max_position_embeddings - 1)] * MAX_CHOICES,
            },
        }
        limit = max_json_body_bytes(LIMITS, model)
        for shape, body in bodies.items():
            raw = json.dumps(body | _lists(LIMITS), indent=1)  # a pretty-printer's newlines and indents too
            assert len(raw) <= limit, (model.max_position_embeddings, shape, len(raw), limit)


def test_the_largest_valid_grpc_messages_fit() -> None:
    for model in MODELS:
        text = LIMITS.max_prompt_bytes(model)
        sampling = pb.SamplingParams(
            stop=["é" * (LIMITS.max_stop_bytes // 2)] * LIMITS.max_stop,
            stop_token_ids=[UINT32] * LIMITS.max_stop_token_ids,
            logit_bias={UINT32 - i: -100.0 for i in range(LIMITS.max_logit_bias)},
        )
        common = {"request_id": "😀" * LIMITS.max_request_id_chars, "sampling": sampling, "cache_salt": "s" * 256}
        part = text // LIMITS.max_messages
        messages = [pb.ChatMessage(role="assistant", content="x" * part) for _ in range(LIMITS.max_messages)]
        ids = [UINT32] * (model.max_position_embeddings - 1)
        limit = max_grpc_request_bytes(LIMITS, model)
        for msg in (
            pb.GenerateRequest(prompt="x" * text, **common),
            pb.GenerateRequest(messages=messages, **common),
            pb.GenerateRequest(prompt_token_ids=ids, **common),
        ):
            assert msg.ByteSize() <= limit, (model.max_position_embeddings, msg.ByteSize(), limit)


def test_the_bounds_lie_between_a_floor_and_the_grpc_message_limit() -> None:
    small, large = MODELS[0], dataclasses.replace(MODELS[0], max_position_embeddings=2**20)
    assert max_grpc_request_bytes(LIMITS, small) == MIN_REQUEST_BYTES  # a tiny model's bodies still fit a margin
    assert MIN_REQUEST_BYTES <= max_json_body_bytes(LIMITS, small) < 2 * MIN_REQUEST_BYTES
    assert max_json_body_bytes(LIMITS, large) == max_grpc_request_bytes(LIMITS, large) == MAX_MESSAGE_BYTES
    bigger = dataclasses.replace(LIMITS, max_logit_bias=100_000)  # raised limits raise the bounds
    assert max_json_body_bytes(bigger, small) > max_json_body_bytes(LIMITS, small)


def test_an_explicit_body_limit_wins_over_the_derived_one() -> None:
    model = MODELS[1]
    assert http_body_limit(RouterConfig(), model) == max_json_body_bytes(LIMITS, model)
    assert http_body_limit(RouterConfig(max_http_body_bytes=65536), model) == 65536
    assert http_body_limit(RouterConfig(max_http_body_bytes=64 * 2**20), model) == 64 * 2**20


async def test_by_default_a_body_past_what_a_valid_request_holds_is_a_413_unread(caplog):
    """Bounded by gRPC's 16 MiB, a 10 MiB body of a million logit_bias entries was read and parsed on the loop every
    stream shares (0.8 s); the default now is what a valid body can hold at tiny-random's context (~1.7 MB)."""
    lifecycle: RequestLifecycle = Router([], no_workers_wait_s=0.1).lifecycle()
    limit = max_json_body_bytes(lifecycle.config.request_limits, lifecycle.model)
    assert limit < 2 * 2**20
    body = Upload(b" " * 2**20, 10)
    with caplog.at_level(logging.INFO, logger="services.router.lifecycle"):
        r = await upload(lifecycle, body, {"content-length": str(10 * 2**20)})
    assert r.status_code == 413, r.text
    assert r.json()["error"]["message"] == f"body: is larger than this router's limit of {limit} bytes"
    assert body.taken == 0 and outcomes(caplog) == ["invalid"]
