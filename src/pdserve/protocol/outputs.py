"""What a request produces, step by step: the same on the engine thread, in a worker and at the router."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pdserve.errors import InvalidRequestError

# How often a decode worker tells a stream it preempted that it waits (a message with no token), so that the
# router's stall bound, which must exceed it (`RouterConfig.stall_timeout_s`), takes the stream for a live one.
PREEMPTED_NOTICE_S = 1.0


class FinishReason(enum.Enum):
    LENGTH = "length"
    STOP = "stop"  # a stop string or stop token id
    EOS = "eos"
    ABORT = "abort"  # dropped, or failed (`RequestOutput.error`): never a caller's finish reason


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's log probability and the most likely tokens at its position, most likely first."""

    logprob: float
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    # Prefill-only, when the first token leaves the sequence held for its hand-off: the blocks holding the prompt's
    # KV, in block-table order (fixed from then on), so the sender needs no further call to the engine thread.
    handoff_block_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per new token, when the request asked for them
    # On the first output, when the request asked: one per prompt token after the first.
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()
    # The request failed here (finish ABORT): its output could not be held to its constraint. The caller's stream
    # ends with this error after the tokens before; this output's token, which the constraint could not follow,
    # is not sent.
    error: InvalidRequestError | None = None
    # How many sequences its engine had freed when it was made (Scheduler.num_freed): on the last output, this one's
    # blocks among them. 0: unknown.
    sequences_freed: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def followed_by(self, later: RequestOutput) -> RequestOutput:
        """This output and a later one of the same request as one: what a consumer that fell a step behind
        sends in one message instead of two (the tokens and text in order, the later one's finish)."""
        return RequestOutput(
            self.request_id,
            self.new_token_ids + later.new_token_ids,
            self.new_text + later.new_text,
            later.finish_reason,
            later.num_prompt_tokens,
            later.num_cached_tokens,
            self.handoff_block_ids or later.handoff_block_ids,
            self.logprobs + later.logprobs,
            self.prompt_logprobs or later.prompt_logprobs,
            sequences_freed=later.sequences_freed,
        )
