"""A colocated worker's request: prefilled here, in the same mixed batch that decodes it."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing

from pdserve.engine.async_engine import AsyncEngine
from pdserve.protocol.engine_request import EngineRequest
from pdserve.protocol.outputs import RequestOutput
from pdserve.telemetry import Telemetry, mark_ended_by


async def generate_here(
    engine: AsyncEngine, telemetry: Telemetry, worker_id: str, request: EngineRequest
) -> AsyncGenerator[RequestOutput, None]:
    # Not made current: a span context entered across `yield`s can be left from another context.
    attributes = {"request.id": request.request_id, "worker.id": worker_id}
    span = telemetry.tracer.start_span("decode.stream", attributes=attributes)
    tokens = 0
    try:
        async with aclosing(engine.generate(request)) as outs:  # its abort runs here, inside the call's span
            async for out in outs:
                tokens += len(out.new_token_ids)
                yield out
    except BaseException as e:
        mark_ended_by(span, e)
        raise
    finally:
        span.set_attribute("completion_tokens", tokens)
        span.end()
