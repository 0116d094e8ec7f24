"""A prefill worker's KV send whose caller cancels, once or twice (a caller's cancel, then a drain's): the
prompt's blocks stay held until the send thread is done reading them, never freed under it for another prompt to
overwrite mid-send; its span says it was cancelled (it read as a send that succeeded). The engine is real
(tiny-random, prefill only); the sender is a stand-in that reads slowly."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve.config import EngineConfig, SchedulerConfig
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.engine import LLMEngine
from pdserve.errors import UnavailableError
from pdserve.metrics import WorkerMetrics
from pdserve.protocol.engine_request import EngineRequest
from pdserve.protocol.handoff import KVTarget
from pdserve.protocol.roles import EngineMode
from pdserve.protocol.sampling import SamplingParams
from pdserve.telemetry import Telemetry
from pdserve.transfer.base import NotExpectedError, PeerLostError, TransferCancelledError, TransferError
from pdserve.transfer.send_start import SendStart
from services.prefill.run_and_send import PrefillJob, RunAndSend

pytestmark = pytest.mark.timeout(60)
READ_S = 0.6
WAIT_S = 3.0  # a send's wait for a stopped decode process: its deadline, here shorter


def prefill_engine() -> AsyncEngine:
    """A real prefill-only engine (tiny-random) with room for the test's prompt."""
    config = EngineConfig(
        model="tiny-random", device="cpu", dtype="float32", num_kv_blocks=64, block_size=4, num_threads=1,
        scheduler=SchedulerConfig(mode=EngineMode.PREFILL_ONLY),
    )  # fmt: skip
    return AsyncEngine(LLMEngine(config))


class SlowSender:
    """Reads the blocks for READ_S, noting whether the engine still held them when it was done."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.held_at_end: list[int] = []

    def send(
        self, rendezvous: str, tag: int, caches: object, blocks: list[int], timeout_s: float, start: SendStart
    ) -> int:
        start.begin()  # as the real sender, before it reads
        time.sleep(READ_S)
        self.held_at_end.append(self.engine.stats["kv_blocks_used"])
        return 1

    def close(self) -> None:
        """Nothing is open."""


@pytest.mark.parametrize("cancels", [1, 2])
async def test_the_blocks_outlive_the_send_however_often_its_caller_cancels(cancels: int) -> None:
    engine = prefill_engine()
    sender = SlowSender(engine)
    exporter = InMemorySpanExporter()
    worker = RunAndSend(engine, sender, "p0", Telemetry("t", SimpleSpanProcessor(exporter)))  # type: ignore[arg-type]
    request = EngineRequest("r", list(range(3, 23)), SamplingParams(max_tokens=8, ignore_eos=True))
    target = KVTarget("d0", "127.0.0.1:1", list(range(5)), 1, engine.fingerprint, engine.block_size)

    async def serve() -> None:  # as the prefill servicer consumes it
        async with contextlib.aclosing(worker.run(PrefillJob(request, target, 5.0))) as events:
            async for _ in events:
                pass

    try:
        task = asyncio.ensure_future(serve())
        while not engine.stats["kv_blocks_used"]:  # the prompt ran: its blocks are held for the send
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # the send thread is reading
        for _ in range(cancels):
            task.cancel()
            await asyncio.sleep(0.05)
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert sender.held_at_end == [5]  # the whole send read blocks the prompt still held
        await asyncio.sleep(0.1)
        assert engine.stats["kv_blocks_used"] == 0  # and they went once it was done
        (send,) = [s for s in exporter.get_finished_spans() if s.name == "kv_transfer.send"]
        assert send.attributes["cancelled"] is True and "kv.bytes" not in send.attributes
    finally:
        engine.stop()


class SilentPeerSender:
    """Waits WAIT_S for its decode process's answer (stopped, it never comes) before it reads the blocks."""

    def __init__(self) -> None:
        self.called_off = threading.Event()

    def send(
        self, rendezvous: str, tag: int, caches: object, blocks: list[int], timeout_s: float, start: SendStart
    ) -> int:
        time.sleep(WAIT_S)
        try:
            start.begin()
        except TransferCancelledError:
            self.called_off.set()
            raise
        return 1

    def close(self) -> None:
        """Nothing is open."""


async def test_a_send_still_waiting_for_its_peer_when_its_caller_cancels_frees_the_blocks_at_once() -> None:
    """Its decode worker stopped (its Prefill call ended by keepalive, or the router gave up on it): the blocks
    go at once, not when the send's wait ends (its deadline: `--kv-transfer-timeout`), and the send never reads
    them."""
    engine = prefill_engine()
    sender = SilentPeerSender()
    worker = RunAndSend(engine, sender, "p0", Telemetry("t"))  # type: ignore[arg-type]
    request = EngineRequest("r", list(range(3, 23)), SamplingParams(max_tokens=8, ignore_eos=True))
    target = KVTarget("d0", "127.0.0.1:1", list(range(5)), 1, engine.fingerprint, engine.block_size)

    async def serve() -> None:
        async with contextlib.aclosing(worker.run(PrefillJob(request, target, 5.0))) as events:
            async for _ in events:
                pass

    try:
        task = asyncio.ensure_future(serve())
        while not engine.stats["kv_blocks_used"]:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # the send waits for its peer
        task.cancel()
        cancelled = time.monotonic()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        while engine.stats["kv_blocks_used"]:
            assert time.monotonic() - cancelled < WAIT_S / 4, "the blocks wait for the send"
            await asyncio.sleep(0.01)
        assert await asyncio.to_thread(sender.called_off.wait, WAIT_S + 5)  # it ended without reading them
    finally:
        engine.stop()


class FailingSender:
    """A send the decode side ends: `error` is what the pair raises."""

    def __init__(self, error: TransferError) -> None:
        self.error = error

    def send(
        self, rendezvous: str, tag: int, caches: object, blocks: list[int], timeout_s: float, start: SendStart
    ) -> int:
        raise self.error

    def close(self) -> None:
        """Nothing is open."""


@pytest.mark.parametrize(
    ("error", "counted"),
    [
        # Its decode worker died: gone, it counts nothing, so the prefill worker's count is the only one.
        (PeerLostError("connection closed by peer"), {"peer_gone": 1}),
        # Its decode worker gave up first (cancelled, timed out) and counted that: this refusal is its echo.
        (NotExpectedError("no recv is waiting for that tag"), {}),
    ],
)
async def test_a_failed_send_counts_once_on_the_side_that_saw_it(error: TransferError, counted: dict) -> None:
    engine = prefill_engine()
    telemetry = Telemetry("t")
    metrics = WorkerMetrics(telemetry.meter, "p0", "prefill", lambda: {})
    worker = RunAndSend(engine, FailingSender(error), "p0", telemetry, metrics)  # type: ignore[arg-type]
    request = EngineRequest("r", list(range(3, 23)), SamplingParams(max_tokens=8, ignore_eos=True))
    target = KVTarget("d0", "127.0.0.1:1", list(range(5)), 1, engine.fingerprint, engine.block_size)
    try:
        with pytest.raises(UnavailableError, match="KV transfer to decode worker d0 failed"):
            async with contextlib.aclosing(worker.run(PrefillJob(request, target, 5.0))) as events:
                async for _ in events:
                    pass
        samples = [s for f in telemetry.registry.collect() for s in f.samples]
        failures = {s.labels["reason"]: s.value for s in samples if s.name == "pdserve_kv_transfer_failures_total"}
        assert {reason: n for reason, n in failures.items() if n} == counted
    finally:
        engine.stop()
        telemetry.shutdown()
