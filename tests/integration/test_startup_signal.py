"""Ctrl-C while `pdserve up` is still starting Ray: the start ends with status 0 as soon as Ray is connected,
rather than Ray's client giving up on a half-shut process a minute later (status 1)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest

from pdserve.cluster.local_process import PDSERVE_COMMAND, free_port

pytestmark = pytest.mark.timeout(240)


def test_sigint_while_ray_starts_ends_the_start_cleanly(tmp_path):
    log = tmp_path / "up.log"
    args = ["up", "--model", "tiny-random", "--kv-cache-gb", "0.05", "--port", str(free_port())]
    with open(log, "w") as out:
        up = subprocess.Popen([sys.executable, "-m", PDSERVE_COMMAND, *args], stdout=out, stderr=subprocess.STDOUT)
        try:
            end = time.monotonic() + 60
            while "Ray" not in log.read_text():  # its first line comes from Ray's start
                assert up.poll() is None and time.monotonic() < end, log.read_text()
                time.sleep(0.1)
            up.send_signal(signal.SIGINT)
            start = time.monotonic()
            assert up.wait(timeout=150) == 0, log.read_text()[-3000:]
        finally:
            if up.poll() is None:
                up.kill()
    assert time.monotonic() - start < 100, log.read_text()[-3000:]  # Ray's start, slow on a loaded host
    assert not re.search(r"^ready ", log.read_text(), re.MULTILINE)
