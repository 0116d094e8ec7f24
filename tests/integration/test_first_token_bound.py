"""A stuck prefill worker and a client with no deadline: the router's first-token bound fails the request
with UNAVAILABLE, and once the worker runs again every KV block is free on both sides. A stuck decode worker
is the one the bound blames (ejected, not the healthy prefill worker; its retry waits for the stopped worker to be
heard from, then finds it out of placement)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import psutil
import pytest

from pdserve.cluster.local_process import ClusterProcess, descendants
from pdserve.rpc.server import channel
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc
from tests.integration.cluster_view import status_json

pytestmark = pytest.mark.timeout(300)
BOUND_S = 3.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    log = tmp_path_factory.mktemp("first_token") / "cluster.log"
    # One worker of each role: the router's retry has no other prefill worker to go to, so the bound's failure
    # reaches the client (with two, the request would be placed again and succeed: tests/integration/test_retry.py).
    args = ["--model", "tiny-random", "--prefill", "1", "--decode", "1", "--kv-cache-gb", "0.05"]
    proc = ClusterProcess(*args, "--first-token-timeout-s", str(BOUND_S), log_path=log)
    yield proc
    proc.stop()


def listening_pid(root: int, port: int) -> int:
    """The process under `root` (the launcher) that serves `port`: a worker actor."""
    for pid in descendants(root):
        try:
            conns = psutil.Process(pid).net_connections(kind="tcp")
        except psutil.Error:
            continue
        if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in conns):
            return pid
    raise AssertionError(f"no process under {root} listens on {port}")


async def first_token(address: str, request: pb.GenerateRequest) -> list[int]:
    async with channel(address) as ch:
        return [t async for msg in generate_pb2_grpc.GenerationStub(ch).Generate(request) for t in msg.token_ids]


def test_stuck_prefill_worker_fails_the_request_within_the_bound_and_frees_every_block(cluster):
    request = pb.GenerateRequest(prompt_token_ids=[7, 8, 9] * 30, sampling=pb.SamplingParams(max_tokens=8))
    assert len(asyncio.run(first_token(cluster.address, request))) == 8  # warm: channels and rendezvous made
    prefill = next(w for w in status_json(cluster.address)["workers"] if w["role"] == "prefill")
    pid = listening_pid(cluster.proc.pid, int(prefill["address"].rsplit(":", 1)[1]))
    os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            asyncio.run(first_token(cluster.address, request))  # no client deadline
        took = time.monotonic() - start
    finally:
        os.kill(pid, signal.SIGCONT)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
    details = err.value.details()
    assert "first token" in details and f"{BOUND_S:g} s" in details
    assert prefill["id"] in details and "decode-" in details  # names the workers
    assert BOUND_S - 0.5 <= took <= BOUND_S + 5, took
    time.sleep(1.5)  # a heartbeat from the resumed worker: its state is no longer the one before the stop
    end, zero_in_a_row = time.monotonic() + 20, 0
    while zero_in_a_row < 2 and time.monotonic() < end:
        used = {w["id"]: w["kv_blocks_used"] for w in status_json(cluster.address)["workers"]}
        zero_in_a_row = zero_in_a_row + 1 if not any(used.values()) else 0
        time.sleep(1.0)
    assert zero_in_a_row == 2, used
    assert len(asyncio.run(first_token(cluster.address, request))) == 8  # and it serves again


def test_a_stuck_decode_worker_is_the_one_blamed(cluster):
    request = pb.GenerateRequest(prompt_token_ids=[5, 6] * 20, sampling=pb.SamplingParams(max_tokens=8))
    workers = {w["role"]: w for w in status_json(cluster.address)["workers"]}
    pid = listening_pid(cluster.proc.pid, int(workers["decode"]["address"].rsplit(":", 1)[1]))
    seen = len(cluster.log())
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            asyncio.run(first_token(cluster.address, request))
    finally:
        os.kill(pid, signal.SIGCONT)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
    log = cluster.log()[seen:]  # the client gets the last attempt's status; the router logs each one's blame
    assert "never handed the prompt to prefill worker" in log
    decode, prefill = workers["decode"], workers["prefill"]
    assert f"worker {decode['id']} at {decode['address']} out of placement" in log  # blamed: ejected
    assert f"worker {prefill['id']} at {prefill['address']} out of placement" not in log
    assert f"after worker {prefill['id']} failed it" not in log
    assert len(asyncio.run(first_token(cluster.address, request))) == 8
