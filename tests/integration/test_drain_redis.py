"""A worker's drain through a real redis-server and a router's view of it: the entry says `draining` at once (well
before the next heartbeat), new streams get UNAVAILABLE, a stream past the timeout is cut with UNAVAILABLE, every KV
block is free, then the worker deregisters and reports itself drained (what its supervisor replaces)."""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc
import pytest

from pdserve.cluster.drain import WorkerDrainedError
from pdserve.cluster.worker_runtime import WorkerRuntime
from pdserve.cluster.worker_spec import WorkerSpec
from pdserve.config import EngineConfig
from pdserve.registry.redis import RedisRegistry
from pdserve.rpc.server import channel
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc
from services.workers import add_worker_services
from tests.redis_server import RedisServer

pytestmark = pytest.mark.timeout(180)
HEARTBEAT_S = 2.0  # long: the draining entry must not wait for a beat


async def until(cond, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not cond():
        assert time.monotonic() - start < timeout_s, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)
    return time.monotonic() - start


async def stream(address: str, request_id: str, max_tokens: int) -> list[int]:
    req = wpb.WorkerGenerateRequest(
        request_id=request_id,
        prompt_token_ids=[5, 6, 7, 8],
        sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )
    out: list[int] = []
    async with channel(address) as ch:
        try:
            async for msg in worker_pb2_grpc.DecodeWorkerStub(ch).Generate(req, timeout=60):
                out.extend(msg.token_ids)
        except grpc.aio.AioRpcError as e:
            raise AssertionError((e.code(), e.details(), len(out))) from e
    return out


async def test_a_drained_worker_leaves_the_redis_view_at_once_and_frees_everything():
    server = RedisServer()
    server.start()
    engine = EngineConfig(model="tiny-random", num_threads=1, kv_cache_memory_gb=0.05)
    worker_id = f"cw-{uuid.uuid4().hex[:6]}"
    spec = WorkerSpec("colocated", engine, worker_id=worker_id, registry_url=server.url, heartbeat_s=HEARTBEAT_S)
    worker = WorkerRuntime(spec, add_worker_services)
    router = RedisRegistry(server.url, refresh_s=0.05)
    try:
        address = await asyncio.to_thread(worker.address, 120)
        await router.start()
        await until(lambda: len(router.workers()) == 1, 3 * HEARTBEAT_S, "the worker to register")
        long = asyncio.create_task(stream(address, "long", 4000))
        await until(lambda: worker.state().running == 1, 60, "it to run")  # its own state: no beat to wait for
        async with channel(address) as ch:
            # 0.2 s: the stream of 4000 tokens runs longer (it finished within a 1 s drain on a quiet machine)
            drain = asyncio.ensure_future(worker_pb2_grpc.WorkerControlStub(ch).Drain(wpb.DrainRequest(timeout_s=0.2)))
            seen_after = await until(lambda: router.workers() and router.workers()[0].draining, 1.0, "draining")
            with pytest.raises(AssertionError) as refused:
                await stream(address, "late", 4)
            report = await drain
        assert refused.value.args[0][:1] == (grpc.StatusCode.UNAVAILABLE,) and "draining" in refused.value.args[0][1]
        with pytest.raises(AssertionError) as cut:
            await long
        code, details, streamed = cut.value.args[0]
        assert code == grpc.StatusCode.UNAVAILABLE and "drained before this request finished" in details
        assert streamed > 0
        assert (report.held, report.finished, report.moved, report.kv_blocks_left) == (1, 0, 1, 0)
        assert report.kv_blocks_held > 0
        await until(lambda: router.workers() == [], 2.0, "the worker to deregister")
        await until(lambda: isinstance(_state_error(worker), WorkerDrainedError), 5.0, "its state to say drained")
        print(f"the router's view showed the worker draining {seen_after * 1e3:.0f} ms after the drain began")
    finally:
        await router.close()
        worker.stop()
        server.stop()


def _state_error(worker: WorkerRuntime) -> BaseException | None:
    try:
        worker.state()
    except BaseException as e:
        return e
    return None
