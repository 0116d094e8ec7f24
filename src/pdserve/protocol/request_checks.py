"""The checks a request must pass wherever it enters: the router, before placement, and the engine itself.

Two kinds. Caps (RequestLimits): counts and lengths of what the client sent, cheap to check and checked
before anything expensive (tokenization, placement). Model checks (check_request): the token ids against
the model's vocabulary and context. Field names follow the public API (`sampling.max_tokens`), so the
error reads the same from any entry.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

from pdserve.errors import WITHHELD, InvalidRequestError
from pdserve.protocol.model_config import ModelConfig
from pdserve.protocol.sampling import SamplingParams, shown

CHAT_ROLES = ("system", "user", "assistant", "tool")
# OpenAI's `developer` messages are what `system` messages were before its o-series; chat templates know `system`.
# Taken on both public APIs: an OpenAI conversation sent over gRPC means what it means over HTTP.
ROLE_ALIASES = {"developer": "system"}
# A request's prompt logprobs travel in one message (the first with a token, as the public API has it), which gRPC
# bounds at 16 MiB (`config.MAX_MESSAGE_BYTES`): past it the send fails as RESOURCE_EXHAUSTED, which reads as a shed
# that a retry could pass. At most this much of it, at 16 + 9 bytes per prompt token and alternative (measured: 192
# bytes a token with 20 alternatives of 31-bit ids).
PROMPT_LOGPROBS_MAX_BYTES = 12 * 2**20


@dataclass(frozen=True)
class RequestLimits:
    """What one request may carry; a router configuration may change any of them.

    Prompt text is capped per token of the model's context, not in absolute bytes: tokenizing is the cost
    being bounded (1 MiB of English took 1.2 s with SmolLM2's tokenizer on a 2-core VM), and text many
    times longer than the context can hold cannot fit anyway. English averages about 4 bytes per token;
    16 leaves room for code, whitespace runs and non-Latin scripts (SmolLM2, 8192 tokens: 128 KiB).
    """

    max_request_id_chars: int = 256
    max_stop: int = 16  # stop strings
    max_stop_bytes: int = 256  # each stop string, UTF-8
    max_stop_token_ids: int = 64
    max_logit_bias: int = 1024  # token ids in logit_bias
    max_messages: int = 1024
    prompt_bytes_per_token: int = 16  # prompt text, or all messages' contents together, per context token

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"RequestLimits.{f.name} must be at least 1, got {getattr(self, f.name)}")

    def max_prompt_bytes(self, model: ModelConfig) -> int:
        return self.prompt_bytes_per_token * model.max_position_embeddings


def check_request_id(request_id: str, limits: RequestLimits) -> None:
    if len(request_id) > limits.max_request_id_chars:
        raise InvalidRequestError(
            "request_id", f"{len(request_id)} characters; at most {limits.max_request_id_chars} are accepted"
        )
    check_request_id_characters(request_id, "request_id")


def check_request_id_characters(request_id: str, field: str) -> None:
    """Printable ASCII only: the id travels in gRPC metadata and HTTP headers, which carry nothing else (a UTF-8
    X-Request-Id was read as Latin-1 and answered garbled; a gRPC id of other characters came back in no metadata),
    and it is recorded in every log line and span of the request, where a control character has no business."""
    if (at := non_printable_ascii(request_id)) is not None:
        raise InvalidRequestError(
            field, f"character {at} ({ascii(request_id[at])}) is not printable ASCII, which a request id must be"
        )


def non_printable_ascii(text: str) -> int | None:
    """The index of the first character outside printable ASCII (space to `~`), or None."""
    return next((i for i, c in enumerate(text) if not " " <= c <= "~"), None)


def check_stops(stop: Sequence[str], stop_token_ids: Sequence[int], limits: RequestLimits) -> None:
    check_stop_counts(len(stop), len(stop_token_ids), limits)
    for i, s in enumerate(stop):
        if utf8_len(s) > limits.max_stop_bytes:
            raise InvalidRequestError(
                f"sampling.stop[{i}]", f"{utf8_len(s)} bytes; at most {limits.max_stop_bytes} per stop string"
            )


def check_stop_counts(num_stop: int, num_stop_token_ids: int, limits: RequestLimits) -> None:
    if num_stop > limits.max_stop:
        raise InvalidRequestError("sampling.stop", f"{num_stop} stop strings; at most {limits.max_stop}")
    if num_stop_token_ids > limits.max_stop_token_ids:
        raise InvalidRequestError(
            "sampling.stop_token_ids", f"{num_stop_token_ids} ids; at most {limits.max_stop_token_ids}"
        )


def check_logit_bias(count: int, limits: RequestLimits) -> None:
    if count > limits.max_logit_bias:
        raise InvalidRequestError("sampling.logit_bias", f"{count} token ids; at most {limits.max_logit_bias}")


def check_prompt_text(text: str, limits: RequestLimits, model: ModelConfig) -> None:
    cap = limits.max_prompt_bytes(model)
    if utf8_len(text) > cap:
        raise InvalidRequestError("prompt", f"{utf8_len(text)} bytes; at most {cap} ({_cap_reason(limits, model)})")


def check_messages(messages: Sequence[tuple[str, str]], limits: RequestLimits, model: ModelConfig) -> None:
    """(role, content) pairs: their number, each role, each content's size and all contents' together."""
    check_message_count(len(messages), limits)
    cap, total = limits.max_prompt_bytes(model), 0
    for i, (role, content) in enumerate(messages):
        check_role(i, role)
        size = utf8_len(content)
        if size > cap:
            raise InvalidRequestError(
                f"messages[{i}].content", f"{size} bytes; at most {cap} ({_cap_reason(limits, model)})"
            )
        total += size
    if total > cap:
        raise InvalidRequestError(
            "messages", f"contents total {total} bytes; at most {cap} ({_cap_reason(limits, model)})"
        )


def chat_role(role: str) -> str:
    """The role a chat template knows `role` as: itself, or the one its alias stands for."""
    return ROLE_ALIASES.get(role, role)


def check_role(index: int, role: str) -> None:
    if chat_role(role) not in CHAT_ROLES:
        known = (*CHAT_ROLES, *ROLE_ALIASES)
        field, choose = f"messages[{index}].role", f"use one of {known}"
        raise InvalidRequestError(field, f"unknown role {role[:32]!r}; {choose}", f"unknown role {WITHHELD}; {choose}")


def check_message_count(count: int, limits: RequestLimits) -> None:
    if count > limits.max_messages:
        raise InvalidRequestError("messages", f"{count} messages; at most {limits.max_messages}")


def check_prompt_length(field: str, num_tokens: int, model: ModelConfig) -> None:
    """A prompt must leave at least one token of the context to generate into."""
    context = model.max_position_embeddings
    if num_tokens >= context:
        raise InvalidRequestError(
            field, f"{num_tokens} tokens leave no room to generate in the model's context of {context} tokens"
        )


def kv_tokens(prompt_tokens: int, max_tokens: int) -> int:
    """The most KV slots a request fills: its prompt and each generated token but the last, which is sampled and
    never run through the model."""
    return prompt_tokens + max(max_tokens, 1) - 1


def check_slo_ms(field: str, value: float) -> None:
    if not math.isfinite(value) or value < 0:
        raise InvalidRequestError(field, f"must be a finite number >= 0 (0 = server default), got {shown(value)}")


def check_request(
    prompt_token_ids: list[int], sampling: SamplingParams, model: ModelConfig, prompt_field: str = "prompt_token_ids"
) -> None:
    """The token ids against the model; `prompt_field` names what the ids came from (prompt, messages)."""
    if not prompt_token_ids:
        raise InvalidRequestError("prompt", "the prompt is empty")
    check_prompt_length(prompt_field, len(prompt_token_ids), model)
    vocab = model.vocab_size
    check_vocabulary("prompt_token_ids", prompt_token_ids, vocab)
    check_vocabulary("sampling.stop_token_ids", sampling.stop_token_ids, vocab)
    check_vocabulary("sampling.logit_bias", [t for t, _ in sampling.logit_bias], vocab)
    if sampling.prompt_logprobs is not None:
        check_prompt_logprobs_size(len(prompt_token_ids), sampling.prompt_logprobs)
    total = len(prompt_token_ids) + sampling.max_tokens
    if total > model.max_position_embeddings:
        raise InvalidRequestError(
            "sampling.max_tokens",
            f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({sampling.max_tokens}) = {total} exceeds "
            f"the model's context of {model.max_position_embeddings} tokens: at most "
            f"{model.max_position_embeddings - len(prompt_token_ids)} for this prompt",
        )


def check_vocabulary(field: str, token_ids: Sequence[int], vocab: int) -> None:
    """The caller is shown the first ids outside the vocabulary; a log or span only how many (ids another model's
    tokenizer made are that prompt's text)."""
    bad = [t for t in token_ids if not 0 <= t < vocab]
    if bad:
        outside = f"are outside the vocabulary [0, {vocab})"
        raise InvalidRequestError(field, f"ids {bad[:5]} {outside}", f"{len(bad)} ids {outside}")


def check_prompt_logprobs_size(num_prompt_tokens: int, alternatives: int) -> None:
    per_token = 16 + 9 * alternatives
    if (num_prompt_tokens - 1) * per_token > PROMPT_LOGPROBS_MAX_BYTES:
        most = PROMPT_LOGPROBS_MAX_BYTES // per_token + 1
        raise InvalidRequestError(
            "sampling.prompt_logprobs",
            f"{alternatives} for a {num_prompt_tokens}-token prompt would not fit in one message; with "
            f"{alternatives} a prompt may have at most {most} tokens (ask for fewer alternatives or a shorter prompt)",
        )


def utf8_len(text: str) -> int:
    """Bytes on the wire, without copying ASCII text (the common case) to count them."""
    return len(text) if text.isascii() else len(text.encode())


def _cap_reason(limits: RequestLimits, model: ModelConfig) -> str:
    return (
        f"{limits.prompt_bytes_per_token} bytes per token of the model's {model.max_position_embeddings}-token context"
    )
