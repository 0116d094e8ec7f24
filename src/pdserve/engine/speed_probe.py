"""One timed prefill through an idle engine: a clean reading of a worker's speed when no live step gives one.

A worker whose start-up profile read slow (timed while other processes loaded its host) is priced slow, so at low
load the router sends it nothing, and without steps its live correction never moves (cluster/speed_recheck.py
decides when to probe). The probe is one step of random tokens, as a request of its own would run, timed as
`AsyncEngine` times a live step, so its reading and the live steps' agree. It runs on the engine thread between
steps, only while the engine holds no request (a request that comes meanwhile waits this one step), with the
prefix cache off around it: its random blocks are neither matched nor keyed (nothing enters the cache or the
routers' prefix index; freed, they are plain free blocks for the next probe), and taken only from one run of free
blocks (the allocator would evict cached ones to make a run). Not a request: no output, no stream, no step or
request metrics.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from pdserve.engine.engine import LLMEngine
from pdserve.protocol.engine_request import EngineRequest
from pdserve.protocol.sampling import SamplingParams

# A prompt size the profile times (PREFILL_SHAPES): on smollm2-135m, one thread, a probe takes 0.22 s (256: 0.7 s).
PROBE_TOKENS = 64
PROBE_ID = "pdserve-speed-probe"  # its own tenant too: the fair queue's tags of real tenants do not move for it


def probe_tokens(engine: LLMEngine) -> int:
    """The probe's prompt: PROBE_TOKENS, fewer only where one step or the model holds fewer; 0 where no run of free
    blocks holds it (no cached block is evicted for a probe; a shorter one would read mostly a step's fixed cost)."""
    tokens = min(PROBE_TOKENS, engine.config.scheduler.max_num_batched_tokens, engine.max_model_len - 1)
    return tokens if engine.blocks.holds_free_run(engine.blocks.blocks_for(tokens)) else 0


def run_probe(engine: LLMEngine, took: Callable[[int, float, int], None], may_run: Callable[[], bool]) -> bool:
    """On the engine thread: one probe step, unless the engine holds a request or `may_run()` says no (a drain
    began); `took(prefill tokens, seconds, attention squares)` gets its reading. False: no probe ran."""
    tokens = probe_tokens(engine)
    if engine.num_sequences or engine.has_unfinished() or tokens < 1 or not may_run():
        return False
    vocab = engine.model_config.vocab_size
    prompt = [random.randrange(vocab) for _ in range(tokens)]
    request = EngineRequest(PROBE_ID, prompt, SamplingParams(max_tokens=1), tenant=PROBE_ID)
    blocks, caching = engine.blocks, engine.blocks.enable_prefix_caching
    blocks.enable_prefix_caching = False
    try:
        engine.add_request(request)
        start = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - start
    finally:
        engine.abort(PROBE_ID)  # finished by its one token already, unless the step failed
        blocks.enable_prefix_caching = caching
    if engine.last_step_tokens != tokens:  # the pool could not hold it after all: no reading
        return False
    took(tokens, seconds, engine.last_step_prefill_squares)
    return True
