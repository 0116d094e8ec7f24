"""Prompt logprobs go to the caller in one message, which gRPC bounds: a request whose logprobs could not fit is
INVALID_ARGUMENT at once, not a send that fails as RESOURCE_EXHAUSTED (read as a shed a retry could pass)."""

from __future__ import annotations

import pytest

from pdserve.config import MAX_MESSAGE_BYTES
from pdserve.errors import InvalidRequestError
from pdserve.protocol.request_checks import PROMPT_LOGPROBS_MAX_BYTES, check_prompt_logprobs_size
from pdserve.v1 import generate_pb2 as pb


@pytest.mark.parametrize("alternatives", [0, 1, 20])
def test_the_largest_prompt_allowed_fits_in_a_message_and_one_token_more_is_refused(alternatives: int) -> None:
    per_token = 16 + 9 * alternatives
    most = PROMPT_LOGPROBS_MAX_BYTES // per_token + 1
    check_prompt_logprobs_size(most, alternatives)
    worst = pb.TokenLogprobs(logprob=-1.5, top_token_ids=[2**31 - 1] * alternatives, top_logprobs=[-3.5] * alternatives)
    message = pb.GenerateResponse(token_ids=[2**31 - 1], text="x" * 64, prompt_logprobs=[worst] * (most - 1))
    assert message.ByteSize() < MAX_MESSAGE_BYTES
    with pytest.raises(InvalidRequestError) as refused:
        check_prompt_logprobs_size(most + 1, alternatives)
    assert refused.value.field == "sampling.prompt_logprobs" and f"at most {most} tokens" in str(refused.value)


def test_a_request_is_checked_for_it_wherever_it_enters() -> None:
    """The router's and the engine's one check: a long-context model (Llama 3.2's 131072 tokens) can take a prompt
    whose 20 alternatives per token would not fit."""
    from pdserve.protocol.model_config import ModelConfig
    from pdserve.protocol.request_checks import check_request
    from pdserve.protocol.sampling import SamplingParams

    model = ModelConfig(128256, 2048, 8192, 16, 32, 8, 64, 1e-5, 500000.0, 131072, True, (128001,))
    prompt = [5] * 100_000
    check_request(prompt, SamplingParams(max_tokens=1, prompt_logprobs=1), model)
    with pytest.raises(InvalidRequestError, match="sampling.prompt_logprobs"):
        check_request(prompt, SamplingParams(max_tokens=1, prompt_logprobs=20), model)
