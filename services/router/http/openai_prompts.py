"""The completions API's `prompt`: one prompt (a string or a list of token ids) or a batch of them (a list of
strings, or a list of token-id lists), as OpenAI and vLLM take it; evaluation harnesses send batches. Each prompt
becomes a GenerateRequest of its own, whose `n` choices are requests of their own (choices.py), so a batch is
bounded with its choices: prompts × n within MAX_CHOICES."""

from __future__ import annotations

from pdserve.errors import InvalidRequestError
from pdserve.protocol.model_config import ModelConfig
from pdserve.protocol.request_checks import check_prompt_length
from pdserve.v1 import generate_pb2 as pb
from services.router.http.json_values import is_int

UINT32 = 2**32 - 1
# Choices of one request, each prompt's n together: each is a request of its own through admission, so the
# fan-out is bounded.
MAX_CHOICES = 16
Prompt = str | list[int]


def check_prompt_counts(prompt: object, model: ModelConfig) -> None:
    """The caps on how many items `prompt` holds, before any loop over them: a batch of at most MAX_CHOICES
    prompts, a list of token ids within the model's context."""
    if _is_batch(prompt):
        assert isinstance(prompt, list)
        if len(prompt) > MAX_CHOICES:
            raise InvalidRequestError("prompt", f"a batch of {len(prompt)} prompts; at most {MAX_CHOICES} are accepted")
        for ids in prompt:
            if isinstance(ids, list):
                check_prompt_length("prompt", len(ids), model)
    elif isinstance(prompt, list) and prompt and is_int(prompt[0]):
        check_prompt_length("prompt", len(prompt), model)


def parse_prompts(prompt: object) -> list[Prompt]:
    """Every prompt of the body, one or a batch; the one-prompt shapes name no index in their errors."""
    if prompt is None:
        raise InvalidRequestError("prompt", "is required")
    if not _is_batch(prompt):
        return [_one(prompt, None)]
    assert isinstance(prompt, list)
    kinds = {type(p) for p in prompt}
    if len(kinds) > 1:
        raise InvalidRequestError("prompt", "a batch must be all strings or all lists of token ids, not a mix")
    return [_one(p, i if len(prompt) > 1 else None) for i, p in enumerate(prompt)]


def prompt_messages(template: pb.GenerateRequest, prompts: list[Prompt], n: int) -> tuple[pb.GenerateRequest, ...]:
    """Each prompt's request: `template` (the body's sampling and the like) asking for it. Every prompt's n choices
    are requests of their own: together within MAX_CHOICES, as n alone is."""
    if len(prompts) * n > MAX_CHOICES:
        choices = len(prompts) * n
        raise InvalidRequestError(
            "prompt",
            f"a batch of {len(prompts)} prompts with n={n} is {choices} choices; at most {MAX_CHOICES} are accepted",
        )
    return tuple(_message(template, p) for p in prompts)


def _message(template: pb.GenerateRequest, prompt: Prompt) -> pb.GenerateRequest:
    msg = pb.GenerateRequest()
    msg.CopyFrom(template)
    if isinstance(prompt, str):
        msg.prompt = prompt
    else:
        msg.prompt_token_ids.extend(prompt)
    return msg


def _one(prompt: object, index: int | None) -> Prompt:
    """One prompt; `index`: its place in a batch, which its errors name."""
    which = "" if index is None else f"prompt {index} "
    if prompt == "" or prompt == []:
        raise InvalidRequestError("prompt", f"{which}must not be empty")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(is_int(t) and 0 <= t <= UINT32 for t in prompt):
        return prompt
    if index is None:
        raise InvalidRequestError("prompt", "must be a string, a non-empty list of token ids, or a list of either")
    raise InvalidRequestError("prompt", f"{which}must be a string or a non-empty list of token ids (integers >= 0)")


def _is_batch(prompt: object) -> bool:
    """A list of strings or of lists; a list of token ids is one prompt (and an empty list is none: refused)."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str | list)
