"""Router latency with and without tracing + metrics, against a fake decode worker (no model), in one process.

Usage: .venv/bin/python scripts/telemetry_overhead.py [--requests 200] [--rounds 4] [--tokens 8]
Alternates the two configurations round by round, so load from elsewhere hits both alike. "on" exports
every span (BatchSpanProcessor into an in-memory exporter) and records every metric; "off" uses no-op
providers and no interceptors. Prints client-side p50/p99 of TTFT and end-to-end latency.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve.config import RouterConfig
from pdserve.registry.base import WorkerState
from pdserve.registry.memory import InMemoryPrefixIndex, InMemoryRegistry
from pdserve.rpc.client import generate
from pdserve.rpc.server import Server
from pdserve.telemetry import Telemetry
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import worker_pb2_grpc
from services.router.server import start_router


class FakeDecode(worker_pb2_grpc.DecodeWorkerServicer):
    async def Generate(self, request, context):  # noqa: N802
        n = request.sampling.max_tokens
        for i in range(n):
            last = i == n - 1
            yield pb.GenerateResponse(
                token_ids=[5], text="x", finish_reason=pb.FINISH_REASON_LENGTH if last else pb.FINISH_REASON_UNSPECIFIED
            )


async def measure(router: str, requests: int, tokens: int) -> tuple[list[float], list[float]]:
    request = pb.GenerateRequest(prompt_token_ids=[1, 2, 3, 4] * 8, sampling=pb.SamplingParams(max_tokens=tokens))
    ttft, e2e = [], []
    for _ in range(requests):
        start = time.perf_counter()
        result = None
        async for _, running in generate(router, request, 10):
            result = running
        e2e.append(time.perf_counter() - start)
        ttft.append(result.ttft_s)
    return ttft, e2e


async def main(args: argparse.Namespace) -> None:
    fake = Server("127.0.0.1", 0)
    servicer = FakeDecode()
    fake.add(lambda s: worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, s), [])
    await fake.start()
    registry = InMemoryRegistry(ttl_s=1e9)
    registry.publish(WorkerState("colocated-0", "colocated", fake.address, kv_blocks_total=10**6, kv_blocks_free=10**6))
    routers, keep = {}, [fake]
    for name, telemetry in (
        ("off", Telemetry("pdserve-router", enabled=False)),
        ("on", Telemetry("pdserve-router", span_processor=BatchSpanProcessor(InMemorySpanExporter()))),
    ):
        server, _ = await start_router(
            "tiny-random", registry, InMemoryPrefixIndex(), RouterConfig(), "127.0.0.1", 0, telemetry
        )
        routers[name] = server.address
        keep.append(server)  # a dropped grpc.aio server stops serving
        await measure(server.address, 20, args.tokens)  # warm-up
    results = {name: ([], []) for name in routers}
    for _ in range(args.rounds):
        for name, address in routers.items():
            ttft, e2e = await measure(address, args.requests, args.tokens)
            results[name][0].extend(ttft)
            results[name][1].extend(e2e)
    print(
        f"{'':4} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'e2e p50 ms':>11} {'e2e p99 ms':>11}  ({args.tokens} tokens)"
    )
    for name, (ttft, e2e) in results.items():
        q = lambda xs, p: statistics.quantiles(xs, n=100)[p - 1] * 1e3  # noqa: E731
        print(f"{name:4} {q(ttft, 50):12.3f} {q(ttft, 99):12.3f} {q(e2e, 50):11.3f} {q(e2e, 99):11.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=8)
    asyncio.run(main(parser.parse_args()))
