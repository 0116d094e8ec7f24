"""A decode worker out of KV blocks preempts a stream, which waits to be recomputed: through a real `pdserve up`
(1 + 1, tiny-random, 26 KV blocks a worker, its registry in a real Redis), the stream waits out its turn on its
worker, longer than the router's stall bound, and ends with the single-process engine's tokens, never taken for a hung
worker's and moved. Streamed over the HTTP API, it sends SSE comments while it waits. The worker publishes the blocks
it is owed apart from its free ones, so a hand-off meanwhile is shed by the router, not placed there and refused. A
request for the whole pool is admitted as soon as the stream that held it ends, before the worker's next report."""

from __future__ import annotations

import asyncio
import json
import re
import time

import grpc
import httpx2
import pytest

from pdserve.cluster.local_process import ClusterProcess, free_port
from pdserve.registry.base import WorkerState
from pdserve.registry.redis import worker_key
from pdserve.rpc.server import channel
from pdserve.v1 import admin_pb2 as apb
from pdserve.v1 import admin_pb2_grpc, generate_pb2_grpc
from tests.integration.cluster_view import scrape, status_json, total
from tests.integration.reference import greedy, greedy_completion, greedy_request
from tests.redis_server import RedisServer, started

pytestmark = pytest.mark.timeout(300)
STALL_S = 2.0
STEP_S = 0.05  # each decode step running a "slow-" request: the preempted stream waits 100 of them, 5 s
BLOCKS = 26
KEEPALIVE_S = 0.5
LONG_PROMPT, SHORT_PROMPT = [3 + i % 250 for i in range(200)], [7, 8, 9, 10] * 4


redis_server = pytest.fixture(scope="module")(started)


@pytest.fixture(scope="module")
def cluster(redis_server, tmp_path_factory):
    folder = tmp_path_factory.mktemp("preemption")
    (folder / "router.toml").write_text(f"[router]\nsse_keepalive_s = {KEEPALIVE_S}\n")
    args = ["--model", "tiny-random", "--prefill", "1", "--decode", "1", "--kv-cache-gb", str(BLOCKS * 8192 / 2**30)]
    args += ["--router-config", str(folder / "router.toml"), "--http-port", str(http_port := free_port())]
    args += ["--redis", redis_server.url, "--metrics-port", str(metrics_port := free_port())]
    env = {"PDSERVE_FAULT_SLOW_STEP_S": str(STEP_S), "PDSERVE_FAULT_SLOW_STEP_REQUEST_ID_PREFIX": "slow-"}
    proc = ClusterProcess(*args, "--stall-timeout-s", str(STALL_S), log_path=folder / "cluster.log", env=env)
    proc.base_url = f"http://127.0.0.1:{http_port}/v1"
    proc.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    yield proc
    proc.stop()


async def stream(stub, request, first: asyncio.Event | None = None, arrivals: list[float] | None = None) -> list[int]:
    """The stream's tokens, and (`arrivals`) when each message of them came; RESOURCE_EXHAUSTED (the other stream's
    blocks counted) is retried as its hint says."""
    while True:
        tokens: list[int] = []
        try:
            async for msg in stub.Generate(request, timeout=120):
                tokens += msg.token_ids
                if arrivals is not None and msg.token_ids:
                    arrivals.append(time.monotonic())
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
    long_prompt, short_prompt = LONG_PROMPT, SHORT_PROMPT
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
    assert_blocks_freed(cluster)


def test_a_hand_off_while_a_preempted_stream_is_owed_its_blocks_is_shed_and_takes_none_of_them(cluster, redis_server):
    """While the short stream waits to be recomputed, its decode worker publishes the blocks it will need (and the
    long stream's next) as owed, not free: none free. A new hand-off then is shed by the router for KV
    (`RESOURCE_EXHAUSTED`, retried), never placed there to be refused by the worker, and is placed once the long
    stream ended; every stream ends with the greedy reference's tokens, every block free again. The short stream's
    wait is timed in pdserve_preemption_wait_seconds, once a preemption."""
    decode = next(w for w in status_json(cluster.address)["workers"] if w["role"] == "decode")
    worker_metrics = f"http://{decode['metrics_address']}/metrics"
    before, router_before = scrape(worker_metrics), scrape(cluster.metrics_url)
    long_req = greedy_request("slow-long-3", LONG_PROMPT, 200)
    short_req = greedy_request("slow-short-3", SHORT_PROMPT, 120)
    new_prompt = [11, 12, 13, 14] * 4
    new_req = greedy_request("slow-new-3", new_prompt, 8)

    async def all_three() -> tuple[WorkerState, apb.WorkerStatus, list[float], list[float], list[list[int]]]:
        async with channel(cluster.address) as ch:
            stub, started, long_arrivals, new_arrivals = generate_pb2_grpc.GenerationStub(ch), asyncio.Event(), [], []
            long_task = asyncio.create_task(stream(stub, long_req, started, long_arrivals))
            await started.wait()
            short_task = asyncio.create_task(stream(stub, short_req))
            owing = await published_while(redis_server, decode["id"], lambda s: s.waiting > 0)
            new_task = asyncio.create_task(stream(stub, new_req, None, new_arrivals))
            row = await router_row_while(ch, decode["id"], lambda w: w.waiting > 0)
            tokens = [await long_task, await short_task, await new_task]
            return owing, row, long_arrivals, new_arrivals, tokens

    owing, row, long_arrivals, new_arrivals, tokens = asyncio.run(all_three())
    assert owing.kv_blocks_free == 0 and owing.kv_blocks_owed > 0, owing  # its recompute needs more than are free
    assert row.kv_blocks_used < BLOCKS, row  # `pdserve status`: the owed blocks are not in use
    assert tokens == [greedy(LONG_PROMPT, 200), greedy(SHORT_PROMPT, 120), greedy(new_prompt, 8)]
    assert new_arrivals[0] > long_arrivals[-1]  # taken once the long stream's blocks were back, not from the owed
    after, router_after = scrape(worker_metrics), scrape(cluster.metrics_url)
    rejected = {
        reason: total(router_after, "pdserve_requests_rejected_total", reason=reason)
        - total(router_before, "pdserve_requests_rejected_total", reason=reason)
        for reason in ("kv", "worker")
    }
    assert rejected["kv"] >= 1 and rejected["worker"] == 0, rejected
    preempted, waits, waited_s = (
        total(after, name) - total(before, name)
        for name in (
            "pdserve_preemptions_total",
            "pdserve_preemption_wait_seconds_count",
            "pdserve_preemption_wait_seconds_sum",
        )
    )
    assert waits == preempted >= 1 and waited_s > 2 * STALL_S, (preempted, waits, waited_s)  # ~100 slow steps
    assert_blocks_freed(cluster)
    idle = published(redis_server, decode["id"])
    assert (idle.kv_blocks_free, idle.kv_blocks_owed) == (idle.kv_blocks_total, 0), idle


def test_a_request_for_the_whole_pool_is_admitted_as_soon_as_the_stream_holding_it_ended(cluster):
    """A 384-token prompt (24 blocks) for 33 slow tokens held 26 blocks (25 filled, and the one kept for its next) when
    its worker last reported; a request needing all 26 sent as it ended is admitted at once. The router counted back
    only its prompt's 24: 'no decode worker has 26 free KV blocks now' until the worker's next report."""
    holder = greedy_request("slow-holder", [3 + i % 250 for i in range(384)], 33)
    whole = greedy_request("whole", SHORT_PROMPT, 401)  # 16 + 401 - 1 tokens: 26 blocks

    async def one_after_the_other() -> list[int]:
        async with channel(cluster.address) as ch:
            stub = generate_pb2_grpc.GenerationStub(ch)
            assert len([t async for msg in stub.Generate(holder, timeout=60) for t in msg.token_ids]) == 33
            async for msg in stub.Generate(whole, timeout=60):  # RESOURCE_EXHAUSTED before
                return list(msg.token_ids)  # admitted: the rest is cancelled with the call
        return []

    assert asyncio.run(one_after_the_other())
    assert_blocks_freed(cluster)


def published(redis_server: RedisServer, worker_id: str) -> WorkerState:
    """The worker's state as it last published it to the routers' registry."""
    with redis_server.client() as client:
        return WorkerState.from_json(client.get(worker_key(worker_id)))


async def published_while(redis_server: RedisServer, worker_id: str, cond) -> WorkerState:
    """The first state the worker publishes that meets `cond` (it beats every 0.5 s)."""
    end = time.monotonic() + 60
    while not cond(state := await asyncio.to_thread(published, redis_server, worker_id)):
        assert time.monotonic() < end, state
        await asyncio.sleep(0.05)
    return state


async def router_row_while(ch: grpc.aio.Channel, worker_id: str, cond) -> apb.WorkerStatus:
    """The worker's row in the router's ClusterStatus (what `pdserve status` shows) once it meets `cond`."""
    end = time.monotonic() + 60
    while True:
        reply = await admin_pb2_grpc.AdminStub(ch).ClusterStatus(apb.ClusterStatusRequest(), timeout=10)
        [row] = [w for w in reply.workers if w.id == worker_id]
        if cond(row):
            return row
        assert time.monotonic() < end, row
        await asyncio.sleep(0.05)


def assert_blocks_freed(cluster: ClusterProcess) -> None:
    end = time.monotonic() + 15
    while (used := [w["kv_blocks_used"] for w in status_json(cluster.address)["workers"]]) != [0, 0]:
        assert time.monotonic() < end, used
        time.sleep(0.2)


async def sse_lines(base_url: str, request_id: str, prompt: list[int], max_tokens: int) -> list[tuple[float, str]]:
    """Each line of a streamed completion with when it came; a 429 (the other stream's blocks counted) is retried."""
    body = {"model": "tiny-random", "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    async with httpx2.AsyncClient(base_url=base_url, timeout=120) as http:
        while True:
            headers = {"x-request-id": request_id}
            async with http.stream("POST", "/completions", json=body | {"temperature": 0}, headers=headers) as r:
                if r.status_code == 429:
                    await asyncio.sleep(0.1)
                    continue
                assert r.status_code == 200, await r.aread()
                return [(time.monotonic(), line) async for line in r.aiter_lines() if line]


def test_a_preempted_sse_stream_sends_comments_while_it_waits(cluster):
    """The wait is silent but for the router's comments, every `sse_keepalive_s`: a proxy's idle timer in front of the
    router (60 s by default in nginx and an AWS ALB) would otherwise cut a stream waiting that long."""

    async def both() -> list[tuple[float, str]]:
        async with channel(cluster.address) as ch:
            stub, started = generate_pb2_grpc.GenerationStub(ch), asyncio.Event()
            long_req = greedy_request("slow-long-2", LONG_PROMPT, 200)
            long_task = asyncio.create_task(stream(stub, long_req, started))
            await started.wait()
            lines = await sse_lines(cluster.base_url, "slow-short-2", SHORT_PROMPT, 120)
            assert await long_task == greedy(LONG_PROMPT, 200)
            return lines

    lines = asyncio.run(both())
    events = [(t, json.loads(line.removeprefix("data: "))) for t, line in lines[:-1] if line.startswith("data: ")]
    assert lines[-1][1] == "data: [DONE]"
    assert "".join(e["choices"][0]["text"] for _, e in events) == greedy_completion(SHORT_PROMPT, 120).text
    token_times = [t for t, e in events if e["choices"][0]["text"]]
    gap, since = max((b - a, a) for a, b in zip(token_times, token_times[1:], strict=False))
    assert gap > 2 * STALL_S, f"the longest wait between tokens was {gap:.1f} s: the stream was not preempted"
    comments = [t for t, line in lines if line.startswith(":") and since < t < since + gap]
    assert len(comments) >= gap / KEEPALIVE_S / 2, (gap, comments)  # one each 0.5 s; half allows a busy host
    assert_blocks_freed(cluster)
