"""A fleet scaler over stand-ins for Ray actor handles, recording what it starts, drains and kills."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable

from pdserve.cluster.drain import WorkerDrainedError
from pdserve.cluster.scaling import FleetScaler
from pdserve.cluster.supervisor import Slot, Supervisor
from pdserve.cluster.worker_spec import WorkerSpec
from pdserve.config import EngineConfig
from pdserve.protocol.roles import Role
from pdserve.registry.base import WorkerState
from pdserve.registry.memory import InMemoryRegistry
from tests.unit.cluster.remote_method import RemoteMethod, call_on_loop


class StandInActor:
    """Answers `state` with its load, or WorkerDrainedError once drained."""

    def __init__(self, spec: WorkerSpec, running: int = 0) -> None:
        self.spec = spec
        self.running = running
        self.drained = False
        self.placed = asyncio.Event()  # a Ray node took it: its methods answer
        self.placed.set()
        self.state = RemoteMethod(self._state)
        self.requested_spec = RemoteMethod(self._requested_spec)

    def worker_state(self) -> WorkerState:
        return WorkerState(self.spec.worker_id, self.spec.role, f"{self.spec.worker_id}:1", running=self.running)

    async def _requested_spec(self) -> WorkerSpec:
        await self.placed.wait()
        return self.spec

    async def _state(self) -> WorkerState:
        if self.drained:
            raise WorkerDrainedError(f"worker {self.spec.worker_id} drained")
        return self.worker_state()


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Polls for what a thread or task does meanwhile: a fixed sleep is too short on a loaded host."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def spec(role: Role, worker_id: str) -> WorkerSpec:
    return WorkerSpec(role, EngineConfig(), worker_id=worker_id)


class Fleet:
    """A scaler over stand-ins, recording what it starts, drains and kills."""

    def __init__(self, workers: dict[str, int], roles: tuple[Role, ...] = (Role.PREFILL, Role.DECODE)) -> None:
        self.registry = InMemoryRegistry()
        self.supervisor = Supervisor(
            self.registry, publish=True, new_actor=self.new_actor, kill=self.kill, call=call_on_loop
        )
        self.started: list[str] = []
        self.drained: list[str] = []
        self.killed: list[str] = []
        self.replaced: list[str] = []
        self.listed_while_starting: list[bool] = []
        for worker_id, running in workers.items():
            s = spec(Role(worker_id.rpartition("-")[0]), worker_id)
            actor = StandInActor(s, running)
            self.supervisor.slots[worker_id] = Slot(s, actor, listed=True, address=f"{worker_id}:1")
            self.registry.publish(actor.worker_state())
        flags = dict(Counter(Role(w.rpartition("-")[0]) for w in workers))  # the flags the fleet started with
        self.scaler = FleetScaler(
            self.registry, self.supervisor, roles, spec, StandInActor, self.await_start, self.drain, self.kill,
            publish=True, flag_counts=flags,
        )  # fmt: skip

    def new_actor(self, s: WorkerSpec) -> StandInActor:
        self.replaced.append(s.worker_id)
        return StandInActor(s)

    def await_start(self, slot: Slot) -> WorkerState:
        self.started.append(slot.spec.worker_id)
        self.listed_while_starting.append(slot.spec.worker_id in {w.worker_id for w in self.registry.workers()})
        return slot.actor.worker_state()

    async def drain(self, slot: Slot) -> None:
        self.drained.append(slot.spec.worker_id)
        assert all(w.draining for w in self.registry.workers() if w.worker_id == slot.spec.worker_id)
        slot.actor.drained = True
        await self.supervisor.check_all()  # the supervisor sees it drained before the scaler drops it

    def kill(self, actor: StandInActor) -> None:
        self.killed.append(actor.spec.worker_id)

    def ids(self) -> list[str]:
        return sorted(self.supervisor.slots)

    def listed(self) -> list[str]:
        return sorted(w.worker_id for w in self.registry.workers())
