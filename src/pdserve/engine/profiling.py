"""A worker's speed: measured at start-up on its own model runner, corrected from its live steps."""

from __future__ import annotations

import time
from typing import Any

import torch

from pdserve.engine.device import synchronize
from pdserve.protocol.perf_profile import PerfProfile

PREFILL_LENGTHS = (64, 256, 1024)  # the range prompts come in: extrapolating a quadratic misleads
DECODE_BATCHES = (1, 8, 32)


class SpeedTracker:
    """An exponentially weighted ratio of measured to predicted step time: the live correction."""

    def __init__(self, profile: PerfProfile, alpha: float = 0.1) -> None:
        self.profile = profile
        self.alpha = alpha
        self.factor = 1.0

    def observe(self, prefill_tokens: int, decode_seqs: int, seconds: float, prefill_context: int = 0) -> None:
        """`prefill_context`: the earlier tokens the step's prompt chunks read from the cache. Such a step is not
        observed: the profile prices a prompt's new tokens alone, so a prefix-cache hit's step (or a long prompt's
        later chunk) read as up to 4x slow, and a review saw the router then refuse every request with an SLO, on
        an idle cluster, for as long as no other step ran to correct it."""
        if prefill_context:
            return
        predicted = self.profile.prefill_s(prefill_tokens) + (
            self.profile.decode_step_s(decode_seqs) if decode_seqs else 0.0
        )
        if predicted > 0:
            ratio = min(max(seconds / predicted, 0.25), 4.0)
            self.factor += self.alpha * (ratio - self.factor)


def measure_profile(engine: Any, repeats: int = 2) -> PerfProfile:
    """Times the model runner directly on scratch blocks, the pool's first ones, whatever they hold: only before
    the engine has run any request (a block the prefix cache kept would then hold the profile's random KV, and
    every prompt hitting it would get a wrong answer)."""
    from pdserve.engine.scheduler import ScheduledChunk

    runner, blocks = engine.runner, engine.blocks
    if blocks.num_used_blocks or blocks.num_cached_blocks:
        raise RuntimeError("measure_profile writes scratch KV over the pool: run it before any request")
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def timed(chunks: list[ScheduledChunk]) -> float:
        """The mean, not the best: admission must not promise what a busy worker only sometimes does."""
        runner.execute(chunks)  # kernels set up for this shape
        synchronize(runner.device)  # the warm-up's queued work is not timed
        start = time.perf_counter()
        for _ in range(repeats):
            runner.execute(chunks)
        synchronize(runner.device)  # the runner's own GPU, not the current one
        return (time.perf_counter() - start) / repeats

    prefill = []
    for n in PREFILL_LENGTHS:
        if n >= engine.max_model_len or blocks.blocks_for(n) > blocks.num_blocks:
            continue
        ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
        table = list(range(blocks.blocks_for(n)))
        prefill.append((n, timed([ScheduledChunk("profile", ids, 0, table, True)])))
    decode = []
    context = 64
    per_seq = blocks.blocks_for(context + 1)
    for batch in DECODE_BATCHES:
        if batch * per_seq > blocks.num_blocks or batch > engine.config.scheduler.max_num_seqs:
            continue
        chunks = [
            ScheduledChunk(f"p{i}", [1], context, list(range(i * per_seq, (i + 1) * per_seq)), True)
            for i in range(batch)
        ]
        decode.append((batch, timed(chunks)))
    return PerfProfile.fit(prefill, decode)
