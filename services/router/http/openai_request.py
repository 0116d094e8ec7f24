"""An OpenAI completions or chat completions body -> the GenerateRequest the gRPC API takes, so both run the same
path. Only the shapes are checked here (which parameters, of which JSON type), and, before any item is read, the
shared path's caps on how many items a list holds; the values are checked once, by the shared path, and its field
names are translated back (`openai_param`). A parameter pdserve does not implement is refused by name, never
ignored: a client must not believe it got what it did not."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pdserve.errors import WITHHELD, InvalidRequestError
from pdserve.protocol.model_config import ModelConfig
from pdserve.protocol.request_checks import (
    RequestLimits,
    check_logit_bias,
    check_message_count,
    check_request_id_characters,
    check_slo_ms,
    check_stop_counts,
)
from pdserve.protocol.sampling import MAX_LOGPROBS, check_repetition_penalty, check_top_p
from pdserve.v1 import generate_pb2 as pb
from services.router.http.json_values import integer, is_int, number, typed, unicode_text
from services.router.http.openai_prompts import MAX_CHOICES, UINT32, check_prompt_counts, parse_prompts, prompt_messages
from services.router.http.response_format import CONSTRAINTS, PARAMS, set_constraint

PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")  # the last is vLLM's
SAMPLING = ("temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "logit_bias", *PENALTIES)
# OpenAI's end-user ids: `user`, and `safety_identifier` and `prompt_cache_key`, which OpenAI split it into.
END_USER = ("user", "safety_identifier", "prompt_cache_key")
# OpenAI's documented cap on `safety_identifier`; `user`, for which OpenAI states none, is cut to it on the trace: a
# span attribute of a body's size (up to 16 MiB) would go to every trace backend.
MAX_END_USER_ID = 128
COMMON = {"model", "max_tokens", "n", "stream", "stream_options", "priority", "slo", "cache_salt", *END_USER, *SAMPLING}
COMPLETION_PARAMS = frozenset({*COMMON, *CONSTRAINTS, "prompt", "logprobs", "echo"})
CHAT_PARAMS = frozenset({*COMMON, *CONSTRAINTS, "messages", "max_completion_tokens", "logprobs", "top_logprobs"})
SLO_FIELDS = ("ttft_ms", "tpot_ms")
# Unimplemented parameters at values that ask for nothing, which clients send anyway (best_of 1, store false, tools
# [], tool_choice "none"; parallel_tool_calls is moot without tools; pdserve's text skips special tokens, as vLLM's
# does by default); any other value is refused by name.
NO_OP_VALUES: dict[str, tuple[object, ...]] = {
    "best_of": (1,), "store": (False,), "tools": ([],), "tool_choice": ("none",), "parallel_tool_calls": (True, False),
    "min_p": (0, 0.0), "metadata": ({},), "service_tier": ("auto", "default"), "skip_special_tokens": (True,),
    "modalities": (["text"],),
}  # fmt: skip
# The same within stream_options: pdserve's chunks carry no `obfuscation` padding, which OpenAI's docs suggest
# turning off on a trusted network.
STREAM_OPTION_NO_OP_VALUES: dict[str, tuple[object, ...]] = {"include_obfuscation": (False,)}
# A chat message's fields pdserve takes. `name` (LangChain sends it) and a tool message's `tool_call_id` (OpenAI
# requires it) are checked and not shown to the model: the chat message the engine renders has neither, as most chat
# templates (SmolLM2's among them) show neither. Null-valued fields are not given.
MESSAGE_FIELDS = ("role", "content", "name", "tool_call_id")
UINT64 = 2**64 - 1
# OpenAI's own default; the gRPC API's is 0 (greedy), which a client asks for with temperature=0.
DEFAULT_TEMPERATURE = 1.0
# OpenAI's (and vLLM's) default for a completion, capped by the router's `default_max_tokens` and the context's
# room; a chat's is the router's (OpenAI's: the context's room).
COMPLETION_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class OpenAIRequest:
    chat: bool
    model: str
    message: pb.GenerateRequest
    stream: bool
    include_usage: bool
    max_tokens_param: str  # which name the body used, for errors about it
    echo: bool = False  # completions: the prompt comes back before the completion (with its logprobs, if asked)
    n: int = 1  # choices per prompt: each a request of its own (`choice_message`)
    user: str = (
        ""  # OpenAI's end-user id (`safety_identifier`, or `user`): on the request's trace with `trace_enduser_id`
    )
    batch: tuple[pb.GenerateRequest, ...] = ()  # completions: each prompt's request (`message` the first's)

    @property
    def prompts(self) -> tuple[pb.GenerateRequest, ...]:
        """Each prompt's request: a completion's one or batch, a chat's messages."""
        return self.batch or (self.message,)

    @property
    def choices(self) -> int:
        """Every prompt's n choices, prompt by prompt: choice i is prompt i // n's (OpenAI's and vLLM's index)."""
        return len(self.prompts) * self.n

    @property
    def default_max_tokens(self) -> int | None:
        """What a request without max_tokens gets, before the router's caps; None: the router's default."""
        return None if self.chat else COMPLETION_DEFAULT_MAX_TOKENS

    def check_request_id(self, limit: int) -> None:
        """The caller's X-Request-Id, with the `-{index}` each choice's id gets, within `limit`, and printable ASCII:
        checked before any choice runs, not when the first too long one would be refused after the others had run."""
        given = len(self.message.request_id)
        allowed = limit - (len(self.choice_message(self.choices - 1).request_id) - given)
        if given > allowed:
            batch = f"{len(self.prompts)} prompts and " if len(self.prompts) > 1 else ""
            with_n = f" with {batch}n={self.n} (each choice's id ends with -<index>)" if self.choices > 1 else ""
            raise InvalidRequestError("x-request-id", f"{given} characters; at most {allowed} are accepted{with_n}")
        check_request_id_characters(self.message.request_id, "x-request-id")

    def prompt_message(self, index: int) -> pb.GenerateRequest:
        """The request of choice `index`'s prompt, as the body gave it."""
        return self.prompts[index // self.n]

    def choice_message(self, index: int) -> pb.GenerateRequest:
        """Choice `index`'s request: with several choices its own request id and, for a seeded request, seed + j
        for its prompt's choice j (distinct choices, each reproducible; each prompt of a batch answered as that
        prompt sent alone with the same body)."""
        if self.choices == 1:
            return self.message
        msg = pb.GenerateRequest()
        msg.CopyFrom(self.prompt_message(index))
        if msg.request_id:
            msg.request_id = f"{msg.request_id}-{index}"
        if msg.sampling.HasField("seed"):
            msg.sampling.seed = (msg.sampling.seed + index % self.n) % (UINT64 + 1)
        return msg


def parse_request(
    body: object, chat: bool, *, limits: RequestLimits, model_config: ModelConfig, request_id: str = ""
) -> OpenAIRequest:
    """Raises InvalidRequestError naming the OpenAI parameter at fault."""
    if not isinstance(body, dict):
        raise InvalidRequestError("body", "must be a JSON object")
    body = {k: v for k, v in body.items() if v is not None and not _asks_nothing(k, v)}  # null is "not given"
    allowed = CHAT_PARAMS if chat else COMPLETION_PARAMS
    for name in body:
        if name not in allowed:
            if not name:
                raise InvalidRequestError("body", 'a parameter named "" is not supported by pdserve')
            raise InvalidRequestError(name, "is not supported by pdserve")
    _check_counts(body, limits, model_config)
    model = typed(body, "model", str)
    if model is None:
        raise InvalidRequestError("model", "is required")
    msg = pb.GenerateRequest(request_id=request_id, sampling=_sampling(body, chat), priority=integer(body, "priority"))
    msg.cache_salt = typed(body, "cache_salt", str) or ""  # vLLM's name and the gRPC API's: its size is checked there
    if chat:
        msg.messages.extend(_messages(body))
    else:  # a string's lone surrogates are refused as any string parameter's
        prompts = [unicode_text(p, "prompt") if isinstance(p, str) else p for p in parse_prompts(body.get("prompt"))]
    _set_slo(msg, body)
    stream = bool(typed(body, "stream", bool))
    max_tokens_param = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    echo = bool(typed(body, "echo", bool))
    if echo and msg.sampling.HasField("logprobs"):
        msg.sampling.prompt_logprobs = msg.sampling.logprobs
    n = integer(body, "n", 1, MAX_CHOICES) or 1
    batch: tuple[pb.GenerateRequest, ...] = ()
    if not chat:
        batch = prompt_messages(msg, prompts, n)
        msg = batch[0]
    user = typed(body, "user", str) or ""
    if len(safety_identifier := typed(body, "safety_identifier", str) or "") > MAX_END_USER_ID:
        raise InvalidRequestError(
            "safety_identifier", f"must be at most {MAX_END_USER_ID} characters, got {len(safety_identifier)}"
        )
    user = (safety_identifier or user)[:MAX_END_USER_ID]  # its successor's, where a client sends both
    # Asks that prompts sharing prefixes be served where those are cached, which placement does by their content.
    typed(body, "prompt_cache_key", str)
    include_usage = _include_usage(body, stream)
    return OpenAIRequest(chat, model, msg, stream, include_usage, max_tokens_param, echo, n, user, batch)


def _check_counts(body: dict[str, Any], limits: RequestLimits, model: ModelConfig) -> None:
    """The shared path's caps on how many items the body's lists and objects hold, applied before any loop over
    the items: converting a 16 MiB body of token ids, stop strings or messages, each item checked in Python,
    held the router's event loop for 0.4-1.4 s, for a request the caps then refused."""
    check_prompt_counts(body.get("prompt"), model)
    if isinstance(messages := body.get("messages"), list):
        check_message_count(len(messages), limits)
    stop, stop_token_ids = body.get("stop"), body.get("stop_token_ids")
    check_stop_counts(
        len(stop) if isinstance(stop, list) else 0,
        len(stop_token_ids) if isinstance(stop_token_ids, list) else 0,
        limits,
    )
    if isinstance(logit_bias := body.get("logit_bias"), dict):
        check_logit_bias(len(logit_bias), limits)


def _asks_nothing(name: str, value: object, no_ops: dict[str, tuple[object, ...]] = NO_OP_VALUES) -> bool:
    """An unimplemented parameter at a no-op value (NO_OP_VALUES); `true` is not the 1 of best_of."""
    return any(type(value) is type(no_op) and value == no_op for no_op in no_ops.get(name, ()))


def openai_param(field: str, max_tokens_param: str = "max_tokens") -> str:
    """The shared path's field name (`sampling.top_p`, `prompt_token_ids`) as the OpenAI parameter."""
    if field == "sampling.max_tokens":
        return max_tokens_param
    if field == "prompt_token_ids":
        return "prompt"
    # A bias's token is a key of the caller's JSON object, named as this module's own checks name it.
    return PARAMS.get(field) or re.sub(r"^logit_bias\[(\d+)\]$", r"logit_bias.\1", field.removeprefix("sampling."))


def _sampling(body: dict[str, Any], chat: bool) -> pb.SamplingParams:
    max_tokens = integer(body, "max_completion_tokens", 1, UINT32) if chat else None
    if max_tokens is None:
        max_tokens = integer(body, "max_tokens", 1, UINT32)
    temperature = number(body, "temperature")
    top_p = number(body, "top_p")
    if top_p is not None:  # checked as given: on the wire, the gRPC API's 0 is "off"
        check_top_p(top_p, "top_p")
    top_k = integer(body, "top_k")  # its range is the shared path's (-1 and 0: off)
    repetition_penalty = number(body, "repetition_penalty")
    if repetition_penalty is not None:  # likewise
        check_repetition_penalty(repetition_penalty, "repetition_penalty")
    msg = pb.SamplingParams(
        max_tokens=max_tokens or 0,
        temperature=DEFAULT_TEMPERATURE if temperature is None else temperature,
        top_p=top_p or 0.0,
        top_k=top_k or 0,
        stop=_stops(body),
        ignore_eos=bool(typed(body, "ignore_eos", bool)),
        presence_penalty=number(body, "presence_penalty") or 0.0,
        frequency_penalty=number(body, "frequency_penalty") or 0.0,
        repetition_penalty=repetition_penalty or 0.0,
    )
    for name, given in (("top_p", top_p), ("repetition_penalty", repetition_penalty)):
        if given and not getattr(msg, name):  # under float32's smallest: it would read as "off", not as tiny
            raise InvalidRequestError(name, f"{given} is 0 in the float32 the API carries; use 1e-45 or more")
    seed = integer(body, "seed", -(2**63), UINT64)  # vLLM takes any int64: a negative one is its uint64 bits
    if seed is not None:
        msg.seed = seed % (UINT64 + 1)
    msg.stop_token_ids.extend(_token_ids(body, "stop_token_ids"))
    for token, bias in _logit_bias(body).items():
        msg.logit_bias[token] = bias
    if (logprobs := _logprobs(body, chat)) is not None:
        msg.logprobs = logprobs
    set_constraint(body, msg)
    return msg


def _token_ids(body: dict[str, Any], name: str) -> list[int]:
    ids = typed(body, name, list) or []
    if not all(is_int(t) and 0 <= t <= UINT32 for t in ids):
        raise InvalidRequestError(name, "must be a list of token ids (integers >= 0)")
    return ids


def _logit_bias(body: dict[str, Any]) -> dict[int, float]:
    """OpenAI's JSON object from token ids (as strings: JSON keys are) to biases; the values' range is the
    shared path's to check."""
    bias = typed(body, "logit_bias", dict) or {}
    out = {}
    for key in bias:  # 10 digits hold any uint32; int() refuses thousands (ValueError)
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10 and int(key) <= UINT32):
            must = "keys must be token ids, got"
            raise InvalidRequestError("logit_bias", f"{must} {key[:32]!r}", f"{must} {WITHHELD}")
        value = number(bias, key, prefix="logit_bias.")
        if value is None:
            raise InvalidRequestError(f"logit_bias.{key}", "must be a finite number, got null")
        if int(key) in out:  # "70" and "070": one token, which the shared check cannot see twice in a map
            raise InvalidRequestError("logit_bias", f"names token id {int(key)} more than once (key {key!r})")
        out[int(key)] = value
    return out


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """How many alternatives per token: completions' `logprobs` is the count, chat's a flag with the count in
    `top_logprobs` (which OpenAI refuses without it)."""
    if not chat:
        return integer(body, "logprobs", 0, MAX_LOGPROBS)
    top = integer(body, "top_logprobs", 0, MAX_LOGPROBS)
    if not typed(body, "logprobs", bool):
        if top is not None:
            raise InvalidRequestError("top_logprobs", "needs logprobs set to true")
        return None
    return top or 0


def _messages(body: dict[str, Any]) -> list[pb.ChatMessage]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages", "must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequestError(f"messages[{i}]", "must be an object with role and content")
        m = {k: v for k, v in m.items() if v is not None}  # a client echoing a response's message sends refusal: null
        for key in m:
            if key not in MESSAGE_FIELDS:
                raise InvalidRequestError(f"messages[{i}].{key}", "is not supported by pdserve")
        role = m.get("role")
        if not isinstance(role, str):
            raise InvalidRequestError(f"messages[{i}].role", "must be a string")
        typed(m, "name", str, prefix=f"messages[{i}].")
        typed(m, "tool_call_id", str, prefix=f"messages[{i}].")
        out.append(
            pb.ChatMessage(role=unicode_text(role, f"messages[{i}].role"), content=_content(m.get("content"), i))
        )
    return out


def _content(content: object, i: int) -> str:
    """A string, or a list of text parts (what OpenAI's clients send for multi-part text), joined by newlines as
    vLLM joins them, so a client moving between the two gets the same prompt."""
    if isinstance(content, str):
        return unicode_text(content, f"messages[{i}].content")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise InvalidRequestError(f"messages[{i}].content[{j}]", "only text parts are supported")
            if not isinstance(text := part.get("text"), str):  # a text part, told what of it is wrong
                wrong = "is required for a text part" if text is None else "must be a string"
                raise InvalidRequestError(f"messages[{i}].content[{j}].text", wrong)
            parts.append(unicode_text(text, f"messages[{i}].content[{j}].text"))
        return "\n".join(parts)
    raise InvalidRequestError(f"messages[{i}].content", "must be a string or a list of text parts")


def _stops(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [unicode_text(stop, "stop")]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return [unicode_text(s, f"stop[{k}]") for k, s in enumerate(stop)]
    raise InvalidRequestError("stop", "must be a string or a list of strings")


def _set_slo(msg: pb.GenerateRequest, body: dict[str, Any]) -> None:
    """`slo`: {"ttft_ms": .., "tpot_ms": ..}, the gRPC API's SLO message under the same names."""
    slo = typed(body, "slo", dict)
    for key in slo or {}:
        if key not in SLO_FIELDS:
            raise InvalidRequestError(f"slo.{key}", f"is not supported; use {SLO_FIELDS}")
        value = number(slo, key, prefix="slo.")
        if value is not None:  # null: not given, as at the top level
            check_slo_ms(f"slo.{key}", value)  # here too: -1e-46 would reach the shared check as -0.0
            setattr(msg.slo, key, value)
            if value > 0 and getattr(msg.slo, key) == 0:  # a float32 underflow would read as "the server default"
                raise InvalidRequestError(f"slo.{key}", f"{value:g} is too small to be an SLO (0 = server default)")


def _include_usage(body: dict[str, Any], stream: bool) -> bool:
    options = typed(body, "stream_options", dict)
    if options is None:
        return False
    if not stream:
        raise InvalidRequestError("stream_options", "is only allowed when stream is true")
    no_ops = STREAM_OPTION_NO_OP_VALUES
    options = {k: v for k, v in options.items() if v is not None and not _asks_nothing(k, v, no_ops)}
    for key in options:
        if key != "include_usage":
            raise InvalidRequestError(f"stream_options.{key}", "is not supported by pdserve")
    return bool(typed(options, "include_usage", bool, prefix="stream_options."))
