"""Continuous batching: which sequences advance this step, and by how many tokens.

Each step has a token budget. Running sequences go first (a decode costs one token, an unfinished
prefill continues with a chunk), then waiting ones are admitted, preempted ones first unless a higher priority
waits, then higher priority first and each tenant's in turn (fair_queue.py), while budget, the running-sequence
cap and free blocks allow.
A long prompt is split into chunks across steps; it is admitted with the blocks of all its chunks, so prompts
admitted beside it cannot take them and preempt it part-way (when they could, recomputes preempted one another:
4x the tokens needed in a review's run). When a running sequence needs a block and none is free, the most
recently admitted sequence of the lowest priority running is preempted: its blocks are freed and it waits to be
recomputed, keeping its generated tokens, and goes back first unless a higher priority waits.
On a prefill worker (`short_prompts_first`), a waiting prompt that fits one step runs ahead of a longer prompt's next
chunk, within a credit (short_first.py), and measures how much that stretches its long prompts (prefill_stretch.py).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from pdserve.config import SchedulerConfig
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.fair_queue import FairQueue
from pdserve.engine.prefill_stretch import PrefillStretch
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.short_first import ShortFirst, new_tokens, queued_ahead_of_short
from pdserve.protocol.outputs import FinishReason
from pdserve.protocol.perf_profile import QueuedPrefill, attention_squares


@dataclass(frozen=True)
class ScheduledChunk:
    """What the model runner needs of one sequence this step: its new tokens and where they go."""

    seq_id: str
    token_ids: list[int]
    start_position: int
    block_table: list[int]
    sample: bool  # the chunk ends the sequence's known tokens, so its last logits pick the next token
    # Every row's logits are wanted: its sequence asked for prompt logprobs and some row predicts a prompt token.
    prompt_logits: bool = False


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]  # decodes (one token) first, then prefill chunks
    preempted: list[str]
    started: list[Sequence]  # those no step ran before (`first_scheduled` None): each request once, not its recompute

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def prefill_attention_squares(self) -> int:
        """The step's prompt chunks' attention as the profile prices it (`attention_squares`), each chunk's reads of
        the tokens before it in the cache (a prefix-cache hit's, a chunked prompt's earlier chunks) included."""
        return sum(attention_squares(len(c.token_ids), c.start_position) for c in self.chunks if len(c.token_ids) > 1)

    @property
    def decode_context_tokens(self) -> int:
        """The tokens the step's decoding sequences attend over, summed: what the profile prices a decode step by
        beside its batch size."""
        return sum(c.start_position + 1 for c in self.chunks if len(c.token_ids) == 1)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.blocks = block_manager
        self.waiting: deque[Sequence] = deque()  # those preempted first (running before), then in arrival order
        self.fair = FairQueue()
        self.short_first = ShortFirst(config.long_prefill_chunk, new_tokens) if config.short_prompts_first else None
        self.stretch = PrefillStretch(config.long_prefill_chunk) if config.short_prompts_first else None
        self.running: list[Sequence] = []
        self._scheduled: list[tuple[Sequence, int]] = []
        self._ran: list[tuple[Sequence, int]] = []  # what the last step completed (`step_took` times it)
        self.num_preemptions = 0  # since start, for metrics and tests
        # Sequences whose blocks `finish` freed since start: a report and a stream's end each say it, so a router can
        # tell whether the report was sampled with the stream's blocks free (services/router/worker_frees.py).
        self.num_freed = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def queued_prefill(self) -> QueuedPrefill:
        """Prompt work still to compute, per prompt: the waiting prompts past what the prefix cache held when they
        began to wait, and the rest of the prompts part-way through a chunked prefill. Each counts the squares a
        router prices it at (`attention_squares`): n new tokens after c cached ones count (c + n)² - c², and a
        prompt with `done` of its tokens computed (cached ones included) and r left, (done + r)² - done²."""
        prompts = tokens = squares = 0
        for s in self.waiting:
            if (n := s.num_uncomputed_tokens - s.expected_cached_tokens) > 0:
                prompts, tokens = prompts + 1, tokens + n
                squares += attention_squares(n, s.num_tokens - n)
        for s in self.running:
            if (left := s.num_prompt_tokens - s.num_computed_tokens) > 0:
                prompts, tokens = prompts + 1, tokens + left
                squares += attention_squares(left, s.num_computed_tokens)
        return QueuedPrefill(prompts, tokens, squares)

    def queued_ahead_of_short(self) -> tuple[QueuedPrefill, float] | None:
        """What a prompt that fits one step waits for here, in tokens and seconds (short_first.py); None: it waits
        for all the queue."""
        if self.short_first is None:
            return None
        return queued_ahead_of_short(self.waiting, self.running, self.short_first.chunk)

    def add(self, seq: Sequence) -> None:
        self._wait(seq)
        self.fair.tag(seq)
        self.waiting.append(seq)

    def _wait(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.expected_cached_tokens = len(self._cached_prefix(seq)) * self.blocks.block_size

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks a prefill of `seq` would start from. Prompt logprobs need every prompt position
        computed: no cached prefix stands in for one."""
        return self.blocks.match_prefix(seq) if seq.sampling.prompt_logprobs is None else []

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose KV is already in its blocks (received from a prefill worker)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        preempted: list[str] = []
        ahead = self._short_ahead()
        # The prompts part-way through their prefill wait a step for those ahead of them.
        held = [s for s in self.running if ahead and s.num_computed_tokens < s.num_prompt_tokens]
        budget = self._continue([s for s in self.running if s not in held], budget, scheduled, preempted)
        if not preempted:
            budget = self._admit(budget, scheduled, ahead)
        if held and not any(s in ahead for s, _ in scheduled):  # none could start (no blocks): no step is lost
            budget = self._continue(held, budget, scheduled, preempted)
        if self.short_first is not None:
            _count_credit(self.short_first, scheduled, ahead)
        self._scheduled = scheduled
        scheduled.sort(key=lambda item: item[1] > 1 or item[0].num_computed_tokens == 0)
        chunks = [self._chunk(seq, n) for seq, n in scheduled]
        started = [seq for seq, _ in scheduled if seq.first_scheduled is None]
        return SchedulerOutput(chunks=chunks, preempted=preempted, started=started)

    def _continue(
        self, queue: list[Sequence], budget: int, scheduled: list[tuple[Sequence, int]], preempted: list[str]
    ) -> int:
        """Schedules the running sequences of `queue` in order while the budget lasts, preempting for blocks."""
        while queue and budget > 0:
            seq = queue.pop(0)
            n = min(seq.num_uncomputed_tokens, budget, self.config.long_prefill_chunk)
            while not self.blocks.allocate_slots(seq, n):
                victim = min(reversed(self.running), key=lambda s: s.priority)  # the lowest, newest of them
                self._preempt(victim)
                preempted.append(victim.seq_id)
                if victim is seq:
                    break
                queue = [s for s in queue if s is not victim]
                for i, (s, m) in enumerate(scheduled):  # a lower priority scheduled before it gives its place up
                    if s is victim:
                        del scheduled[i]
                        budget += m
                        break
            else:
                scheduled.append((seq, n))
                budget -= n
        return budget

    def _short_ahead(self) -> list[Sequence]:
        """The waiting prompts that may run this step ahead of a longer prompt's chunks (short_first.py)."""
        if self.short_first is None or not self.waiting:
            return []
        fits = self.short_first.fits
        longer = [s for s in self.running if s.num_computed_tokens < s.num_prompt_tokens]
        longer += [s for s in self.waiting if not fits(s)]
        return self.short_first.pick(self.waiting, longer)

    def _admit(self, budget: int, scheduled: list[tuple[Sequence, int]], ahead: list[Sequence]) -> int:
        cap = self.config.max_prefills_per_step
        prefills = sum(1 for seq, n in scheduled if n > 1 or seq.num_computed_tokens == 0)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            if cap is not None and prefills >= cap:
                break
            prefills += 1
            seq = self.fair.first([s for s in ahead if s.status is SequenceStatus.WAITING] or self.waiting)
            if not ahead and self.waiting[0].num_preemptions and self.waiting[0].priority >= seq.priority:
                seq = self.waiting[0]  # it was running: back first, unless a higher priority waits
            prefix = self._cached_prefix(seq)
            cached = len(prefix) * self.blocks.block_size
            n = min(seq.num_tokens - cached, budget, self.config.long_prefill_chunk)
            if not self.blocks.allocate_slots(seq, seq.num_tokens - cached, prefix):  # all its chunks' blocks
                break
            self.waiting.remove(seq)
            self.fair.taken(seq)
            seq.num_computed_tokens = cached
            if not seq.num_preemptions:  # a recompute's hits are its own blocks, not a cached prompt
                seq.num_cached_tokens = cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n
        return budget

    def _chunk(self, seq: Sequence, n: int) -> ScheduledChunk:
        start = seq.num_computed_tokens
        return ScheduledChunk(
            seq_id=seq.seq_id,
            token_ids=seq.token_slice(start, start + n),
            start_position=start,
            block_table=list(seq.block_table),
            sample=start + n == seq.num_tokens,
            # Until its first token: a recompute after it (a preempted sequence) has its prompt logprobs already.
            prompt_logits=seq.sampling.prompt_logprobs is not None
            and start + 1 < seq.num_prompt_tokens
            and not seq.num_output_tokens,
        )

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._wait(seq)
        self.waiting.appendleft(seq)

    def complete_step(self) -> list[Sequence]:
        """Advance what ran this step; returns the sequences that now have a new token to sample."""
        sampled = []
        for seq, n in self._scheduled:
            seq.num_computed_tokens += n
            self.blocks.cache_full_blocks(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                sampled.append(seq)
        self._ran, self._scheduled = self._scheduled, []
        return sampled

    def step_took(self, began: float, done: float) -> None:
        """The step `complete_step` completed ran from `began` to `done`: the long prompts whose chunks it ran count
        its time as their own (prefill_stretch.py)."""
        if self.stretch is not None:
            prompts = [s for s, n in self._ran if s.num_computed_tokens - n < s.num_prompt_tokens]  # not decode steps
            self.stretch.step_ran([(s, s.num_computed_tokens >= s.num_prompt_tokens) for s in prompts], began, done)
        self._ran = []

    def prefill_stretch(self) -> float:
        """How much short prompts going ahead stretch a long prompt's prefill here now (1: none)."""
        return self.stretch.value(time.monotonic()) if self.stretch is not None else 1.0

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Stop the sequence and free its blocks, wherever it is."""
        self.detach(seq)
        self.blocks.free(seq)
        self.num_freed += 1
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def detach(self, seq: Sequence) -> None:
        """Take the sequence out of the queues, keeping its blocks (prefill-only hand-off)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)


def _count_credit(policy: ShortFirst[Sequence], scheduled: list[tuple[Sequence, int]], ahead: list[Sequence]) -> None:
    """The short prompts' tokens that went ahead this step, or a longer prompt's chunk that ran (short_first.py)."""
    for seq, n in scheduled:
        policy.ran(n, seq in ahead, seq.num_prompt_tokens - seq.num_cached_tokens)
