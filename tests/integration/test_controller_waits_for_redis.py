"""A `pdserve controller` whose Redis does not answer at its start (its pod scheduled after the controller's) waits
for it before joining Ray, saying so in a log line that names the URL, and goes on once it answers; a signal while it
waits ends it at once; past its window it gives up with the last reason. It used to join Ray first and fail at the
workers' first write to Redis, exit status 1, each restart joining Ray again."""

from __future__ import annotations

import asyncio
import re
import signal
import time
from pathlib import Path

import pytest
import redis

from pdserve.cluster.local_process import PdserveProcess, free_port
from pdserve.registry.redis_reachable import wait_until_answers
from tests.redis_server import RedisServer

pytestmark = pytest.mark.timeout(180)
WAITING = "registry redis at {url} does not answer ("  # then why (connection refused), and that it waits for it
RAY_TRIED = "Ray at ray://127.0.0.1:{port}: nothing accepts connections"


def controller(redis_url: str, ray_port: int, log_path: Path) -> PdserveProcess:
    """A controller whose Ray address answers nothing either: past its Redis, it logs each try of Ray's."""
    ray = f"ray://127.0.0.1:{ray_port}"
    return PdserveProcess(
        "controller", "--model", "tiny-random", "--ray-address", ray, "--redis", redis_url, log_path=log_path
    )


def wait_for_line(process: PdserveProcess, line: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while line not in process.log():
        assert process.proc.poll() is None and time.monotonic() < deadline, process.log()[-3000:]
        time.sleep(0.2)


def test_a_controller_waits_for_a_redis_started_after_it_then_joins_ray(tmp_path: Path) -> None:
    redis_server, ray_port = RedisServer(), free_port()
    process = controller(redis_server.url, ray_port, tmp_path / "controller.log")
    try:
        wait_for_line(process, WAITING.format(url=redis_server.url))
        waiting = r"Connection refused\.\): waiting for it, up to (300|29\d) s more, before joining Ray"
        assert re.search(waiting, process.log())
        time.sleep(2.0)  # more PINGs, none answered: no try of Ray's yet
        assert "Ray at" not in process.log() and process.proc.poll() is None
        redis_server.start()
        wait_for_line(process, RAY_TRIED.format(port=ray_port))
        assert f"registry redis at {redis_server.url} answers after" in process.log()
        process.proc.send_signal(signal.SIGTERM)  # while it waits between Ray's tries
        assert process.proc.wait(timeout=30) == 0, process.log()[-3000:]
    finally:
        process.stop(signal.SIGKILL)
        redis_server.stop()


def test_a_signal_while_it_waits_for_redis_ends_it_at_once(tmp_path: Path) -> None:
    redis_server = RedisServer()
    process = controller(redis_server.url, free_port(), tmp_path / "controller.log")
    try:
        wait_for_line(process, WAITING.format(url=redis_server.url))
        process.proc.send_signal(signal.SIGTERM)
        assert process.proc.wait(timeout=10) == 0, process.log()[-3000:]
        assert "Ray at" not in process.log()
    finally:
        process.stop(signal.SIGKILL)


async def test_past_its_window_the_wait_raises_with_the_last_reason() -> None:
    """What ends a controller whose --redis names no Redis: the CLI says it, naming the flag, exit status 1."""
    port = free_port()
    start = time.monotonic()
    with pytest.raises(redis.ConnectionError, match=rf"no answer within 2 s of waiting \(.*{port}.*refused"):
        await wait_until_answers(f"redis://127.0.0.1:{port}/0", asyncio.Event(), start + 2.0, before="a test")
    assert 2.0 <= time.monotonic() - start < 5.0
