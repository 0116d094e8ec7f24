"""Validating and tokenizing a public GenerateRequest into what the router places and forwards.

Every cap is checked on the message as it arrived, before tokenizing: a bad request is answered in
microseconds and costs no tokenizer time. Large text is tokenized on a worker thread (the tokenizer
releases the GIL), so one huge prompt does not stall the other streams on the router's event loop.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import TypeVar

from pdserve.engine.tokenizer import Tokenizer
from pdserve.errors import InvalidRequestError
from pdserve.protocol.model_config import ModelConfig
from pdserve.protocol.request_checks import (
    RequestLimits,
    check_logit_bias,
    check_message_count,
    check_messages,
    check_prompt_length,
    check_prompt_text,
    check_request,
    check_request_id,
    check_slo_ms,
    check_stops,
    utf8_len,
)
from pdserve.protocol.sampling import SamplingParams
from pdserve.rpc.convert import off_the_loop_when_constrained, sampling_from_pb
from pdserve.security.api_keys import OPEN_TENANT
from pdserve.security.cache_salt import cache_salt
from pdserve.v1 import generate_pb2 as pb

_T = TypeVar("_T")

# Text up to this size is tokenized inline: about 4 ms on a slow 2-core VM, a stall the loop barely notices,
# and most prompts are this small, so they skip the thread hop.
INLINE_TOKENIZE_BYTES = 4096


@dataclass(frozen=True)
class RoutedRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    ttft_slo_ms: float
    tpot_slo_ms: float
    priority: int
    cache_salt: bytes = b""  # the prefix-cache salt of its tenant (and its own cache_salt)
    resumed_output_tokens: int = 0  # the prompt's last tokens are its own output: a stream moved after a failure
    tenant: str = OPEN_TENANT  # whose it is: the label on its latency metrics


async def build_request(
    msg: pb.GenerateRequest,
    tokenizer: Tokenizer,
    model: ModelConfig,
    default_max_tokens: int,
    limits: RequestLimits | None = None,
    tenant: str = OPEN_TENANT,
    kv_capacity_tokens: int | None = None,
) -> RoutedRequest:
    """Raises InvalidRequestError naming the first bad field; nothing is sent anywhere before this passes.
    `tenant` salts the request's prefix-cache keys and labels its latencies. `kv_capacity_tokens`: the most KV slots
    a request may fill on the cluster's largest worker (PlacementPolicy.kv_capacity_tokens), which a default
    max_tokens stays within as it does within the context."""
    field = _input_field(msg)
    salt = cache_salt(tenant, msg.cache_salt)
    _check_caps(msg, field, model, limits or RequestLimits())
    # The one conversion, checked before tokenizing.
    sampling = await off_the_loop_when_constrained(
        partial(sampling_from_pb, msg.sampling, default_max_tokens), msg.sampling
    )
    prompt = await _tokenize(msg, field, tokenizer)
    if not msg.sampling.max_tokens:  # the default never pushes the request past the context, nor any worker's KV
        sampling = replace(sampling, max_tokens=min(default_max_tokens, _room(prompt, model, kv_capacity_tokens)))
    check_request(prompt, sampling, model, prompt_field=field)
    return RoutedRequest(
        request_id=msg.request_id or uuid.uuid4().hex,
        prompt_token_ids=prompt,
        sampling=sampling,
        ttft_slo_ms=msg.slo.ttft_ms,
        tpot_slo_ms=msg.slo.tpot_ms,
        priority=msg.priority,
        cache_salt=salt,
        tenant=tenant,
    )


def capped_default(front_end_default: int | None, router_default: int) -> int:
    """A front end's max_tokens for a request without one, never past the router's own default."""
    return min(front_end_default or router_default, router_default)


def _input_field(msg: pb.GenerateRequest) -> str:
    """The one of prompt, prompt_token_ids and messages that is set."""
    given = [name for name in ("prompt", "prompt_token_ids", "messages") if len(getattr(msg, name))]
    if not given:
        raise InvalidRequestError(  # proto3 sends an empty string as no field at all: no "empty" to say apart
            "prompt",
            "set exactly one of prompt, prompt_token_ids or messages; none is set (an empty prompt counts as unset)",
        )
    if len(given) > 1:
        raise InvalidRequestError(given[1], f"set exactly one of prompt, prompt_token_ids or messages; got {given}")
    return given[0]


def _check_caps(msg: pb.GenerateRequest, field: str, model: ModelConfig, limits: RequestLimits) -> None:
    """Counts and sizes only: nothing here costs more than reading the message once."""
    check_request_id(msg.request_id, limits)
    check_stops(msg.sampling.stop, msg.sampling.stop_token_ids, limits)
    check_logit_bias(len(msg.sampling.logit_bias), limits)
    if field == "prompt":
        check_prompt_text(msg.prompt, limits, model)
    elif field == "messages":
        check_message_count(len(msg.messages), limits)  # before the pairs are built
        check_messages([(m.role, m.content) for m in msg.messages], limits, model)
    else:
        check_prompt_length(field, len(msg.prompt_token_ids), model)
    check_slo_ms("slo.ttft_ms", msg.slo.ttft_ms)
    check_slo_ms("slo.tpot_ms", msg.slo.tpot_ms)


async def _tokenize(msg: pb.GenerateRequest, field: str, tokenizer: Tokenizer) -> list[int]:
    if field == "prompt_token_ids":
        return list(msg.prompt_token_ids)
    if field == "messages":
        messages = [(m.role, m.content) for m in msg.messages]
        size = sum(utf8_len(content) for _, content in messages)
        return await _off_loop_if_large(size, tokenizer.apply_chat_template, messages)
    return await _off_loop_if_large(utf8_len(msg.prompt), tokenizer.encode_prompt, msg.prompt)


async def _off_loop_if_large(size: int, fn: Callable[[_T], list[int]], arg: _T) -> list[int]:
    if size <= INLINE_TOKENIZE_BYTES:
        return fn(arg)
    return await asyncio.to_thread(fn, arg)


def _room(prompt: list[int], model: ModelConfig, kv_capacity_tokens: int | None) -> int:
    """At least 1, which SamplingParams requires; check_request then names a prompt that fills the context, and
    admission one that fills the KV alone. The last token sampled takes no KV slot (`kv_tokens`)."""
    room = model.max_position_embeddings - len(prompt)
    if kv_capacity_tokens is not None:
        room = min(room, kv_capacity_tokens - len(prompt) + 1)
    return max(1, room)
