"""`pdserve controller` and `pdserve router` as the real processes they are in a deployment: started, waited for
until they print their ready line, killed or stopped."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from pdserve.cluster.local_process import PDSERVE_COMMAND


class PdserveProcess:
    def __init__(self, *args: str, log_path: Path, env: dict[str, str] | None = None, netns: str | None = None) -> None:
        self.log_path = log_path
        cmd = [sys.executable, "-m", PDSERVE_COMMAND, *args]
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **(env or {})}
        )

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self, timeout_s: float = 300.0) -> str:
        """The ready line's first word after `ready`."""
        deadline = time.monotonic() + timeout_s
        while not (m := re.search(r"^ready (\S+)", self.log(), re.MULTILINE)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop(signal.SIGKILL)
                raise RuntimeError(f"{self.proc.args[3:5]} did not become ready:\n{self.log()[-4000:]}")
            time.sleep(0.2)
        return m.group(1)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> None:
        """`sig` to the process (SIGKILL: as a node failure or `kubectl delete --force` would), then its group if
        it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if not self._log.closed:
            self._log.close()
