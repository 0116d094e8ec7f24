"""A worker's speed: measured at start-up on its own model runner, corrected from its live steps."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from pdserve.engine.device import synchronize
from pdserve.protocol.perf_profile import PerfProfile, QueuedPrefill

# (new tokens, cached tokens before them) of the prefill steps timed, fitted as a quadratic. Whole prompts: they
# priced 1-6k-token prompts (run in chunks) at 1.05-1.08x what they took (medians), where timing chunks at 3 and 7
# chunks of context instead priced them 0.86-1.18x, and 3.5-3.9x (against 2.3-3.3x) when another process loaded the
# cores during the profile. And one chunk after a cached prefix: three points fix three terms exactly, so one noisy
# whole prompt could move the attention term anywhere (to 0 in one run); over seven runs a chat's next turn (256 new
# tokens after 2-3k cached) ran 0.81-2.02x its price without it and 0.85-1.32x with it, a 3000-token prompt
# 0.86-1.46x and 0.97-1.13x (docs/experiments/long_prompt_pricing/cached_point.py). And one chunk deep in a long
# context, where the model and the pool hold it: priced from points of at most 1.6M squares, an 8160-token prompt
# (66M) took the attention term's noise 40-fold, and profiles taken beside a bursty neighbour priced it 31-86 s
# (it ran in 62-65 s); with this point 73-85 s, and 57-62 s on the quiet host (52-64 without), for ~5 s more of
# start-up on smollm2-135m (deep_point.py).
PREFILL_SHAPES = ((64, 0), (256, 0), (1024, 0), (256, 1024), (256, 3840))
DECODE_BATCHES = (1, 8, 32)
FASTEST_RATIO = 1 / 16
FAR_RATIO = 1.5  # a probe reading this far off the factor either way waits for a second to confirm it
DECODE_CONTEXT = 64  # each sequence's context at the batches above
# Where each sequence reads a long context, the batches timed: the step's cost per context token (on smollm2-135m,
# one CPU thread, these add ~3 s to the start-up's ~18).
DEEP_CONTEXT, DEEP_BATCHES = 2048, (1, 8)


class SpeedTracker:
    """An exponentially weighted ratio of measured to predicted step time: the live correction. A step's ratio
    counts up to 4x slow (one pathological step moves it by a bounded amount) and down to 16x fast: a profile
    measured while other processes loaded this 2-core host read 5.7x slow (a 3873-token prompt priced at 80 s, 14 s
    on the quiet host), and bounded at 4x fast, the worker stayed priced over what it ran at once they left.

    Live steps alone never correct a worker that gets none: one priced slow by such a profile got no request at low
    load (a rollout's CI run sent 72 of 72 to the other version's worker), so stayed priced slow. An idle worker
    that takes prompts is probed instead (cluster/speed_recheck.py): one prompt of its own through its engine, whose
    step's ratio (a colocated worker's: a decode step's, as most of its live steps are) replaces the factor. A live
    step's weight is small because its batch and neighbours vary; a probe runs alone on an idle engine, and on
    smollm2-135m (one thread) twenty probes of 64 tokens read 0.96-1.25x their price, median 1.01, spread 7% (256
    tokens: 0.95-1.00x, but 0.7 s each against 0.22 s), so one reading is a fair one, and a profile k-times slow is
    corrected by the first probe, whatever k. Not one paused mid-probe (a GC, a freeze), which read up to 4x: a
    reading `far` from the factor replaces it only once a second probe confirms it (engine/speed_probe.py)."""

    def __init__(self, profile: PerfProfile, alpha: float = 0.1) -> None:
        self.profile = profile
        self.alpha = alpha
        self.factor = 1.0
        self.stepped_at = time.monotonic()  # the last live step (none yet: the profile's time)
        self.observed_at = self.stepped_at  # the last reading, a live step's or a probe's

    def observe(
        self,
        prefill_tokens: int,
        decode_seqs: int,
        seconds: float,
        prefill_squares: int | None = None,
        decode_context: int = 0,
    ) -> None:
        """`prefill_squares`: the step's prompt chunks' attention (`SchedulerOutput.prefill_attention_squares`), each
        chunk's reads of the cached tokens before it included, as the router prices a prompt after a cached prefix;
        None: one chunk with nothing before it. Priced as new tokens alone, a prefix-cache hit's step or a long
        prompt's later chunk read as up to 4x slow (a review saw the router refuse every request with an SLO, on an
        idle cluster); left unobserved, a worker whose every prompt follows a cached prefix (a chat's turns) was
        never corrected from its start-up profile. `decode_context`: the tokens the step's decoding sequences
        attend over, summed, which the profile prices (else a long-context batch would read as a slow worker, and
        the router would count its context twice)."""
        self.stepped_at = time.monotonic()
        if (ratio := self._ratio(prefill_tokens, decode_seqs, seconds, prefill_squares, decode_context)) is not None:
            self.factor += self.alpha * (ratio - self.factor)
            self.observed_at = self.stepped_at

    def probed(
        self, prefill_tokens: int, decode_seqs: int, seconds: float, prefill_squares: int, decode_context: int
    ) -> None:
        """A probe's step (engine/speed_probe.py), as `observe` takes a live one, took `seconds`: its ratio is the
        factor now."""
        if (ratio := self._ratio(prefill_tokens, decode_seqs, seconds, prefill_squares, decode_context)) is not None:
            self.factor = ratio
            self.observed_at = time.monotonic()

    def far(
        self, prefill_tokens: int, decode_seqs: int, seconds: float, prefill_squares: int, decode_context: int
    ) -> bool:
        """Whether a probe's reading (as `probed` takes it) is over FAR_RATIO off the factor, either way: one to confirm
        with a second before it replaces the factor (engine/speed_probe.py)."""
        ratio = self._ratio(prefill_tokens, decode_seqs, seconds, prefill_squares, decode_context)
        return ratio is not None and not self.factor / FAR_RATIO <= ratio <= self.factor * FAR_RATIO

    def _ratio(self, tokens: int, seqs: int, seconds: float, squares: int | None, context: int) -> float | None:
        """A step's measured over predicted time, bounded (as `observe` takes its arguments); None where the profile
        predicts nothing."""
        squares = tokens * tokens if squares is None else squares
        prefill = QueuedPrefill(1, tokens, squares) if tokens else QueuedPrefill()  # one call's fixed
        predicted = self.profile.queued_prefill_s(prefill) + (
            self.profile.decode_step_s(seqs, context) if seqs else 0.0
        )
        return min(max(seconds / predicted, FASTEST_RATIO), 4.0) if predicted > 0 else None


def measure_profile(engine: Any, repeats: int = 2) -> PerfProfile:
    """Times the model runner directly on scratch blocks, the pool's first ones, whatever they hold: only before
    the engine has run any request (a block the prefix cache kept would then hold the profile's random KV, and
    every prompt hitting it would get a wrong answer)."""
    from pdserve.engine.scheduler import ScheduledChunk

    runner, blocks = engine.runner, engine.blocks
    if blocks.num_used_blocks or blocks.num_cached_blocks:
        raise RuntimeError("measure_profile writes scratch KV over the pool: run it before any request")
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

    return PerfProfile.fit(_prefill_points(engine, timed, gen), _decode_points(engine, timed))


def _prefill_points(
    engine: Any,
    timed: Callable[[list[Any]], float],
    gen: torch.Generator,
    shapes: tuple[tuple[int, int], ...] = PREFILL_SHAPES,
) -> list[tuple[int, int, float]]:
    """(new tokens, cached tokens before them, s) of the `shapes` the model length and the pool hold."""
    from pdserve.engine.scheduler import ScheduledChunk

    blocks, vocab = engine.blocks, engine.model_config.vocab_size
    points = []
    for new, cached in shapes:
        if cached + new >= engine.max_model_len or blocks.blocks_for(cached + new) > blocks.num_blocks:
            continue
        ids = torch.randint(0, vocab, (new,), generator=gen).tolist()
        table = list(range(blocks.blocks_for(cached + new)))
        points.append((new, cached, timed([ScheduledChunk("profile", ids, cached, table, True)])))
    return points


def _decode_points(engine: Any, timed: Callable[[list[Any]], float]) -> list[tuple[int, int, float]]:
    """(batch, each sequence's context, s) of decode steps at a short context and at a deep one, those the pool
    and the batch cap hold."""
    from pdserve.engine.scheduler import ScheduledChunk

    blocks = engine.blocks
    shapes = [(b, DECODE_CONTEXT) for b in DECODE_BATCHES]
    if engine.max_model_len > DEEP_CONTEXT:
        shapes += [(b, DEEP_CONTEXT) for b in DEEP_BATCHES]
    points = []
    for batch, context in shapes:
        per_seq = blocks.blocks_for(context + 1)
        if batch * per_seq > blocks.num_blocks or batch > engine.config.scheduler.max_num_seqs:
            continue
        chunks = [
            ScheduledChunk(f"p{i}", [1], context, list(range(i * per_seq, (i + 1) * per_seq)), True)
            for i in range(batch)
        ]
        points.append((batch, context, timed(chunks)))
    return points
