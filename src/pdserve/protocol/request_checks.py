"""The checks a request must pass wherever it enters: the router, before placement, and the engine itself.

Field names follow the public API (`sampling.max_tokens`), so the error reads the same from either.
"""

from __future__ import annotations

from pdserve.errors import InvalidRequestError
from pdserve.protocol.model_config import ModelConfig
from pdserve.protocol.sampling import SamplingParams


def check_request(prompt_token_ids: list[int], sampling: SamplingParams, model: ModelConfig) -> None:
    if not prompt_token_ids:
        raise InvalidRequestError("prompt", "the prompt is empty")
    vocab = model.vocab_size
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
    if bad:
        raise InvalidRequestError("prompt_token_ids", f"ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    bad = [t for t in sampling.stop_token_ids if not 0 <= t < vocab]
    if bad:
        raise InvalidRequestError("sampling.stop_token_ids", f"ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    total = len(prompt_token_ids) + sampling.max_tokens
    if total > model.max_position_embeddings:
        raise InvalidRequestError(
            "sampling.max_tokens",
            f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({sampling.max_tokens}) = {total} exceeds "
            f"the model's context of {model.max_position_embeddings} tokens",
        )
