"""A small chaos run through a real `pdserve up` (2 prefill + 2 decode, tiny-random): steady greedy load while
two workers are SIGKILLed and a busy decode worker is SIGSTOPped past the router's stall bound, one at a time.
Nothing is lost: no request fails or goes unanswered, every output equals the fault-free reference computed on
the same cluster first, and no KV block stays held once the cluster is idle."""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
import pytest

from pdserve.chaos.command import cluster_args
from pdserve.chaos.load import REQUEST_ID_PREFIX
from pdserve.chaos.report import clean
from pdserve.chaos.run import ChaosConfig, run_chaos
from pdserve.cluster.local_process import ClusterProcess
from pdserve.engine.model_files import read_model_config
from pdserve.engine.models import resolve_model
from pdserve.rpc.server import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS
from pdserve.v1 import generate_pb2_grpc
from tests.integration.reference import PROMPT, greedy, greedy_request

pytestmark = pytest.mark.timeout(300)
STALL_S = 3.0  # short, to keep the stop short; a CPU-starved gap past it only migrates a stream
# Each decode step of the load takes 10 ms more (a slow device): a stream lasts 2 s or more, so the decode worker
# the run stops holds streams then. Unslowed, 200 tokens took well under a second and CI once stopped an idle one.
SLOW_DECODE = {"PDSERVE_FAULT_SLOW_STEP_REQUEST_ID_PREFIX": REQUEST_ID_PREFIX, "PDSERVE_FAULT_SLOW_STEP_S": "0.01"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The cluster `pdserve chaos` starts, with a shorter stall bound so the stop stays short, and a first-token
    bound no CPU-starved prefill on a busy test machine meets (the stop is of a decode worker: the stall bound's)."""
    args = cluster_args(stall_timeout_s=STALL_S, first_token_timeout_s=30.0)
    proc = ClusterProcess(*args, log_path=tmp_path_factory.mktemp("chaos") / "cluster.log", env=SLOW_DECODE)
    yield proc
    proc.stop()


def test_a_small_chaos_run_loses_nothing(cluster):
    config = ChaosConfig(kills=2, stops=1, stop_s=STALL_S + 3, interval_s=1.0, rate=4.0, output_len=200)
    vocab_size = read_model_config(resolve_model("tiny-random")).vocab_size
    report = asyncio.run(run_chaos(config, cluster.address, vocab_size))
    summary = {k: v for k, v in report.items() if k != "faults"}
    assert report["requests"] >= 20, summary
    assert (report["failed"], report["lost"], report["completed_wrong_output"]) == (0, 0, 0), summary
    assert report["completed_right_output"] == report["requests"], summary
    assert report["kv_blocks_held_after_idle"] == 0, summary
    assert report["router_in_flight_after_idle"] == 0, summary
    assert [f["kind"] for f in report["faults"]] == ["kill", "stop", "kill"], report["faults"]
    assert report["not_recovered"] == 0, report["faults"]
    assert clean(report)
    assert "sent nothing for" in cluster.log(), "the stopped decode worker's streams did not meet the stall bound"


def test_a_router_stopped_past_its_workers_pings_ejects_none_of_them(cluster):
    """`pdserve up` (its router) SIGSTOPped while it relays two long streams, past the decode workers' keepalive
    pings, which drop their connections to it. Resumed, the router reads both calls failed: it moves the streams
    (each ends with the single-process engine's output), but takes neither decode worker out of placement for
    what was its own silence (before, both were ejected for 10 s and counted as flapping). The callers' channels
    send no pings of their own: they wait the stop out."""
    tokens = 1500  # at 10 ms a step more (SLOW_DECODE): still streaming once the workers' pings give up
    expected = greedy(PROMPT, tokens)

    async def stream(address: str, request_id: str, started: asyncio.Event) -> list[int]:
        got: list[int] = []
        async with grpc.aio.insecure_channel(address) as ch:
            request = greedy_request(f"{REQUEST_ID_PREFIX}{request_id}", PROMPT, tokens)
            async for msg in generate_pb2_grpc.GenerationStub(ch).Generate(request, timeout=120):
                got += msg.token_ids
                started.set()
        return got

    async def run() -> list[list[int]]:
        started = [asyncio.Event(), asyncio.Event()]
        streams = [asyncio.ensure_future(stream(cluster.address, f"held-router-{i}", s)) for i, s in enumerate(started)]
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 30)
        cluster.proc.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep((KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS) / 1e3 + 2)
        finally:
            os.kill(cluster.proc.pid, signal.SIGCONT)
        return await asyncio.gather(*streams)

    before = len(cluster.log())
    assert asyncio.run(run()) == [expected, expected]
    log = cluster.log()[before:]
    assert "the router was held" in log, log[-3000:]
    assert "request migrated" in log, "no call failed: the stop did not outlast the workers' pings"
    assert "out of placement" not in log, log[-3000:]
