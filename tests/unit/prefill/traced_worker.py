"""A prefill worker's RunAndSend over a real tiny-random engine (prefill only, 16 blocks of 4), its spans kept in
memory: what the prefill unit tests drive without gRPC or a decode side."""

from __future__ import annotations

from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve.config import EngineConfig, SchedulerConfig
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.engine import LLMEngine
from pdserve.protocol.roles import EngineMode
from pdserve.telemetry import Telemetry
from services.prefill.run_and_send import RunAndSend


def traced_worker() -> tuple[RunAndSend, AsyncEngine, InMemorySpanExporter]:
    """The worker, its engine (stop it) and its spans."""
    config = EngineConfig(
        model="tiny-random", device="cpu", dtype="float32", num_kv_blocks=16, block_size=4, num_threads=1,
        scheduler=SchedulerConfig(mode=EngineMode.PREFILL_ONLY),
    )  # fmt: skip
    engine = AsyncEngine(LLMEngine(config))
    exporter = InMemorySpanExporter()
    worker = RunAndSend(engine, None, "p0", Telemetry("t", SimpleSpanProcessor(exporter)))  # type: ignore[arg-type]
    return worker, engine, exporter
