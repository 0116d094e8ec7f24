"""A `pdserve router` whose Redis does not answer at its start waits for it unready, rather than pass its health
check and fail every request with "no workers" (an HA review); a signal while it waits ends it at once."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.cluster.local_process import PdserveProcess
from tests.redis_server import RedisServer, free_port

pytestmark = pytest.mark.timeout(180)
WAITING = "does not answer: waiting for it before serving"


def router(redis: RedisServer, port: int, log_path: Path) -> PdserveProcess:
    return PdserveProcess(
        "router", "--model", "tiny-random", "--redis", redis.url, "--port", str(port), log_path=log_path
    )


def wait_for_line(process: PdserveProcess, line: str, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while line not in process.log():
        assert process.proc.poll() is None and time.monotonic() < deadline, process.log()[-3000:]
        time.sleep(0.2)


def healthy(port: int) -> bool:
    probe = [sys.executable, "-m", "pdserve.rpc.health_probe", "--addr", f"127.0.0.1:{port}", "--timeout", "1"]
    return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0


def test_a_router_started_before_its_redis_is_unready_until_redis_answers(tmp_path: Path) -> None:
    redis, port = RedisServer(), free_port()
    process = router(redis, port, tmp_path / "router.log")
    try:
        wait_for_line(process, WAITING)
        time.sleep(1.0)  # several more reads of the registry, none answered
        assert "ready" not in process.log().replace(WAITING, "") and not healthy(port)
        redis.start()
        process.wait_ready(timeout_s=60)
        assert healthy(port)
        assert "registry redis answers: 0 workers listed" in process.log()
    finally:
        process.stop()
        redis.stop()


def test_a_signal_while_it_waits_for_redis_ends_it_at_once(tmp_path: Path) -> None:
    process = router(RedisServer(), free_port(), tmp_path / "router.log")
    try:
        wait_for_line(process, WAITING)
        process.proc.send_signal(signal.SIGTERM)
        assert process.proc.wait(timeout=10) == 0, process.log()[-3000:]
    finally:
        process.stop(signal.SIGKILL)
