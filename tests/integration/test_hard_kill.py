"""`pdserve up` SIGKILLed, as an operator on a shared host or a CI job's timeout meets it: nothing it started
outlives it (its Ray's GCS, raylet, agents and idle workers, its worker actors, the reaper that cleans up after it),
tracked by the pids it had and by its session, and a `pdserve up` started again at once on the same port and Redis
serves from new workers only. Before the reaper, Ray's dashboard and runtime env agents outlived a SIGKILLed
launcher by 61-70 s (one holding a port), its workers by about 2 s."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from pathlib import Path

import pytest

from pdserve.cluster.local_process import ClusterProcess, alive, descendants
from pdserve.rpc.client import generate
from tests.integration.reference import request
from tests.integration.worker_view import pid_serving, workers
from tests.redis_server import RedisServer

pytestmark = pytest.mark.timeout(600)
ARGS = ("--model", "tiny-random", "--kv-cache-gb", "0.05", "--threads", "1", "--prefill", "1", "--decode", "1")
GONE_WITHIN_S = 20.0  # measured 0.6 s on a loaded 2-core VM; Ray's agents alone lived 60 s past the launcher
RAY_PROCESSES = {"gcs_server", "raylet", "ray::DashboardAgent", "ray::RuntimeEnvAgent", "ray::WorkerRuntime"}


def name(pid: int) -> str:
    try:
        return Path(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()).name
    except OSError:
        return "gone"


def in_session(session: int) -> set[int]:
    """The live processes of `session` (the launcher's own: it leads one), whichever parent they have now."""
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(") ", 1)[1].split() if entry.name.isdigit() else []
        except OSError:
            continue
        if fields and int(fields[3]) == session and alive(int(entry.name)):
            found.add(int(entry.name))
    return found


def serve(address: str) -> list[int]:
    async def run() -> list[int]:
        result = None
        async for _, result in generate(address, request("after-a-hard-kill"), 60.0):  # noqa: B007
            pass
        assert result is not None
        return list(result.token_ids)

    return asyncio.run(run())


def test_a_sigkilled_pdserve_up_leaves_nothing_running_and_a_new_one_serves_on_its_port(tmp_path, expected):
    redis = RedisServer()
    redis.start()
    first = second = None
    left: set[int] = set()
    try:
        first = ClusterProcess(*ARGS, "--redis", redis.url, log_path=tmp_path / "first.log")
        started = descendants(first.proc.pid)
        names = {name(pid) for pid in started}
        assert names >= RAY_PROCESSES, names
        assert serve(first.address) == expected
        client = socket.create_connection(("127.0.0.1", first.port))  # open at the kill: its port's TIME_WAIT
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait()
        killed = time.monotonic()
        deadline = killed + GONE_WITHIN_S
        while (left := {p for p in started if alive(p)} | in_session(first.proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        gone_s = time.monotonic() - killed
        assert not left, f"alive {GONE_WITHIN_S:g} s after the launcher's SIGKILL: {sorted(map(name, left))}"
        client.close()
        print(f"every process of the SIGKILLed launcher gone {gone_s:.1f} s after it")

        second = ClusterProcess(*ARGS, "--redis", redis.url, port=first.port, log_path=tmp_path / "second.log")
        assert serve(second.address) == expected
        listed = asyncio.run(workers(second.address))
        assert sorted(w.id for w in listed) == ["decode-1", "prefill-0"]
        assert {pid_serving(w.address) for w in listed} <= descendants(second.proc.pid)  # none of the first's
    finally:
        for pid in left:  # what the first launcher left, should the assertion have failed: its own processes
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        for process in (second, first):
            if process:
                process.stop()
        redis.stop()
