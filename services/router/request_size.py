"""The largest request the router's public listeners take, derived from what a valid request can hold (the request
limits and the model's context), so that anything larger is refused before it is read or parsed.

Both front ends parse on the event loop every stream shares, and gRPC buffers a message whole before the key check:
bounded only by gRPC's 16 MiB, a 10 MiB JSON body of a million `logit_bias` entries held the loop 0.8 s (another
tenant's stream stalled 772 ms) and 40 parallel 15 MiB calls without a key took the router to 846 MB. A valid
request is far smaller: its text is bounded per context token, and its lists by RequestLimits."""

from __future__ import annotations

from pdserve.config import MAX_MESSAGE_BYTES, RouterConfig
from pdserve.protocol.model_config import ModelConfig
from pdserve.protocol.output_constraint import MAX_SPEC_BYTES
from pdserve.protocol.request_checks import RequestLimits
from services.router.http.openai_prompts import MAX_CHOICES

# Never below this: what the estimates leave out (a client's whitespace, a parameter added later) stays served.
MIN_REQUEST_BYTES = 2**20
# Fields and scalars beyond the lists counted below (model, sampling, slo, user, request id, cache salt).
MARGIN_BYTES = 64 * 2**10
# JSON's worst case for one byte of text: "\u0001" (a control character; non-ASCII as \uXXXX takes at most 3 per byte).
JSON_ESCAPE = 6
# Per JSON item, past its own text: quotes, separators, a pretty-printer's newline and indent; a message's keys too.
JSON_ITEM = 8
JSON_MESSAGE = 128  # {"role": "assistant", "content": [{"type": "text", "text": ""}], "name": ""}
JSON_BIAS = 48  # "4294967295": -100.00000000000001,
# Protobuf: a uint32 varint; a map entry or message's tags and lengths.
PB_VARINT = 5
PB_ITEM = 8


def max_json_body_bytes(limits: RequestLimits, model: ModelConfig) -> int:
    """The OpenAI HTTP API's body: one context's prompt text (or all messages' contents) every byte escaped, or a
    completions batch of MAX_CHOICES full prompts of plain text or of token ids, whichever is more; then every list
    at its cap. A batch of many long prompts escaped byte for byte can pass it: `max_http_body_bytes` takes it."""
    text = limits.max_prompt_bytes(model)
    ids = (model.max_position_embeddings - 1) * (len(str(model.vocab_size - 1)) + JSON_ITEM)
    prompts = max(text * JSON_ESCAPE, MAX_CHOICES * text, MAX_CHOICES * ids)
    lists = (
        limits.max_messages * JSON_MESSAGE
        + limits.max_stop * (limits.max_stop_bytes * JSON_ESCAPE + JSON_ITEM)
        + limits.max_stop_token_ids * (10 + JSON_ITEM)
        + limits.max_logit_bias * JSON_BIAS
        + MAX_SPEC_BYTES * JSON_ESCAPE  # response_format's schema or the regex (one constraint at most)
    )
    return _bounded(prompts + lists)


def max_grpc_request_bytes(limits: RequestLimits, model: ModelConfig) -> int:
    """A public gRPC message: a GenerateRequest with its prompt (text, messages or token ids) and every list at its
    cap; every other public call's request (Admin, health, reflection) is smaller."""
    prompt = max(
        limits.max_prompt_bytes(model) + limits.max_messages * (len("assistant") + PB_ITEM),
        model.max_position_embeddings * PB_VARINT,
    )
    lists = (
        limits.max_stop * (limits.max_stop_bytes + PB_ITEM)
        + limits.max_stop_token_ids * PB_VARINT
        + limits.max_logit_bias * (PB_ITEM + PB_VARINT + 4)
        + limits.max_request_id_chars * 4
        + MAX_SPEC_BYTES  # the output constraint's schema or regex
    )
    return _bounded(prompt + lists)


def http_body_limit(config: RouterConfig, model: ModelConfig) -> int:
    """`max_http_body_bytes` when the configuration sets it, else what a valid body can hold."""
    return config.max_http_body_bytes or max_json_body_bytes(config.request_limits, model)


def _bounded(estimate: int) -> int:
    """Within [MIN_REQUEST_BYTES, MAX_MESSAGE_BYTES]: never more than any gRPC message carries (or a body did)."""
    return min(max(estimate + MARGIN_BYTES, MIN_REQUEST_BYTES), MAX_MESSAGE_BYTES)
