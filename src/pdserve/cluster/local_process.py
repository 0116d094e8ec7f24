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

from pdserve import env as environment

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


class PdserveProcess:
    """A `pdserve` command in a session of its own, its output in `log_path`; `netns`: run inside that network
    namespace (`ip netns exec`)."""

    def __init__(self, *args: str, log_path: Path, env: dict[str, str] | None = None, netns: str | None = None) -> None:
        self.log_path = log_path
        self.args = args
        cmd = [sys.executable, "-m", PDSERVE_COMMAND, *args]
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=environment.inherited_with(env or {}),
        )

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self, timeout_s: float = 300.0) -> str:
        """The ready line's first word after `ready`; RuntimeError with the log's tail when the process exits or
        the time passes first (stopped then, as `stop` does)."""
        deadline = time.monotonic() + timeout_s
        while not (m := re.search(r"^ready (\S+)", self.log(), re.MULTILINE)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"pdserve {' '.join(self.args)} did not become ready:\n{self.log()[-4000:]}")
            time.sleep(0.2)
        return m.group(1)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> float:
        """`sig` to the process (SIGKILL: as a node failure or `kubectl delete --force` would), then its whole group
        if it hangs; returns the seconds it took to exit."""
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


class ClusterProcess(PdserveProcess):
    """`pdserve up` on `port` (default: a free one), returned once ready, with a cluster secret the test knows (so it
    can call the workers' internal RPCs as a cluster peer would)."""

    def __init__(
        self,
        *args: str,
        log_path: Path,
        startup_timeout_s: float = 180.0,
        env: dict[str, str] | None = None,
        port: int | None = None,
    ) -> None:
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.cluster_secret = (env or {}).get("PDSERVE_CLUSTER_SECRET") or secrets.token_hex(32)
        secret = {"PDSERVE_CLUSTER_SECRET": self.cluster_secret}
        super().__init__("up", "--port", str(self.port), *args, log_path=log_path, env={**secret, **(env or {})})
        self.wait_ready(startup_timeout_s)

    def worker_addresses(self) -> dict[str, str]:
        """worker id -> address, from the launcher's log lines."""
        return dict(re.findall(r"worker (\S+) ready at ([\w.\-]+:\d+)", self.log()))
