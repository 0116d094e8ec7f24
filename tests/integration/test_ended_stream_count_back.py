"""Two real in-process routers on one redis-server and in-process tiny-random workers whose reports the test publishes
(as their heartbeat does, but when it says): a stream that ended on its decode worker before a report, whose end the
router learns of only after that report, is not counted back as freed blocks a second time, beside another router's
stream on the same worker (where the cap of what the report held beyond our running streams does not bind)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest

from pdserve.cluster.worker_runtime import WorkerRuntime
from pdserve.config import RouterConfig
from pdserve.registry.base import WorkerState
from pdserve.registry.memory import InMemoryPrefixIndex
from pdserve.registry.redis import RedisRegistry
from pdserve.rpc.server import channel
from pdserve.telemetry import Telemetry
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc
from services.router.lifecycle import RequestLifecycle
from services.router.server import RouterServer, start_router
from tests.integration.in_process_workers import in_process_workers
from tests.redis_server import started

pytestmark = pytest.mark.timeout(180)
HELD = "held-"  # the other router's stream: its steps slowed, so it holds its blocks throughout

redis_server = pytest.fixture(scope="module")(started)


@pytest.fixture(scope="module")
def workers() -> Iterator[tuple[WorkerRuntime, WorkerRuntime]]:
    faults = {"PDSERVE_FAULT_SLOW_STEP_REQUEST_ID_PREFIX": HELD, "PDSERVE_FAULT_SLOW_STEP_S": "0.01"}
    with in_process_workers("count-back", faults) as pair:
        yield pair


class Reports:
    """The workers' heartbeat into Redis every 0.1 s, which the test may hold (`held`) to publish one itself."""

    def __init__(self, url: str, workers: tuple[WorkerRuntime, ...]) -> None:
        self.registry = RedisRegistry(url)
        self.workers = workers
        self.held = False

    def publish(self) -> None:
        for w in self.workers:
            self.registry.publish(w.state())

    async def beat(self) -> None:
        while True:
            if not self.held:
                self.publish()
            await asyncio.sleep(0.1)


@pytest.fixture
async def cluster(redis_server, workers) -> AsyncIterator[tuple[Reports, list[tuple[RouterServer, RequestLifecycle]]]]:
    reports = Reports(redis_server.url, workers)
    reports.publish()
    beating = asyncio.ensure_future(reports.beat())
    routers, registries = [], []
    try:
        for _ in range(2):
            registry = RedisRegistry(redis_server.url, refresh_s=0.05)
            await registry.start()
            registries.append(registry)
            telemetry = Telemetry("pdserve-router", enabled=False)
            routers.append(
                await start_router(
                    "tiny-random", registry, InMemoryPrefixIndex(), RouterConfig(), "127.0.0.1", 0, telemetry
                )
            )
        yield reports, routers
    finally:
        beating.cancel()
        for server, _ in routers:
            await server.stop(None)
        for registry in registries:
            await registry.close()
        await reports.registry.close()


def request(request_id: str, prompt_tokens: int, max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=[5 + i % 200 for i in range(prompt_tokens)],
        sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        slo=pb.SLO(ttft_ms=60_000, tpot_ms=10_000),  # the slowed steps are no reason to shed here
    )


async def read_tokens(call: grpc.aio.UnaryStreamCall, count: int) -> None:
    got = 0
    while got < count:
        got += len((await call.read()).token_ids)


def ended_and_reported(decode: WorkerRuntime, reports: Reports, sequences: int) -> WorkerState:
    """Blocks this thread, and so the routers' loop, until the decode worker holds `sequences` and has published it:
    a router whose loop stands still learns of the end only after the report, as one whose message was in flight."""
    end = time.monotonic() + 10
    while decode.state().sequences > sequences:
        assert time.monotonic() < end, "the stream did not end on its worker"
        time.sleep(0.005)
    reports.held = True
    report = decode.state()
    reports.registry.publish(report)
    return report


async def test_a_stream_freed_before_the_report_that_reached_the_router_after_it_is_not_counted_back(cluster, workers):
    reports, ((router_a, lifecycle_a), (router_b, _)) = cluster
    decode = workers[1]
    predictor, view = lifecycle_a.placement.predictor, lifecycle_a.placement.registry
    async with channel(router_a.address) as to_a, channel(router_b.address) as to_b:
        held = generate_pb2_grpc.GenerationStub(to_b).Generate(request(f"{HELD}b", 100, 900), timeout=60)
        await read_tokens(held, 200)  # router b's stream holds 19 blocks and its next's
        ours = generate_pb2_grpc.GenerationStub(to_a).Generate(request("ours", 100, 64), timeout=60)
        await read_tokens(ours, 16)  # 48 more, at 10 ms a step or more
        report = ended_and_reported(decode, reports, sequences=1)
        try:
            assert report.kv_blocks_total - report.kv_blocks_free >= 20  # b's: the cap leaves ours (9) to count
            while await ours.read() is not grpc.aio.EOF:  # router a learns of its end
                pass
            end = time.monotonic() + 3
            while not (lifecycle_a.tracker.decoding[decode.worker_id] == 0 and view.workers("decode")[0] == report):
                assert time.monotonic() < end, "router a did not read the report"
                await asyncio.sleep(0.01)
            estimate = predictor.free_blocks(view.workers("decode")[0])
            assert estimate == report.kv_blocks_free, (estimate, report.kv_blocks_free)
        finally:
            reports.held = False
            held.cancel()
