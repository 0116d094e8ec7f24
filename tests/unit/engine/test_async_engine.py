"""AsyncEngine: callers on an event loop, the engine on its own thread; a caller that leaves must not stop it."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pdserve.config import EngineConfig
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.engine import LLMEngine

pytestmark = pytest.mark.timeout(60)


async def test_a_call_cancelled_while_queued_still_runs_and_the_engine_keeps_serving():
    engine = AsyncEngine(LLMEngine(EngineConfig(model="tiny-random", device="cpu", num_kv_blocks=8, num_threads=1)))
    try:
        gate, ran = threading.Event(), threading.Event()
        held = asyncio.ensure_future(engine.call(lambda e: gate.wait(10)))  # keeps the next command queued
        queued = asyncio.ensure_future(engine.call(lambda e: ran.set()))
        await asyncio.sleep(0)  # both submitted
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        gate.set()
        assert await held
        assert await asyncio.wait_for(engine.call(lambda e: "serving"), timeout=10) == "serving"
        assert ran.is_set()  # a release or abort must not be lost with its caller
        assert engine.alive
    finally:
        engine.stop()
