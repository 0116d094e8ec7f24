"""What a healthy cluster must answer: the single-process engine's greedy output, which every greedy request
through a cluster (retried, migrated or not) must equal token for token."""

from __future__ import annotations

from pdserve.config import EngineConfig
from pdserve.engine.batch_generate import Completion
from pdserve.engine.engine import LLMEngine
from pdserve.protocol.sampling import SamplingParams
from pdserve.v1 import generate_pb2 as pb

PROMPT = [5, 6, 7, 8, 9] * 7  # three KV blocks
MAX_TOKENS = 8


def greedy(prompt: list[int], max_tokens: int, **sampling: object) -> list[int]:
    """tiny-random's greedy tokens for `prompt`, in float32 on one thread, as the cluster's workers compute."""
    return greedy_completion(prompt, max_tokens, **sampling).token_ids


def greedy_completion(prompt: list[int], max_tokens: int, **sampling: object) -> Completion:
    """`greedy`'s whole completion: its text and, when `sampling` asks, its log probabilities too."""
    blocks = max(16, -(-(len(prompt) + max_tokens) // EngineConfig.block_size))
    engine = LLMEngine(EngineConfig(model="tiny-random", dtype="float32", num_threads=1, num_kv_blocks=blocks))
    return engine.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling))[0]


def greedy_request(request_id: str, prompt: list[int], max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )


def request(request_id: str) -> pb.GenerateRequest:
    """PROMPT for MAX_TOKENS greedy tokens: what the `expected` fixture holds."""
    return greedy_request(request_id, PROMPT, MAX_TOKENS)
