"""The only decode worker of a real `pdserve up` (1 prefill + 1 decode, tiny-random) SIGKILLed mid-stream: the
stream waits for Ray's restart of that worker (the router's `no_workers_wait_s`, raised here past the restart's
time) and goes on there, the client's answer the unfailed one. Before, the router moved the stream three times
within milliseconds, each time to the dead worker's refusing port, and the stream was lost (a user's review).
The only prefill worker SIGKILLed before the first token (holding the prompt's KV): the retry waits for its
restart too, as a request arriving then would; it failed at once (a fault review)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from pdserve.cluster.local_process import ClusterProcess
from pdserve.rpc.client import generate
from pdserve.v1 import generate_pb2 as pb
from tests.integration.reference import PROMPT, greedy
from tests.integration.worker_view import pid_serving, workers

pytestmark = pytest.mark.timeout(300)
WAIT_S = 90.0  # no_workers_wait_s: past a decode worker's restart on a loaded 2-core machine
LONG = 1500  # output tokens: seconds of decoding on tiny-random, time to kill the decode worker mid-stream
HELD = "held-"  # requests whose prefill worker holds their KV this long after their first token, before sending it
HOLD_S = 5.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lone-decode")
    config = folder / "router.toml"
    config.write_text(f"[router]\nno_workers_wait_s = {WAIT_S}\n")
    args = ["--model", "tiny-random", "--kv-cache-gb", "0.05", "--prefill", "1", "--decode", "1"]
    faults = {"PDSERVE_FAULT_KV_SEND_DELAY_S": str(HOLD_S), "PDSERVE_FAULT_REQUEST_ID_PREFIX": HELD}
    proc = ClusterProcess(*args, "--router-config", str(config), log_path=folder / "cluster.log", env=faults)
    yield proc
    proc.stop()


def test_the_only_decode_worker_killed_mid_stream_its_restart_finishes_the_stream(cluster):
    async def run() -> None:
        (victim,) = [w for w in await workers(cluster.address) if w.role == "decode"]
        req = pb.GenerateRequest(
            request_id="moved", prompt_token_ids=PROMPT, sampling=pb.SamplingParams(max_tokens=LONG, ignore_eos=True)
        )
        got, killed_at, killed = None, 0, 0.0
        async for _, got in generate(cluster.address, req, 240.0):
            if not killed_at and got.token_ids:
                killed_at, killed = len(got.token_ids), time.monotonic()
                os.kill(pid_serving(victim.address), signal.SIGKILL)
        assert got is not None and 0 < killed_at < LONG
        waited = time.monotonic() - killed
        assert got.token_ids == greedy(PROMPT, LONG) and got.finish_reason == "length"
        (back,) = [w for w in await workers(cluster.address) if w.role == "decode"]
        assert back.id == victim.id and back.address != victim.address  # Ray's restart: a new process
        log = cluster.log()
        assert log.count("request migrated after") == 1, log[-4000:]  # one move, to the restart
        print(f"killed after {killed_at} tokens; the stream ended {waited:.1f} s later on the restarted worker")

    asyncio.run(run())


def test_the_only_prefill_worker_killed_before_the_first_token_its_restart_serves_the_retry(cluster):
    async def run() -> None:
        (victim,) = [w for w in await workers(cluster.address) if w.role == "prefill"]
        req = pb.GenerateRequest(
            request_id=f"{HELD}retried", prompt_token_ids=PROMPT, sampling=pb.SamplingParams(max_tokens=16)
        )
        asyncio.get_running_loop().call_later(1.5, os.kill, pid_serving(victim.address), signal.SIGKILL)
        started, got = time.monotonic(), None
        async for _, got in generate(cluster.address, req, 240.0):  # noqa: B007 (the last is the answer)
            pass
        assert got is not None and got.token_ids == greedy(PROMPT, 16) and got.finish_reason == "length"
        (back,) = [w for w in await workers(cluster.address) if w.role == "prefill"]
        assert back.id == victim.id and back.address != victim.address  # Ray's restart: a new process
        log = cluster.log()
        assert log.count(f"request placed again after worker {victim.id} failed it") == 1, log[-4000:]
        print(f"the retry was served {time.monotonic() - started:.1f} s after the request, on the restarted worker")

    asyncio.run(run())
