"""A prefill worker's order at chunk boundaries: a prompt that fits one step goes ahead of a longer prompt's remaining
chunks, within a credit that keeps the longer one moving.

A prefill worker runs one prompt per step, long ones in chunks. First come, first served, a chat prompt of 100
tokens queued behind one of 3000 waited for all six of its chunks (8.8 s on smollm2-135m, 2 cores), though its own
step takes 0.1 s (docs/experiments/prefill_head_of_line/). Here a waiting prompt whose new tokens fit one chunk runs
at the next step boundary instead of the longer prompt's next chunk, so it waits at most for the chunk in flight and
the short prompts queued before it. Short prompts go ahead by at most one chunk's tokens between two chunks of the
longer prompt: under any stream of them it still gets every other step, at least half the worker's tokens. Among
themselves, short prompts keep the waiting queue's order (priority, each tenant's in turn: fair_queue.py), and none
goes ahead of a longer prompt of a higher priority. The planner's simulator (planner/prefill_steps.py) orders its
prefill workers' prompts with this same class, so the plan models the order the workers run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Generic, Protocol, TypeVar

from pdserve.engine.sequence import Sequence
from pdserve.protocol.perf_profile import QueuedPrefill, attention_squares


class Prompt(Protocol):
    @property
    def priority(self) -> int: ...


P = TypeVar("P", bound=Prompt)


def new_tokens(seq: Sequence) -> int:
    """What is left of its prompt to compute, past the prefix the cache held when it began to wait."""
    return seq.num_uncomputed_tokens - seq.expected_cached_tokens


class ShortFirst(Generic[P]):
    """One worker's order. `new_tokens`: what is left of a waiting prompt to compute (an engine's `Sequence`, or a
    simulated prompt)."""

    def __init__(self, chunk: int, new_tokens: Callable[[P], int]) -> None:
        self.chunk = chunk  # a prompt of at most this many new tokens runs in one step
        self.new_tokens = new_tokens
        self.ahead = 0  # short prompts' tokens run ahead of a longer one since its last chunk

    def fits(self, prompt: P) -> bool:
        return self.new_tokens(prompt) <= self.chunk

    def pick(self, waiting: Iterable[P], longer: list[P]) -> list[P]:
        """The waiting prompts that may run this step ahead of `longer` (the prompts that need several steps, running
        or waiting): those that fit one step and are of no lower priority than any of them, while the credit
        lasts. None when nothing longer waits for them to pass."""
        if not longer or self.ahead >= self.chunk:
            return []
        floor = max(s.priority for s in longer)
        return [s for s in waiting if s.priority >= floor and self.fits(s)]

    def ran(self, tokens: int, went_ahead: bool, prompt_new_tokens: int) -> None:
        """A chunk of `tokens` ran: a short prompt's that went ahead spends the credit; a chunk of a prompt whose new
        tokens (all of them, at its start) need several steps renews it."""
        if went_ahead:
            self.ahead += tokens
        elif prompt_new_tokens > self.chunk:
            self.ahead = 0


def queued_ahead_of_short(
    waiting: Iterable[Sequence], running: Iterable[Sequence], chunk: int
) -> tuple[QueuedPrefill, float]:
    """What a prompt that fits one step, arriving now, waits for: the short prompts waiting, and the next chunk of each
    prompt part-way through its prefill (the one in flight), in seconds where an earlier chunk of that prompt ran
    (as long as that one took: a profile timed on whole prompts of up to 1024 tokens knows nothing of a chunk's
    attention to thousands before it), else in tokens. Squares as a router prices them (`attention_squares`): a short
    prompt's n new tokens after c cached count (c + n)² - c², and a chunk of k tokens of a prompt with `done` of its
    tokens computed (cached ones included), (done + k)² - done²."""
    prompts = tokens = squares = 0
    seconds = 0.0
    for s in waiting:
        if 0 < (n := new_tokens(s)) <= chunk:
            prompts, tokens, squares = prompts + 1, tokens + n, squares + attention_squares(n, s.num_tokens - n)
    for s in running:
        if (left := s.num_prompt_tokens - s.num_computed_tokens) <= 0:
            continue
        if s.last_chunk_s:
            seconds += s.last_chunk_s
            continue
        k = min(left, chunk)
        prompts, tokens, squares = prompts + 1, tokens + k, squares + attention_squares(k, s.num_computed_tokens)
    return QueuedPrefill(prompts, tokens, squares), seconds
