"""A real `pdserve up` in a subprocess (benchmarks and tests): started, waited for, stopped."""

from __future__ import annotations

import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

PDSERVE_COMMAND = "services.main"  # the module behind the `pdserve` console script


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (Ray's raylet, GCS and worker actors among them)."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                if child not in found:
                    found.add(child)
                    todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    except OSError:  # it exited between the two looks (ProcessLookupError, FileNotFoundError)
        return False
    return fields[0] != "Z"


class ClusterProcess:
    def __init__(
        self, *args: str, log_path: Path, startup_timeout_s: float = 180.0, env: dict[str, str] | None = None
    ) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_path = log_path
        # Known to the test, so it can call the workers' internal RPCs as a cluster peer would.
        self.cluster_secret = (env or {}).get("PDSERVE_CLUSTER_SECRET") or secrets.token_hex(32)
        # The `pdserve` command: its module composes the services (this package never imports them).
        cmd = [sys.executable, "-m", PDSERVE_COMMAND, "up", "--port", str(self.port), *args]
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PDSERVE_CLUSTER_SECRET": self.cluster_secret, **(env or {})},
        )
        deadline = time.monotonic() + startup_timeout_s
        while not re.search(r"^ready \S+", self.log(), re.MULTILINE):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"pdserve up did not become ready:\n{self.log()[-3000:]}")
            time.sleep(0.2)

    def log(self) -> str:
        return self.log_path.read_text()

    def worker_addresses(self) -> dict[str, str]:
        """worker id -> address, from the launcher's log lines."""
        return dict(re.findall(r"worker (\S+) ready at ([\w.\-]+:\d+)", self.log()))

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> float:
        """Signals the launcher; returns the seconds it took to exit. Kills the whole group if it hangs."""
        start = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return time.monotonic() - start
