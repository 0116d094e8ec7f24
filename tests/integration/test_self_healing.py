"""Self-healing workers through a real `pdserve up` (two colocated workers, two Ray restarts each):
- each worker's first start fails (injected), is logged with its reason, and Ray's restart starts it;
- a worker whose engine thread dies fails what it held with UNAVAILABLE, leaves placement and is restarted by Ray;
- a SIGKILLed worker leaves placement within 2 s;
- a worker killed past its restarts is replaced by a new actor while the other one serves, and the launcher says
  so in its log and in a metric.

The tests run in file order on one cluster: the failed starts use one restart of each worker; then the engine's
death uses colocated-0's second, and the next two tests colocated-1's.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
import urllib.request

import grpc
import pytest

from pdserve.cluster.local_process import ClusterProcess, free_port
from pdserve.rpc.client import generate
from pdserve.rpc.server import channel
from pdserve.security.cluster_secret import CLUSTER_AUTH_KEY, ClusterSecret
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc
from tests.integration.worker_view import pid_serving, workers

pytestmark = pytest.mark.timeout(300)
DIE = "die-"  # a request whose client id starts with this kills the engine thread that steps it
PROMPT = [5, 6, 7, 8, 9] * 7
LEAVE_PLACEMENT_S = 2.0
SECRET = ClusterSecret(os.urandom(16).hex().encode())
PEER = ((CLUSTER_AUTH_KEY, SECRET.rpc_token),)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    log = tmp_path_factory.mktemp("self-healing") / "cluster.log"
    metrics_port = free_port()
    args = ["--model", "tiny-random", "--kv-cache-gb", "0.05", "--mode", "colocated", "--workers", "2"]
    args += ["--max-restarts", "2", "--metrics-port", str(metrics_port)]
    faults = {
        "PDSERVE_FAULT_ENGINE_DIE_REQUEST_ID_PREFIX": DIE,
        "PDSERVE_FAULT_FIRST_START_FAILS_DIR": str(tmp_path_factory.mktemp("started")),
    }
    proc = ClusterProcess(*args, log_path=log, env={**faults, "PDSERVE_CLUSTER_SECRET": SECRET.secret.decode()})
    proc.metrics_address = f"127.0.0.1:{metrics_port}"  # type: ignore[attr-defined]
    yield proc
    proc.stop()


async def placed(router: str) -> dict[str, str]:
    """worker id -> address, for every worker the router places requests on now."""
    return {w.id: w.address for w in await workers(router)}


async def until_back(router: str, worker_id: str, old_address: str, timeout_s: float = 120.0) -> str:
    """The worker is in placement again, at a new address (a new process), and SERVING; its address."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for w in await workers(router):
            if w.id == worker_id and w.address != old_address and w.health == "SERVING":
                return w.address
        await asyncio.sleep(0.5)
    raise AssertionError(f"{worker_id} did not come back within {timeout_s}s: {await placed(router)}")


async def until_gone(router: str, worker_id: str, timeout_s: float) -> float:
    """Seconds until the router lists `worker_id` no more; fails past `timeout_s`."""
    start = time.monotonic()
    while worker_id in await placed(router):
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{worker_id} still in placement after {timeout_s}s")
        await asyncio.sleep(0.05)
    return time.monotonic() - start


async def direct(address: str, client_id: str, max_tokens: int) -> list[int]:
    """A Generate call straight to a worker (no router, so no retry can hide what the worker answered), as a
    cluster peer (the cluster's RPC token)."""
    req = wpb.WorkerGenerateRequest(
        request_id=f"key-{client_id}",
        client_request_id=client_id,
        prompt_token_ids=PROMPT,
        sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )
    out: list[int] = []
    async with channel(address) as ch:
        async for msg in worker_pb2_grpc.DecodeWorkerStub(ch).Generate(req, timeout=60, metadata=PEER):
            out.extend(msg.token_ids)
    return out


async def through_router(router: str, request_id: str) -> list[int]:
    req = pb.GenerateRequest(
        request_id=request_id, prompt_token_ids=PROMPT, sampling=pb.SamplingParams(max_tokens=8, ignore_eos=True)
    )
    result = None
    async for _, result in generate(router, req, 60.0):  # noqa: B007 (the last one is the answer)
        pass
    assert result is not None and result.finish_reason == "length"
    return list(result.token_ids)


def test_a_failed_start_is_logged_with_its_reason_and_ray_retries_it(cluster):
    """The launcher waits on colocated-0 first, so it sees that start fail and logs the reason; the worker exits,
    and Ray's restart starts it: `pdserve up` became ready with both workers. (Each worker logs its own failure
    too, but Ray forwards a dead process's lines late.)"""
    reason = "fault injected: the first start of colocated-0 fails"
    assert f"worker colocated-0 failed to start (attempt 1): {reason}" in cluster.log()
    assert set(asyncio.run(placed(cluster.address))) == {"colocated-0", "colocated-1"}


def test_a_dead_engine_thread_fails_its_requests_unavailable_and_ray_restarts_the_worker(cluster):
    async def run() -> None:
        address = (await placed(cluster.address))["colocated-0"]
        pid = pid_serving(address)
        bystander = asyncio.create_task(direct(address, "bystander", max_tokens=3000))
        await asyncio.sleep(0.5)  # streaming: the engine thread runs it when the doomed request comes
        assert not bystander.done()
        for call in (direct(address, f"{DIE}0", max_tokens=8), bystander):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(call, timeout=30)  # failed, not hung
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value

        await until_gone(cluster.address, "colocated-0", timeout_s=LEAVE_PLACEMENT_S + 3)
        new_address = await until_back(cluster.address, "colocated-0", address)
        assert pid_serving(new_address) != pid  # a new process: Ray restarted the actor
        assert len(await direct(new_address, "after-restart", max_tokens=8)) == 8
        assert "exits for Ray to restart it: engine thread died" in cluster.log()

    asyncio.run(run())


def test_a_sigkilled_worker_leaves_placement_within_2s(cluster):
    async def run() -> None:
        address = (await placed(cluster.address))["colocated-1"]
        os.kill(pid_serving(address), signal.SIGKILL)
        gone_after = await until_gone(cluster.address, "colocated-1", timeout_s=LEAVE_PLACEMENT_S + 5)
        print(f"colocated-1 left placement {gone_after:.2f}s after SIGKILL")
        assert gone_after < LEAVE_PLACEMENT_S, gone_after
        await until_back(cluster.address, "colocated-1", address)  # its one restart

    asyncio.run(run())


def test_a_worker_killed_past_its_restarts_is_replaced_while_the_other_serves(cluster):
    async def run() -> None:
        address = (await placed(cluster.address))["colocated-1"]
        os.kill(pid_serving(address), signal.SIGKILL)  # its restart is used up: Ray gives up on it
        await until_gone(cluster.address, "colocated-1", timeout_s=LEAVE_PLACEMENT_S + 3)
        # The other worker serves meanwhile, and supervision goes on: colocated-0 stays in placement.
        for i in range(3):
            assert len(await through_router(cluster.address, f"meanwhile-{i}")) == 8
        new_address = await until_back(cluster.address, "colocated-1", address)
        assert "colocated-0" in await placed(cluster.address)
        assert len(await direct(new_address, "replaced", max_tokens=8)) == 8
        assert re.search(r"worker colocated-1 is dead for good .* replacing it with a new actor", cluster.log())
        metrics = urllib.request.urlopen(f"http://{cluster.metrics_address}/metrics", timeout=5).read().decode()
        assert re.search(r'pdserve_worker_replacements_total\{[^}]*role="colocated"[^}]*\} 1\.0', metrics), metrics

    asyncio.run(run())
