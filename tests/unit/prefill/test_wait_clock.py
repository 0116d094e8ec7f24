"""The wait a prefill worker reports for a prompt (`waited_ms`, which routers take out of the TTFT their calibration
learns from) is a duration on the monotonic clock: a step of the wall clock (NTP's) between the prompt's arrival
and its first step leaves it as it was. The spans keep wall-clock times, which they export."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from pdserve.protocol.engine_request import EngineRequest
from pdserve.protocol.handoff import FirstToken, KVTarget
from pdserve.protocol.sampling import SamplingParams
from services.prefill.run_and_send import PrefillJob
from tests.unit.prefill.traced_worker import traced_worker

pytestmark = pytest.mark.timeout(60)
STEP_NS = 3600 * 10**9  # the wall clock an hour on, as an NTP step after a long drift may set it


async def test_a_wall_clock_step_before_the_prompts_first_step_leaves_its_wait_as_it_was(monkeypatch) -> None:
    worker, engine, exporter = traced_worker()
    request = EngineRequest("stepped", list(range(3, 11)), SamplingParams(max_tokens=1))  # done at its first token
    target = KVTarget("d0", "127.0.0.1:1", [0, 1], 1, engine.fingerprint, engine.block_size)
    wall_ns = time.time_ns
    # Read on the engine thread (the step's start) the wall clock is an hour on; on the caller's (the prompt's
    # arrival), not yet: the step came between the two.
    monkeypatch.setattr(
        time, "time_ns", lambda: wall_ns() + (STEP_NS if threading.current_thread().name == "engine-loop" else 0)
    )
    try:
        async with contextlib.aclosing(worker.run(PrefillJob(request, target, 5.0))) as events:
            (first,) = [event async for event in events]
    finally:
        engine.stop()
    assert isinstance(first, FirstToken) and first.waited_s is not None
    assert 0 <= first.waited_s < 60, first.waited_s  # an hour's step would show as 3600 s
    (queue_wait,) = [s for s in exporter.get_finished_spans() if s.name == "prefill.queue_wait"]
    assert queue_wait.end_time - queue_wait.start_time > STEP_NS // 2  # the spans' times are the wall clock's
