"""One request's tokens and progress through the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pdserve.protocol.outputs import FinishReason
from pdserve.protocol.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # needs (re)computation of its prompt before it can decode
    RUNNING = "running"  # has KV for all but its last token; advances each step
    RECEIVING = "receiving"  # decode-only: blocks allocated, KV bytes still in flight
    HANDOFF = "handoff"  # prefill-only: first token sampled, blocks held until the decode side has them
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Token ids (prompt then output), how many of them have KV in the cache, and the blocks holding it.

    `num_computed_tokens` counts tokens whose keys and values are in the cache; the last sampled token
    never is until the next step feeds it in.
    """

    seq_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    # time.monotonic() when it began to wait for its first step: added, or on a decode worker its KV committed.
    arrival: float = 0.0
    first_scheduled: float | None = None  # when the first step that ran any of it began; a recompute's is not
    # How long the last step that ran a chunk of its prompt short of the end took (0: none yet): what its next chunk,
    # the one a short prompt waits for (short_first.py), is expected to take.
    last_chunk_s: float = 0.0
    own_chunks_s: float = 0.0  # of a long prompt, the time the steps that ran its chunks took (prefill_stretch.py)
    passed_s: float = 0.0  # and the time of the steps between them that ran other prompts
    preempted_at: float | None = None  # when the step that preempted it began, until a step runs it again
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at admission
    block_table: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    cache_salt: bytes = b""  # prefix-cache keys start from it: blocks are shared only under the same salt
    # The prompt's last tokens that this request generated itself before its stream moved here.
    resumed_output_tokens: int = 0
    tenant: str = ""  # whose it is, and its priority: the order it is taken from a waiting queue (fair_queue.py)
    priority: int = 0
    queue_tag: tuple[float, int] = (0.0, 0)  # its place among the waiting of its priority (fair_queue.py)
    # While it waits: the leading tokens the prefix cache held when it began to (what its queue does not cost).
    expected_cached_tokens: int = 0
    # The prefix-cache keys of its first `n` tokens, as (n, keys): a waiting sequence is looked up more than once.
    prefix_keys: tuple[int, list[bytes]] | None = field(default=None, repr=False)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, stop: int) -> list[int]:
        """`token_ids[start:stop]` without building `token_ids`: a decode step reads one token of a long sequence."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : stop - num_prompt]
        if stop <= num_prompt:
            return self.prompt_token_ids[start:stop]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - num_prompt]

    @property
    def original_prompt_token_ids(self) -> list[int]:
        """The prompt as sampling penalties count it: without a moved stream's resumed output."""
        return self.prompt_token_ids[: len(self.prompt_token_ids) - self.resumed_output_tokens]

    def penalized_output_token_ids(self) -> list[int]:
        """The output as sampling penalties count it: a moved stream's resumed tokens, then this worker's."""
        if not self.resumed_output_tokens:
            return self.output_token_ids
        return self.prompt_token_ids[-self.resumed_output_tokens :] + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens
