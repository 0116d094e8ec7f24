"""Prompts run to completion in one continuous batch on an engine of this process: `pdserve generate`, the benches
and the tests, where no worker streams the outputs."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.errors import InvalidRequestError
from pdserve.protocol.engine_request import EngineRequest
from pdserve.protocol.outputs import FinishReason, TokenLogprobs
from pdserve.protocol.sampling import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.engine import LLMEngine


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    logprobs: list[TokenLogprobs]  # one per token when the request asked for them
    prompt_logprobs: list[TokenLogprobs]  # one per prompt token after the first when the request asked


def generate_all(
    engine: LLMEngine, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams]
) -> list[Completion]:
    """Results in prompt order. Raises the error that ended one (an output constraint it could not be held to) once
    all have ended: its tokens would read as a complete output."""
    params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
    ids = [f"generate-{uuid.uuid4().hex}" for _ in prompts]
    for request_id, prompt, p in zip(ids, prompts, params, strict=True):
        engine.add_request(EngineRequest(request_id, prompt, p))
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    texts: dict[str, list[str]] = {i: [] for i in ids}
    logprobs: dict[str, list[TokenLogprobs]] = {i: [] for i in ids}
    prompt_logprobs: dict[str, list[TokenLogprobs]] = {i: [] for i in ids}
    reasons: dict[str, FinishReason] = {}
    errors: list[InvalidRequestError] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            texts[out.request_id].append(out.new_text)
            logprobs[out.request_id] += out.logprobs
            prompt_logprobs[out.request_id] += out.prompt_logprobs
            if out.finish_reason is not None:
                reasons[out.request_id] = out.finish_reason
            if out.error is not None:
                errors.append(out.error)
    if errors:
        raise errors[0]
    return [Completion(tokens[i], "".join(texts[i]), reasons[i], logprobs[i], prompt_logprobs[i]) for i in ids]
