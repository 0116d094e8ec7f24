"""How long a decode-only engine's hand-off commands wait behind a running batch.

`reserve` (the KV blocks) and `commit` (the first token) run on the engine thread between steps. This times
them on an `AsyncEngine` idle and decoding 1, 4 and 16 background sequences (their KV is never sent: the
steps' cost is what matters, not their tokens).

    .venv/bin/python docs/experiments/decode_wait/command_wait.py --model smollm2-135m
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from pdserve.config import EngineConfig, SchedulerConfig
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.engine import LLMEngine
from pdserve.protocol.engine_request import EngineRequest
from pdserve.protocol.handoff import FirstToken
from pdserve.protocol.roles import EngineMode
from pdserve.protocol.sampling import SamplingParams

PROMPT = list(range(100, 164))


async def _handoff(engine: AsyncEngine, request_id: str) -> tuple[float, float]:
    """(reserve, commit to first token) in ms."""
    start = time.perf_counter()
    await engine.reserve(EngineRequest(request_id, PROMPT, SamplingParams(max_tokens=2, ignore_eos=True)))
    reserved = time.perf_counter()
    first = None
    async for _ in engine.commit_and_stream(request_id, FirstToken(5, True, 0)):
        first = first or time.perf_counter()
    assert first is not None
    return (reserved - start) * 1e3, (first - reserved) * 1e3


async def _decode(engine: AsyncEngine, request_id: str) -> None:
    await engine.reserve(EngineRequest(request_id, PROMPT[:16], SamplingParams(max_tokens=1500, ignore_eos=True)))
    async for _ in engine.commit_and_stream(request_id, FirstToken(5, True, 0)):
        pass


async def _measure(engine: AsyncEngine, batches: list[int], probes: int) -> None:
    print("batch | reserve p50 ms | commit to first token p50 ms")
    for batch in batches:
        background = [asyncio.ensure_future(_decode(engine, f"bg-{batch}-{i}")) for i in range(batch)]
        await asyncio.sleep(3.0)
        rows = [await _handoff(engine, f"probe-{batch}-{i}") for i in range(probes)]
        if ended := [t for t in background if t.done()]:
            raise RuntimeError(f"a background sequence ended early: {ended[0].exception()!r}")
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        reserve, commit = (statistics.median(r[i] for r in rows) for i in (0, 1))
        print(f"{batch:5d} | {reserve:14.1f} | {commit:28.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batches", type=int, nargs="+", default=[0, 1, 4, 16])
    parser.add_argument("--probes", type=int, default=20)
    args = parser.parse_args()
    scheduler = SchedulerConfig(mode=EngineMode.DECODE_ONLY)
    config = EngineConfig(model=args.model, num_threads=1, num_kv_blocks=2048, scheduler=scheduler)
    engine = AsyncEngine(LLMEngine(config))
    try:
        asyncio.run(_measure(engine, args.batches, args.probes))
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
