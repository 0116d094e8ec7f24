"""A decode worker's hand-off whose stream its caller closes (as gRPC closes a handler's response iterator) rather
than cancels: the sequence is aborted and its blocks freed then, not when a garbage collection reaches the stream.
The engine is real (tiny-random, decode only); the prefill worker and the KV bytes are stand-ins that answer at
once, since only the decode side's bookkeeping is under test."""

from __future__ import annotations

import asyncio
import contextlib
import gc

import pytest

from pdserve.config import EngineConfig, SchedulerConfig
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.engine import LLMEngine
from pdserve.protocol.engine_request import EngineRequest
from pdserve.protocol.handoff import FirstToken
from pdserve.protocol.roles import EngineMode
from pdserve.protocol.sampling import SamplingParams
from pdserve.telemetry import Telemetry
from services.decode.handoff import Handoff, HandoffRequest

pytestmark = pytest.mark.timeout(60)


class InstantReceiver:
    """The KV 'arrives' at once (the blocks keep whatever they held)."""

    def rendezvous(self, peer: str) -> str:
        return "127.0.0.1:1"

    def recv(self, peer: str, tag: int, caches: object, blocks: list[int], timeout_s: float) -> int:
        return 1

    def cancel(self, peer: str, tag: int) -> None:
        """Nothing waits."""


class InstantCall:
    async def first_token(self) -> FirstToken:
        return FirstToken(7, True, 0)

    async def sent(self) -> None:
        """Confirmed at once."""

    async def cancel(self) -> None:
        """Nothing runs."""


class InstantPrefill:
    def prefill(self, *args: object) -> InstantCall:
        return InstantCall()


def decode_engine() -> AsyncEngine:
    config = EngineConfig(
        model="tiny-random",
        device="cpu",
        dtype="float32",
        num_kv_blocks=1024,
        block_size=4,
        num_threads=1,
        scheduler=SchedulerConfig(mode=EngineMode.DECODE_ONLY),
    )
    return AsyncEngine(LLMEngine(config))


async def test_a_closed_stream_aborts_its_sequence_at_once() -> None:
    engine = decode_engine()
    handoff = Handoff(engine, InstantReceiver(), InstantPrefill(), "d0", Telemetry("t", enabled=False), 2.0)
    request = EngineRequest("r", list(range(3, 43)), SamplingParams(max_tokens=3000, ignore_eos=True))
    gc.disable()  # the stream must go on its close, not on a collection's
    try:

        async def dispatched() -> None:
            """Nothing to tell."""

        stream = handoff.stream(HandoffRequest(request, "p:1", "r"), lambda: None, dispatched)
        async with contextlib.aclosing(stream):
            async for _ in stream:
                break
        await asyncio.sleep(0.3)
        assert await engine.abort("nothing") is False  # a round trip through the engine thread: its steps are done
        assert engine.stats["kv_blocks_used"] == 0 and engine.stats["sequences"] == 0
    finally:
        gc.enable()
        engine.stop()


async def test_a_failed_hand_off_on_a_dead_engine_frees_nothing_and_logs_no_unread_error() -> None:
    """Its blocks went with the engine: the free's abort finds it dead, which is no error of anyone's, and must not
    surface as asyncio's "exception was never retrieved" once the free's task is collected."""
    engine = decode_engine()
    engine.stop()  # the engine thread is gone: every command raises EngineDeadError
    handoff = Handoff(engine, InstantReceiver(), InstantPrefill(), "d0", Telemetry("t", enabled=False), 2.0)
    unread: list[str] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, context: unread.append(context["message"]))
    handoff._free("r", "p:1", 7, None)  # noqa: SLF001 (the path every failed hand-off takes)
    while handoff._freeing:  # noqa: SLF001
        await asyncio.sleep(0.01)
    gc.collect()
    assert unread == []
