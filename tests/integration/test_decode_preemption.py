"""A decode worker out of KV blocks preempts a stream, which waits to be recomputed: through a real `pdserve up`
(1 + 1, tiny-random, 26 KV blocks a worker), the stream waits out its turn on its worker, longer than the router's
stall bound, and ends with the single-process engine's tokens, never taken for a hung worker's and moved."""

from __future__ import annotations

import asyncio
import re
import time

import grpc
import pytest

from pdserve.cluster.local_process import ClusterProcess
from pdserve.rpc.server import channel
from pdserve.v1 import generate_pb2_grpc
from tests.integration.cluster_view import scrape, status_json, total
from tests.integration.reference import greedy, greedy_request

pytestmark = pytest.mark.timeout(300)
STALL_S = 2.0
STEP_S = 0.05  # each decode step running a "slow-" request: the preempted stream waits 100 of them, 5 s
BLOCKS = 26


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    log = tmp_path_factory.mktemp("preemption") / "cluster.log"
    args = ["--model", "tiny-random", "--prefill", "1", "--decode", "1", "--kv-cache-gb", str(BLOCKS * 8192 / 2**30)]
    env = {"PDSERVE_FAULT_SLOW_STEP_S": str(STEP_S), "PDSERVE_FAULT_SLOW_STEP_REQUEST_ID_PREFIX": "slow-"}
    proc = ClusterProcess(*args, "--stall-timeout-s", str(STALL_S), log_path=log, env=env)
    yield proc
    proc.stop()


async def stream(stub, request, first: asyncio.Event | None = None) -> list[int]:
    """The stream's tokens; RESOURCE_EXHAUSTED (the other stream's blocks counted) is retried as its hint says."""
    while True:
        tokens: list[int] = []
        try:
            async for msg in stub.Generate(request, timeout=120):
                tokens += msg.token_ids
                if first is not None:
                    first.set()
            return tokens
        except grpc.aio.AioRpcError as e:
            if e.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED or tokens:
                raise
            await asyncio.sleep(0.1)


def test_a_preempted_stream_waits_on_its_worker_past_the_stall_bound_and_is_never_moved(cluster):
    # The long prompt holds 13 blocks from the start; the two streams outgrow 26 blocks after ~100 steps each, when
    # the newer (short) one is preempted and waits ~100 steps for the long one to finish and free its 25.
    long_prompt, short_prompt = [3 + i % 250 for i in range(200)], [7, 8, 9, 10] * 4
    long_req, short_req = greedy_request("slow-long", long_prompt, 200), greedy_request("slow-short", short_prompt, 120)

    async def both() -> tuple[list[int], list[int]]:
        async with channel(cluster.address) as ch:
            stub, started = generate_pb2_grpc.GenerationStub(ch), asyncio.Event()
            long_task = asyncio.create_task(stream(stub, long_req, started))
            await started.wait()  # the short one is the newer: the one preempted
            return await asyncio.gather(long_task, stream(stub, short_req))

    begun = time.monotonic()
    long_tokens, short_tokens = asyncio.run(both())
    took = time.monotonic() - begun
    assert long_tokens == greedy(long_prompt, 200)
    assert short_tokens == greedy(short_prompt, 120)
    workers = status_json(cluster.address)["workers"]
    decode = next(w for w in workers if w["role"] == "decode")
    preempted = total(scrape(f"http://{decode['metrics_address']}/metrics"), "pdserve_preemptions_total")
    assert preempted >= 1, f"no preemption in {took:.1f} s: the test did not reach what it tests"
    log = cluster.log()
    moved = re.findall(r".*(?:out of placement|migrated after|placed again).*", log)
    assert not moved, moved  # before: "sent nothing for 2 s mid-stream (the router's stall bound)", then a move
    end = time.monotonic() + 15
    while (used := [w["kv_blocks_used"] for w in workers]) != [0, 0] and time.monotonic() < end:
        time.sleep(0.2)
        workers = status_json(cluster.address)["workers"]
    assert used == [0, 0], workers
