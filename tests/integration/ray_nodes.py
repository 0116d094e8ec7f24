"""Ray nodes of our own for multi-node tests: `ray start --block` in a session of its own, every port chosen (so
no other Ray on this machine is touched), its own temp dir and auth token; stopped by killing that session
(never `ray stop`, which would stop every Ray on the machine)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pdserve.cluster.local_process import alive, free_port

RAY = str(Path(sys.executable).with_name("ray"))
# This machine is slow and shared: a raylet waits this long for its agents before giving up (default 10-30 s).
SLOW_MACHINE_ENV = {"RAY_agent_register_timeout_ms": "180000"}


def ray_env(temp_dir: Path) -> dict[str, str]:
    """What every process of the test's Ray cluster (nodes, drivers) shares: one auth token of its own, so a token
    another Ray on this machine left in ~/.ray is never used or needed."""
    token = temp_dir / "auth_token"
    if not token.exists():
        token.write_text(secrets.token_hex(32))
    return {**SLOW_MACHINE_ENV, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token.read_text()}


RAY_START_TIMED_OUT = "The current node timed out during startup"


class RayNode:
    def __init__(
        self,
        temp_dir: Path,
        resources: dict[str, float],
        head_address: str | None = None,
        ip: str = "127.0.0.1",
        netns: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """A head node (no `head_address`) or one joining it; `netns`: run it in that network namespace."""
        self.ip = ip
        self.log_path = temp_dir / f"ray-node-{len(list(temp_dir.glob('ray-node-*')))}.log"
        ports = {
            name: free_port()
            for name in ("node-manager", "object-manager", "dashboard-agent-listen", "dashboard-agent-grpc")
        } | {name: free_port() for name in ("runtime-env-agent", "metrics-export")}
        # No CPUs (the worker actors ask for none, and no worker process is started ahead), no GPUs, no log monitor:
        # as few processes as a node can have, on a machine other tests load too.
        args = [RAY, "start", "--block", "--disable-usage-stats", "--temp-dir", str(temp_dir), "--num-cpus", "0"]
        args += ["--num-gpus", "0", "--include-log-monitor", "false"]
        args += ["--node-ip-address", ip, "--resources", json.dumps(resources), "--object-store-memory", "80000000"]
        for name, port in ports.items():
            args += [f"--{name}-port", str(port)]
        if head_address is None:
            self.port, self.client_port = free_port(), free_port()
        # A small range of its own for worker processes, clear of every port chosen above: Ray refuses to start a
        # node whose ports overlap (a CI run failed so, a dashboard agent port inside the range).
        taken = {*ports.values(), *((self.port, self.client_port) if head_address is None else ())}
        worker_port = free_port()
        while taken & set(range(worker_port, worker_port + 41)):
            worker_port = free_port()
        args += ["--min-worker-port", str(worker_port), "--max-worker-port", str(worker_port + 40)]
        if head_address is None:
            args += ["--head", "--port", str(self.port), "--ray-client-server-port", str(self.client_port)]
            args += ["--include-dashboard", "false"]
            self.address = f"{ip}:{self.port}"
        else:
            args += ["--address", head_address]
            self.address = head_address
        if netns:
            args = ["ip", "netns", "exec", netns, *args]
        self._args, self._env = args, {**os.environ, **(env or {})}
        self._launch()

    def _launch(self) -> None:
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            self._args, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, env=self._env
        )

    def kill(self) -> None:
        """SIGKILL to the node's session, as a lost pod: nothing of it says goodbye."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._log.close()

    def restart(self, temp_dir: Path) -> None:
        """Starts the killed node again as it was (ports, resources, env): a head whose GCS keeps its tables in
        Redis comes back as the same cluster. In a fresh `temp_dir`: `ray start --head` refuses a temp dir whose
        cluster's address a live raylet still names."""
        for again in (False, True):
            where = temp_dir / "again" if again else temp_dir
            where.mkdir(exist_ok=True)
            self._args[self._args.index("--temp-dir") + 1] = str(where)
            self.log_path = where / self.log_path.name
            self._launch()
            try:
                self.wait_started()
                return
            except RuntimeError as e:
                # Ray gives a node 30 s (hard-coded) to register with its GCS, which a head reloading its tables
                # from Redis on a loaded machine can take longer than: a CI run's did. Once more, then it fails.
                if again or RAY_START_TIMED_OUT not in str(e):
                    raise
                with contextlib.suppress(ProcessLookupError):  # what the failed start left of its session
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self._log.close()

    def wait_started(self, timeout_s: float = 240.0) -> None:
        deadline = time.monotonic() + timeout_s
        while "block forever" not in self.log_path.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray node did not start:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM to the node's session (raylet, GCS, agents, worker actors), SIGKILL what is left."""
        for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait_s
            while _session_pids(self.proc.pid) and time.monotonic() < deadline:
                time.sleep(0.2)
        self.proc.wait()
        self._log.close()


def _session_pids(sid: int) -> list[int]:
    """Live processes of session `sid`."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = re.sub(r"^.*\) ", "", stat.read_text()).split()
        except OSError:
            continue
        if int(fields[3]) == sid and alive(int(stat.parent.name)):
            pids.append(int(stat.parent.name))
    return pids


def remove_temp_dir(temp_dir: Path) -> None:
    shutil.rmtree(temp_dir, ignore_errors=True)


_ACTORS_SCRIPT = """
import json, sys, ray
ray.init(address=sys.argv[1], namespace=sys.argv[2], logging_level="ERROR", log_to_driver=False)
nodes = {n["NodeID"]: sorted(k for k in n["Resources"] if k.startswith("pdserve_")) for n in ray.nodes() if n["Alive"]}
actors = {}
for a in ray._private.state.state.actor_table(None).values():
    if a.get("Name") and a["State"] != "DEAD":  # the table holds no namespace: the test's cluster has one
        actors[a["Name"]] = {"state": a["State"], "pid": a["Pid"], "restarts": a["NumRestarts"],
                             "node_resources": nodes.get(a["Address"]["NodeID"], [])}
print(json.dumps(actors))
"""


def named_actors(address: str, namespace: str, env: dict[str, str], netns: str | None = None) -> dict[str, dict]:
    """Ray's own record of the live named actors (the cluster's, whose only namespace is `namespace`): state,
    pid, restarts and the pdserve_* resources of the node each lives on (a driver of its own in a subprocess, so
    this test process never joins Ray)."""
    return _driver_output(_ACTORS_SCRIPT, address, namespace, env, netns)


def actor_names(address: str, namespace: str, env: dict[str, str], netns: str | None = None) -> list[str]:
    """The names of the actors in `namespace` that are not dead (starting ones too), from Ray's list."""
    return _driver_output(_NAMES_SCRIPT, address, namespace, env, netns)


def _driver_output(script: str, address: str, namespace: str, env: dict[str, str], netns: str | None) -> Any:
    """The JSON a driver `script` prints last, run in a subprocess (this test process never joins Ray)."""
    args = [sys.executable, "-c", script, address, namespace]
    if netns:
        args = ["ip", "netns", "exec", netns, *args]
    out = subprocess.run(args, capture_output=True, text=True, timeout=180, env={**os.environ, **env})
    if out.returncode != 0:
        raise RuntimeError(f"reading Ray's actors failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


_NAMES_SCRIPT = """
import json, sys, ray
ray.init(address=sys.argv[1], namespace=sys.argv[2], logging_level="ERROR", log_to_driver=False)
named = ray.util.list_named_actors(all_namespaces=True)
print(json.dumps(sorted(a["name"] for a in named if a["namespace"] == sys.argv[2])))
"""
