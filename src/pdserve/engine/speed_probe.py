"""One timed prompt through an idle engine: a clean reading of a worker's speed when no live step gives one.

A worker whose start-up profile read slow (timed while other processes loaded its host) is priced slow, so at low
load the router sends it nothing, and without steps its live correction never moves (cluster/speed_recheck.py
decides when to probe). The probe is a request of random tokens of its own, each step timed as `AsyncEngine` times a
live step, so its reading and the live steps' agree. A prefill worker's reading is its prompt's step. A colocated
worker's is a decode step of it (the middle of PROBE_DECODES): its one factor prices its decode steps too, and its
live steps are mostly decode steps, which may read far from a prompt's (smollm2-135m, one thread: one stream's
decode steps 0.66-0.78x the profile, a 64-token prompt 0.94-1.31x), so a prompt's reading priced an idle colocated
worker's decode 1.3-1.8x slow, and admission refused a TPOT SLO it met as one no worker could meet. It runs on the
engine thread between steps, only while the engine holds no request (a request that comes meanwhile waits for its
steps), with the prefix cache off around it: its random blocks are neither matched nor keyed (nothing enters the
cache or the routers' prefix index; freed, they are plain free blocks for the next probe), and taken only from one
run of free blocks (the allocator would evict cached ones to make a run). Not a request: no output, no stream, no
step or request metrics.

A reading far from the factor now (`SpeedTracker.far`: over 1.5x either way) is taken only after a second probe at
once confirms it, and then the faster of the two: a pause of the process mid-probe (a GC, a SIGSTOP, a stalled VM)
only ever adds time, and one such reading, up to the 4x bound, replaced the factor, so routers priced the worker 4x
slow and sent it nothing until the next probe, 30 s on; a real change of speed reads in both. Not the thread's CPU
time against its wall time: a host truly slowed by other processes' load is wall time the thread did not run too,
and on CUDA the host thread's CPU time is not the step's work. A steady worker's readings stay within that bound
(smollm2-135m: 0.96-1.25x of their median), so it pays no second probe; a request that comes during the pair waits
for both.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Protocol

from pdserve.engine.engine import LLMEngine
from pdserve.protocol.engine_request import EngineRequest
from pdserve.protocol.roles import EngineMode
from pdserve.protocol.sampling import SamplingParams

# A prompt size the profile times (PREFILL_SHAPES): on smollm2-135m, one thread, a probe takes 0.22 s (256: 0.7 s).
PROBE_TOKENS = 64
PROBE_DECODES = 3  # a colocated worker's probe decodes this many tokens after its prompt (smollm2-135m: 0.05 s each)
PROBE_ID = "pdserve-speed-probe"  # its own tenant too: the fair queue's tags of real tenants do not move for it

# As `AsyncEngine.on_step` takes a step: prefill tokens, decode seqs, seconds, prefill squares, decode context.
Reading = tuple[int, int, float, int, int]


class ProbeReader(Protocol):
    """Where a probe's reading goes (`SpeedTracker`): each argument list a `Reading`."""

    def probed(self, tokens: int, seqs: int, seconds: float, squares: int, context: int, /) -> None:
        """Takes the reading."""

    def far(self, tokens: int, seqs: int, seconds: float, squares: int, context: int, /) -> bool:
        """Whether the reading is to be confirmed by a second probe before it is taken."""


def probe_decodes(engine: LLMEngine) -> int:
    """The decode steps a probe times after its prompt: a colocated worker's (its factor prices its decodes too)."""
    return PROBE_DECODES if engine.config.mode is EngineMode.MIXED else 0


def probe_tokens(engine: LLMEngine) -> int:
    """The probe's prompt: PROBE_TOKENS, fewer only where one step or the model holds fewer; 0 where no run of free
    blocks holds it and its decodes (no cached block is evicted for a probe; a shorter one would read mostly a
    step's fixed cost)."""
    decodes = probe_decodes(engine)
    tokens = min(PROBE_TOKENS, engine.config.scheduler.max_num_batched_tokens, engine.max_model_len - 1 - decodes)
    return tokens if engine.blocks.holds_free_run(engine.blocks.blocks_for(tokens + decodes)) else 0


def run_probe(engine: LLMEngine, reader: ProbeReader, may_run: Callable[[], bool]) -> bool:
    """On the engine thread: one probe, unless the engine holds a request or `may_run()` says no (a drain began);
    `reader.probed` gets its reading, as `AsyncEngine.on_step` gets a live step's; one `reader.far` off, only once a
    second probe confirms it, the faster of the two (or none: a drain began between them). False: no probe ran."""
    reading = _timed(engine, may_run)
    if reading is None:
        return False
    if reader.far(*reading):
        again = _timed(engine, may_run)
        if again is None:  # unconfirmed: nothing taken
            return True
        reading = min(reading, again, key=lambda r: r[2])  # the same shape: the faster is the lower ratio
    reader.probed(*reading)
    return True


def _timed(engine: LLMEngine, may_run: Callable[[], bool]) -> Reading | None:
    """One probe's reading (a colocated worker's: its middle decode step); None where none may run."""
    tokens, decodes = probe_tokens(engine), probe_decodes(engine)
    if engine.num_sequences or engine.has_unfinished() or tokens < 1 or not may_run():
        return None
    vocab = engine.model_config.vocab_size
    prompt = [random.randrange(vocab) for _ in range(tokens)]
    sampling = SamplingParams(max_tokens=1 + decodes, ignore_eos=True)
    readings: list[Reading] = []
    blocks, caching = engine.blocks, engine.blocks.enable_prefix_caching
    blocks.enable_prefix_caching = False
    try:
        engine.add_request(EngineRequest(PROBE_ID, prompt, sampling, tenant=PROBE_ID))
        for step in range(1 + decodes):
            start = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - start
            if engine.last_step_tokens != (1 if step else tokens):  # the pool could not hold it after all
                return None
            if step:
                readings.append((0, 1, seconds, 0, engine.last_step_decode_context))
            else:
                readings.append((tokens, 0, seconds, engine.last_step_prefill_squares, 0))
    finally:
        engine.abort(PROBE_ID)  # finished by its last token already, unless a step failed or ran short
        blocks.enable_prefix_caching = caching
    decoded = sorted(readings[1:], key=lambda reading: reading[2])
    return decoded[len(decoded) // 2] if decoded else readings[0]
