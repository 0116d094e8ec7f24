"""The chaos run's faults: one worker at a time, found through the router's status (each worker reports its
process id), signalled, and timed until the cluster is back at its desired shape.

A worker is back when every role again has its desired count of SERVING workers in the router's view and the
faulted one among them: after a SIGKILL as a new process (a new pid: Ray restarted it, or the launcher replaced
its actor), after a SIGSTOP as the same process, once SIGCONT let it answer again. The run must share the
workers' host: the pids are theirs.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass

from pdserve.v1 import admin_pb2, admin_pb2_grpc

POLL_S = 0.1
BUSY_WAIT_S = 10.0  # how long a stop waits for a worker of its role to hold requests


@dataclass
class Fault:
    kind: str  # "kill" (SIGKILL) or "stop" (SIGSTOP, held, then SIGCONT)
    worker: str
    role: str
    pid: int
    at_s: float  # seconds into the run
    held_s: float = 0.0  # a stop: how long the process stayed stopped
    recover_s: float | None = None  # kill (or SIGCONT) -> back at the desired counts; None: not within the bound

    def as_dict(self) -> dict:
        return asdict(self)


class Fleet:
    """The router's view of the workers, and the desired count per role (what it showed when the run began)."""

    def __init__(self, admin: admin_pb2_grpc.AdminStub, recover_timeout_s: float, rng: random.Random) -> None:
        self.admin = admin
        self.recover_timeout_s = recover_timeout_s
        self.rng = rng
        self.desired: Counter[str] = Counter()
        self.started = time.monotonic()

    async def workers(self) -> list[admin_pb2.WorkerStatus]:
        reply = await self.admin.ClusterStatus(admin_pb2.ClusterStatusRequest(), timeout=5)
        return list(reply.workers)

    async def in_flight(self) -> int:
        return (await self.admin.ClusterStatus(admin_pb2.ClusterStatusRequest(), timeout=5)).in_flight

    async def learn_shape(self) -> Counter[str]:
        """The desired counts; fails when a worker's process is not one this run can signal (not on this host)."""
        ws = await self.serving()
        self.desired = Counter(w.role for w in ws)
        for w in ws:
            if not (w.pid and _signallable(w.pid)):
                raise RuntimeError(f"worker {w.id}'s process is not one pdserve chaos can signal (another host?)")
        return self.desired

    async def serving(self) -> list[admin_pb2.WorkerStatus]:
        return [w for w in await self.workers() if w.health == "SERVING"]

    async def kill(self) -> Fault:
        victim = self.rng.choice(await self.serving())
        fault = self._fault("kill", victim)
        os.kill(victim.pid, signal.SIGKILL)
        start = time.monotonic()
        if await self._back(victim.id, lambda w: w.pid != victim.pid):
            fault.recover_s = time.monotonic() - start
        return fault

    async def stop(self, role: str, hold_s: float) -> Fault:
        """SIGSTOP a busy worker of `role`, SIGCONT after `hold_s`."""
        victim = await self._busy(role)
        fault = self._fault("stop", victim)
        os.kill(victim.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            await asyncio.sleep(hold_s)
        finally:
            os.kill(victim.pid, signal.SIGCONT)
        start = time.monotonic()
        fault.held_s = start - stopped
        if await self._back(victim.id, lambda w: w.pid == victim.pid):
            fault.recover_s = time.monotonic() - start
        return fault

    async def _busy(self, role: str) -> admin_pb2.WorkerStatus:
        """A worker of `role` (any, if none serves) holding requests: the first one seen within BUSY_WAIT_S, else
        a random one. A stop is meant to catch streams in flight."""
        end = time.monotonic() + BUSY_WAIT_S
        while True:
            ws = [w for w in await self.serving() if w.role == role] or await self.serving()
            busy = [w for w in ws if w.running + w.waiting]
            if busy or time.monotonic() > end:
                return self.rng.choice(busy or ws)
            await asyncio.sleep(POLL_S / 2)

    async def settled(self) -> bool:
        """Every role at its desired count of SERVING workers."""
        return await self._back("", lambda w: True)

    def _fault(self, kind: str, victim: admin_pb2.WorkerStatus) -> Fault:
        return Fault(kind, victim.id, victim.role, victim.pid, round(time.monotonic() - self.started, 2))

    async def _back(self, worker_id: str, is_back: Callable[[admin_pb2.WorkerStatus], bool]) -> bool:
        end = time.monotonic() + self.recover_timeout_s
        while time.monotonic() < end:
            try:
                ws = await self.serving()
            except Exception:  # the router's status can fail while a worker is gone: ask again
                ws = []
            shape_ok = Counter(w.role for w in ws) == self.desired
            if shape_ok and (not worker_id or any(w.id == worker_id and is_back(w) for w in ws)):
                return True
            await asyncio.sleep(POLL_S)
        return False

    async def idle_blocks(self, timeout_s: float) -> dict[str, int]:
        """Each worker's KV blocks still held (live sequences or transfers, not the prefix cache) once the cluster
        is idle, waiting up to `timeout_s` for them to reach zero (heartbeats lag a fraction of a second)."""
        end = time.monotonic() + timeout_s
        while True:
            ws = await self.workers()
            held = {w.id: w.kv_blocks_used for w in ws}
            busy = any(w.running or w.waiting for w in ws)
            if (not any(held.values()) and not busy) or time.monotonic() > end:
                return held
            await asyncio.sleep(0.2)


def _signallable(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only checks that the process exists and is ours to signal
    except OSError:
        return False
    return True
