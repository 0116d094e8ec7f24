"""Workers adopted from an earlier fleet run the spec they were made with; this brings them to the fleet's own.

A restarted controller (a new Deployment revision: another image, model, dtype, KV size, timeout) finds its detached
actors by name and adopts them. Left alone, they would serve the old configuration until they happened to die.
Instead each actor's spec is compared with its slot's, once per actor; one that differs is drained. A drain is a
restart: the supervisor starts the new actor from the slot's spec, the fleet's. One worker of a role at a time,
and only while every other worker of its role is in placement, so capacity drops by at most one worker and no
request is lost (a drained worker finishes or moves what it holds). A role's only worker is surged instead: its
successor starts under a new id and serves before it drains, since a restart in place would leave the role
empty for a model load (requests would wait, then fail UNAVAILABLE). Where the successor cannot start (no
node has room for one more), it restarts in place after all. A worker whose spec differs only in its log level
takes the new level where it runs (`relevel`): turning DEBUG on for an incident must not restart the fleet.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import fields, replace
from typing import Any

from pdserve.cluster.supervisor import Slot, Supervisor
from pdserve.cluster.worker_spec import WorkerSpec

log = logging.getLogger(__name__)
ROLLOUT_CHECK_S = 2.0


class Rollout:
    """`spec_of` asks an actor for the spec it was made with (None: it cannot say, so it is outdated); `drain`
    drains a slot's worker (it restarts); `surge` replaces one by a successor started first, and answers whether
    it could (`FleetScaler.surge`); `relevel` sets an actor's log level where it runs, and answers whether it could
    (an actor of an earlier build cannot: it is rolled)."""

    def __init__(
        self,
        supervisor: Supervisor,
        spec_of: Callable[[Any], Awaitable[WorkerSpec | None]],
        drain: Callable[[Slot], Awaitable[None]],
        surge: Callable[[Slot], Awaitable[bool]],
        relevel: Callable[[Any, str | None], Awaitable[bool]] | None = None,
    ) -> None:
        self.supervisor = supervisor
        self.spec_of = spec_of
        self.drain = drain
        self.surge = surge
        self.relevel = relevel
        # Worker id -> id() of the actor whose spec matched (or was rolled), and its process's instance: never the
        # handle itself, since Ray frees a dead actor's name only once every handle to it is gone, and its
        # replacement needs that name. An actor Ray restarted in place (the same handle) runs the spec it was made
        # with again, a log level it was given since undone: a new instance is checked anew.
        self._checked: dict[str, tuple[int, str]] = {}
        self._unanswered: set[str] = set()  # worker ids whose last spec read failed: logged once per run of failures

    async def run(self, interval_s: float = ROLLOUT_CHECK_S) -> None:
        while True:
            try:
                await self.step()
            except Exception as e:  # one failed pass (an actor gone mid-call): the next one tries again
                log.warning("rollout pass failed: %r", e)
            await asyncio.sleep(interval_s)

    async def step(self) -> str | None:
        """Compares the specs of the actors not yet checked and drains the first outdated one whose role can
        spare it; returns its worker id."""
        for slot in list(self.supervisor.slots.values()):
            worker_id, checked = slot.spec.worker_id, (id(slot.actor), slot.instance)
            if slot.leaving or not slot.listed or slot.actor is None or self._checked.get(worker_id) == checked:
                continue
            try:
                running = await self.spec_of(slot.actor)
            except Exception as e:  # stopped or hung (a timeout), or gone mid-call: the others are checked meanwhile
                self._unanswered_once(worker_id, e)
                continue
            self._unanswered.discard(worker_id)
            if running == slot.spec or await self._relevelled(slot, running):
                self._checked[worker_id] = checked
                continue
            peers = [s for s in self.supervisor.slots.values() if s is not slot and s.spec.role == slot.spec.role]
            if not all(s.listed and not s.leaving and not s.said_draining for s in peers):
                continue  # another worker of its role is restarting, draining or leaving: it waits for a later pass
            differences = _differences(running, slot.spec)
            if not peers:
                log.warning("worker %s runs an earlier spec (%s); starting its successor first", worker_id, differences)
                if await self.surge(slot):
                    return worker_id
                log.warning(
                    "worker %s: no successor serves (none could start, or surges are off); restarting it in place",
                    worker_id,
                )
            else:
                log.warning(
                    "worker %s runs an earlier spec (%s); draining it to restart with this fleet's",
                    worker_id,
                    differences,
                )
            slot.draining = True  # out of its role's service from now on: no scale-down drains its last peer
            try:
                await self.drain(slot)  # raises when it could not: a later pass tries again
            finally:
                slot.draining = False  # its state says draining until it leaves, and then it is unlisted
            self._checked[worker_id] = checked
            return worker_id
        return None

    def _unanswered_once(self, worker_id: str, error: Exception) -> None:
        """A worker that cannot say its spec is asked again at the next pass. A role's only worker stays in placement
        while it is stopped (supervisor.py), so its read times out every pass: it used to fail the whole pass, and no
        worker after it was checked (rolled) until it answered, with a warning every pass naming none of them."""
        if worker_id not in self._unanswered:
            self._unanswered.add(worker_id)
            log.warning(
                "worker %s did not say which spec it runs (%r); the rollout checks the others and asks it again",
                worker_id,
                error,
            )

    async def _relevelled(self, slot: Slot, running: WorkerSpec | None) -> bool:
        """Its log level alone differed, and it took the slot's where it runs."""
        level = slot.spec.log_level
        if running is None or self.relevel is None or replace(running, log_level=level) != slot.spec:
            return False
        if relevelled := await self.relevel(slot.actor, level):
            log.info("worker %s logs at %s now", slot.spec.worker_id, level)
        return relevelled


def _differences(a: WorkerSpec | None, b: WorkerSpec) -> str:
    if a is None:
        return "made by a pdserve that does not report it"
    names = [f.name for f in fields(WorkerSpec) if getattr(a, f.name) != getattr(b, f.name)]
    if "engine" in names:
        engine = type(a.engine)
        names.remove("engine")
        names += [f"engine.{f.name}" for f in fields(engine) if getattr(a.engine, f.name) != getattr(b.engine, f.name)]
    if "build" in names:  # which build is leaving, which comes: what an operator watching an upgrade looks for
        names[names.index("build")] = f"build {a.build or 'unnamed'!r} -> {b.build!r}"
    return f"{', '.join(names)} differ"
