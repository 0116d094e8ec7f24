"""A colocated worker's request: prefilled here, in the same mixed batch that decodes it."""

from __future__ import annotations

from collections.abc import AsyncIterator

from pdserve.engine.async_engine import AsyncEngine
from pdserve.protocol.outputs import RequestOutput
from pdserve.protocol.sampling import SamplingParams
from pdserve.telemetry import Telemetry


async def generate_here(
    engine: AsyncEngine,
    telemetry: Telemetry,
    worker_id: str,
    request_id: str,
    prompt: list[int],
    sampling: SamplingParams,
    cache_salt: bytes = b"",
    resumed_output_tokens: int = 0,
) -> AsyncIterator[RequestOutput]:
    # Not made current: a span context entered across `yield`s can be left from another context.
    span = telemetry.tracer.start_span("decode.stream", attributes={"request.id": request_id, "worker.id": worker_id})
    tokens = 0
    try:
        async for out in engine.generate(request_id, prompt, sampling, cache_salt, resumed_output_tokens):
            tokens += len(out.new_token_ids)
            yield out
    finally:
        span.set_attribute("completion_tokens", tokens)
        span.end()
