"""Sends a burst of generate requests at once from a fresh, lightweight process and prints the outcomes.

Run apart from pytest: a test process that has imported torch and transformers adds its own garbage
collection pauses to every latency it measures.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time

import grpc

from pdserve.rpc.server import channel
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc


async def burst(address: str, count: int, prompt_tokens: int, ttft_slo_ms: float) -> list[dict[str, object]]:
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 49000) for _ in range(prompt_tokens)] for _ in range(count)]
    async with channel(address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)

        async def one(prompt: list[int]) -> dict[str, object]:
            request = pb.GenerateRequest(
                prompt_token_ids=prompt,
                sampling=pb.SamplingParams(max_tokens=4, ignore_eos=True),
                slo=pb.SLO(ttft_ms=ttft_slo_ms),
            )
            start = time.perf_counter()
            ttft = None
            try:
                async for msg in stub.Generate(request, timeout=120):
                    if msg.token_ids and ttft is None:
                        ttft = time.perf_counter() - start
            except grpc.aio.AioRpcError as e:
                meta = {k: v for k, v in (e.trailing_metadata() or ())}
                return {"status": e.code().name, "seconds": time.perf_counter() - start, "meta": meta}
            return {"status": "ok", "seconds": ttft, "meta": {}}

        return await asyncio.gather(*(one(p) for p in prompts))


if __name__ == "__main__":
    address, count, tokens, slo = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    print(json.dumps(asyncio.run(burst(address, count, tokens, slo))))
