"""Validating and tokenizing a public GenerateRequest into what the router places and forwards."""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

from pdserve.engine.tokenizer import Tokenizer
from pdserve.errors import InvalidRequestError
from pdserve.protocol.model_config import ModelConfig
from pdserve.protocol.request_checks import check_request
from pdserve.protocol.sampling import SamplingParams
from pdserve.rpc.convert import sampling_from_pb
from pdserve.v1 import generate_pb2 as pb


@dataclass(frozen=True)
class RoutedRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    ttft_slo_ms: float
    tpot_slo_ms: float
    priority: int


def build_request(
    msg: pb.GenerateRequest, tokenizer: Tokenizer, model: ModelConfig, default_max_tokens: int
) -> RoutedRequest:
    """Raises InvalidRequestError naming the first bad field; nothing is sent anywhere before this passes."""
    given = [name for name, present in _inputs(msg) if present]
    if not given:
        raise InvalidRequestError("prompt", "set exactly one of prompt, prompt_token_ids or messages; none is set")
    if len(given) > 1:
        raise InvalidRequestError(given[1], f"set exactly one of prompt, prompt_token_ids or messages; got {given}")
    if msg.prompt_token_ids:
        prompt = list(msg.prompt_token_ids)
    elif msg.messages:
        prompt = tokenizer.apply_chat_template([(m.role, m.content) for m in msg.messages])
    else:
        prompt = tokenizer.encode(msg.prompt)
    sampling = sampling_from_pb(msg.sampling, default_max_tokens=min(default_max_tokens, _room(prompt, model)))
    check_request(prompt, sampling, model)
    for name in ("ttft_ms", "tpot_ms"):
        value = getattr(msg.slo, name)
        if math.isnan(value) or value < 0:
            raise InvalidRequestError(f"slo.{name}", f"must be >= 0 (0 = server default), got {value}")
    return RoutedRequest(
        request_id=msg.request_id or uuid.uuid4().hex,
        prompt_token_ids=prompt,
        sampling=sampling,
        ttft_slo_ms=msg.slo.ttft_ms,
        tpot_slo_ms=msg.slo.tpot_ms,
        priority=msg.priority,
    )


def _inputs(msg: pb.GenerateRequest) -> list[tuple[str, bool]]:
    return [
        ("prompt", bool(msg.prompt)),
        ("prompt_token_ids", bool(msg.prompt_token_ids)),
        ("messages", bool(msg.messages)),
    ]


def _room(prompt: list[int], model: ModelConfig) -> int:
    """The default max_tokens never pushes a prompt past the context; at least 1 so the check above speaks."""
    return max(1, model.max_position_embeddings - len(prompt))
