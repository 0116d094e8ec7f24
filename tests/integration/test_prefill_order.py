"""A short prompt sent while a long one's chunks run on the prefill worker gets its first token first, through real
workers (in-process WorkerRuntimes: gRPC on loopback, the KV transfer over torch.distributed, engine threads) behind
a real router (start_router): the prefill worker runs it at the next chunk boundary (engine/short_first.py), where
first come, first served it waited for every chunk of the long one; the prefill worker then reports the long one's
prefill stretched by the short one's step (engine/prefill_stretch.py), which routers price its next long prompts by."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from pdserve.cluster.worker_runtime import WorkerRuntime
from pdserve.config import EngineConfig
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc
from tests.integration.in_process_workers import in_process_workers, router_over

pytestmark = pytest.mark.timeout(300)
LONG = "long-"  # each prefill step that runs it takes 0.4 s more: its 4 chunks hold the prefill worker 1.6 s
CHUNK = EngineConfig().scheduler.long_prefill_chunk


@pytest.fixture(scope="module")
def workers() -> Iterator[tuple[WorkerRuntime, WorkerRuntime]]:
    faults = {"PDSERVE_FAULT_SLOW_STEP_S": "0.4", "PDSERVE_FAULT_SLOW_STEP_REQUEST_ID_PREFIX": LONG}
    with in_process_workers("order", faults) as both:
        yield both


async def first_token_at(stub: generate_pb2_grpc.GenerationStub, request_id: str, prompt_tokens: int, seed: int):
    """When (monotonic) the request's first token arrived; the stream is read to its end."""
    prompt = [3 + (seed + 7 * i) % 200 for i in range(prompt_tokens)]  # seeds apart share no cached prefix
    sampling = pb.SamplingParams(max_tokens=2, ignore_eos=True)
    first = None
    async for msg in stub.Generate(
        pb.GenerateRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling)
    ):
        if msg.token_ids and first is None:
            first = time.monotonic()
    assert first is not None
    return first


async def until(check: Callable[[], bool], timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < end, f"{check.__name__} did not hold within {timeout_s} s"
        await asyncio.sleep(0.005)


async def test_a_short_prompt_sent_during_a_long_ones_prefill_gets_its_first_token_first(workers):
    prefill, _ = workers
    async with router_over(workers) as (server, _), grpc.aio.insecure_channel(server.address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        long = asyncio.ensure_future(first_token_at(stub, f"{LONG}1", 4 * CHUNK - 10, seed=1))

        def long_prompt_part_way() -> bool:  # its first chunk computed, three to go
            queued = prefill.state().queued_prefill_tokens
            return 0 < queued < 4 * CHUNK - 10

        assert prefill.state().prefill_stretch == 1.0
        await until(long_prompt_part_way)
        short = await first_token_at(stub, "short-1", 100, seed=2)
        assert not long.done()
        assert short < await long
        assert prefill.state().prefill_stretch > 1.0
