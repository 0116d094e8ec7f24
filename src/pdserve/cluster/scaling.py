"""The fleet's side of `pdserve scale`: it keeps as many workers of each role as the registry's desired counts say.

Every few seconds it compares the desired counts (set at the fleet's start and by the router's ScaleWorkers, in the
registry so that any router and a separate `pdserve controller` agree) with its slots. A worker added gets the next
`role-i` id and enters placement only once it serves and has warmed up, as at the fleet's start. A worker
removed is one out of service first (restarting, crash-looping, draining already), else the least loaded of its
role: it drains (out of placement at once, its requests finish or move), then its actor is killed and its slot
dropped. Its slot is marked `leaving` first, so the supervisor neither restarts it when its drain ends nor replaces
it if it dies meanwhile. No role goes below one worker, nor loses its last worker in service. Starts and drains run in
the background, so a long one never holds up the next change: a start still under way when the count drops again
is called off before any serving worker drains, and one that does not serve within `START_TIMEOUT_S` (no node can
host it) is killed, for the next pass to try anew. So is one still starting when the fleet stops: no one else
knows its actor, which (detached) would serve on. A worker of a role outside the fleet's mode (a restarted
controller found it, left by a fleet of the other mode) drains away too, once each of the fleet's roles serves.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, TypeVar

from pdserve.cluster.supervisor import CHECK_TIMEOUT_S, Slot, Supervisor
from pdserve.cluster.worker_spec import WorkerSpec
from pdserve.protocol.roles import Role
from pdserve.registry.base import VIEW_REFRESH_S, Registry, WorkerState

log = logging.getLogger(__name__)
SCALE_CHECK_S = 1.0  # how often the desired counts are read: a scale starts within this
START_TIMEOUT_S = 600.0  # a worker's own wait for its model and warm-up; longer: it cannot start (no node for it)
DRAIN_ANSWER_SLACK_S = 90.0  # past the drain's own timeout (as the router's `pdserve drain` waits)
ROUTERS_SEE_S = 4 * VIEW_REFRESH_S  # a worker just listed is in every router's view by then, on a loaded host too
T = TypeVar("T")


def index_of(worker_id: str) -> int:
    """`prefill-3` -> 3; -1 for an id not made by the fleet."""
    tail = worker_id.rpartition("-")[2]
    return int(tail) if tail.isdigit() else -1


def next_worker_id(role: Role, taken: set[str]) -> str:
    """`role-i` with i one past the highest index in use: the fleet numbers its workers across roles from 0 at its
    start (1P:1D is prefill-0 and decode-1), so an id never names two workers at once."""
    return f"{role}-{max(map(index_of, taken), default=-1) + 1}"


def load_of(state: WorkerState | None) -> tuple[int, int, int]:
    """What leaving would cost: requests held, prompt tokens queued, KV blocks in use (None: not serving, nothing)."""
    if state is None:
        return (0, 0, 0)
    return (state.running + state.waiting, state.queued_prefill_tokens, state.kv_blocks_used)


def in_service(slot: Slot, state: WorkerState | None) -> bool:
    """In placement and not draining (a rollout's restart, `pdserve drain`). A listed worker whose state did not
    answer in time still counts: its routers place on it, and a starved check is no proof it stopped."""
    return slot.listed and not slot.draining and not (state is not None and state.draining)


def pick_leaving(slots: list[Slot], states: dict[str, WorkerState | None], n: int) -> list[Slot]:
    """Up to `n` of one role's `slots` to scale away. First those out of service (restarting, crash-looping, a new
    actor under way, draining already): an unreachable worker reads as idle, so load alone would keep it and drain
    a working one. Then the least loaded, on a tie the highest index (the newest); never the last in service."""

    def key(slot: Slot) -> tuple[bool, tuple[int, int, int], int]:
        state = states.get(slot.spec.worker_id)
        return in_service(slot, state), load_of(state), -index_of(slot.spec.worker_id)

    serving = sum(in_service(s, states.get(s.spec.worker_id)) for s in slots)
    return sorted(slots, key=key)[: min(n, len(slots) - min(1, serving))]


async def _on_own_thread(fn: Callable[[Slot], T], slot: Slot) -> T:
    """`fn(slot)` on a thread of its own. A start's waits last a model load: on asyncio's shared default pool
    (min(32, cores + 4) threads) a few starts at once would hold every thread, stalling each `to_thread` of the
    process (the scaler's reads, the supervisor's registry calls, the router's work in `pdserve up`), and a start
    queued behind them would spend its timeout waiting for a thread."""
    pool = ThreadPoolExecutor(1, thread_name_prefix=f"start-{slot.spec.worker_id}")
    try:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, slot)
    finally:
        pool.shutdown(wait=False)  # its thread ends with `fn`


class FleetScaler:
    """`create` makes a worker's actor (or finds it by name) and `await_start` waits until it serves (both block);
    `drain` drains a worker over its WorkerControl service; `publish`: the fleet keeps the (embedded) registry
    current itself, so a leaving worker is marked draining there at once."""

    def __init__(
        self,
        registry: Registry,
        supervisor: Supervisor,
        roles: tuple[Role, ...],
        new_spec: Callable[[Role, str], WorkerSpec],
        create: Callable[[WorkerSpec], Any],
        await_start: Callable[[Slot], WorkerState],
        drain: Callable[[Slot], Awaitable[None]],
        kill: Callable[[Any], None],
        publish: bool,
        flag_counts: dict[Role, int],
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        self.registry = registry
        self.supervisor = supervisor
        self.roles = roles  # the fleet's mode: desired counts of other roles are not its to act on
        self.new_spec = new_spec
        self.create = create
        self.await_start = await_start
        self.drain = drain
        self.kill = kill
        self.publish = publish
        self.flag_counts = flag_counts  # the fleet's flags': written back with the desired counts a registry lost
        self.start_timeout_s = start_timeout_s
        self._tasks: set[asyncio.Task[None]] = set()
        self.starting: dict[str, Slot] = {}  # actors made, not yet serving: not the supervisor's until they are
        self._unread = False  # the last read of the desired counts failed (logged once per outage)
        self._last_desired: dict[Role, int] = {}  # the last counts read

    async def run(self, interval_s: float = SCALE_CHECK_S) -> None:
        for slot in [s for s in self.supervisor.slots.values() if s.spec.role not in self.roles]:
            self._spawn(self._remove_once_replaced(slot, interval_s))
        try:
            while True:
                try:
                    await self.reconcile()
                except Exception as e:  # a bug in one pass: reported, and the next pass tries again
                    log.error("scaling pass failed: %r", e, exc_info=e)
                await asyncio.sleep(interval_s)
        finally:  # the fleet is stopping: it stops or leaves every actor itself
            for task in list(self._tasks):
                task.cancel()

    async def reconcile(self) -> None:
        """One pass: sets off the starts and drains that bring each role to its desired count. They run on in the
        background (a start takes seconds to minutes, a drain up to its timeout), so a pass never waits on one and
        the next passes count them: a start no longer wanted is called off before any serving worker drains."""
        desired = await self._desired()
        for role in (r for r in self.roles if r in desired):
            staying = [s for s in self.supervisor.slots.values() if s.spec.role == role and not s.leaving]
            starting = [s for s in self.starting.values() if s.spec.role == role and not s.leaving]
            extra = len(staying) + len(starting) - max(1, desired[role])
            for _ in range(-extra):
                self._spawn(self._start(self._new_slot(role)))
            for slot in sorted(starting, key=lambda s: -index_of(s.spec.worker_id))[: max(0, extra)]:
                self._call_off(slot)
            extra -= len(starting)
            if extra > 0:
                for slot in pick_leaving(staying, await self._states(staying), extra):
                    slot.leaving = True
                    self._spawn(self._remove(slot))

    async def surge(self, old: Slot, placement_wait_s: float) -> bool:
        """Replaces `old` without a moment of less capacity: its successor starts under the next id with the fleet's
        spec, and only once it serves does `old` drain away. What a rollout does to a role's only worker, whose
        restart in place would leave the role empty. False when the successor could not start, or no Ray node took
        it within `placement_wait_s` (none has room for one more; 0: never tried): `old` serves on."""
        if placement_wait_s <= 0:
            return False
        old.leaving = True  # out of its role's count, so no scaling pass calls the successor off or drains another
        successor = self._new_slot(old.spec.role)
        await self._start(successor, placement_wait_s)
        if successor.spec.worker_id not in self.supervisor.slots:
            old.leaving = False
            return False
        # Routers place on the old worker until they see the successor: a request they send to it once it is gone
        # is retried, but only onto a worker in their view.
        await asyncio.sleep(ROUTERS_SEE_S)
        await self._remove(old)
        return True

    async def _remove_once_replaced(self, slot: Slot, interval_s: float) -> None:
        """A worker of a role outside the fleet's mode (adopted from a fleet of the other mode, `leaving` from then on:
        neither restarted, replaced nor rolled) drains away once each of the fleet's roles has a worker in placement
        and the routers can see it: until then it is what serves."""

        def replaced() -> bool:
            slots = self.supervisor.slots.values()
            return all(any(s.listed and not s.leaving and s.spec.role == r for s in slots) for r in self.roles)

        while not replaced():
            await asyncio.sleep(interval_s)
        await asyncio.sleep(ROUTERS_SEE_S)
        await self._remove(slot)

    async def settle(self) -> None:
        """Waits for the starts and drains under way (tests)."""
        while self._tasks:
            await asyncio.gather(*self._tasks)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _desired(self) -> dict[Role, int]:
        try:
            desired = await asyncio.to_thread(self.registry.desired_counts)
        except Exception as e:  # Redis down: the fleet keeps its shape until it can read the counts again
            if not self._unread:
                log.warning("cannot read the desired worker counts (%r); keeping the fleet as it is", e)
            self._unread = True
            return {}
        self._unread = False
        if not desired and self._last_desired:  # the registry lost them (a Redis restarted empty): write them back
            await asyncio.to_thread(self.registry.restore_desired_counts, self._last_desired, self.flag_counts)
            log.warning("the registry had no desired worker counts; restored the fleet's %s", self._last_desired)
            desired = await asyncio.to_thread(self.registry.desired_counts)  # a scale just made wins
        self._last_desired = desired or self._last_desired
        return desired

    async def _states(self, slots: list[Slot]) -> dict[str, WorkerState | None]:
        """Each worker's load now, from its actor (a remote registry's view is the routers', not the fleet's)."""

        async def state(slot: Slot) -> WorkerState | None:
            try:
                return await self.supervisor.call(slot.actor.state, timeout_s=CHECK_TIMEOUT_S, task_events=False)
            except Exception:  # starting, dead or stuck: it holds nothing a drain could save
                return None

        found = await asyncio.gather(*(state(s) for s in slots))
        return {s.spec.worker_id: st for s, st in zip(slots, found, strict=True)}

    def _new_slot(self, role: Role) -> Slot:
        """A slot with the next id, counted as starting from now on (before its task runs)."""
        spec = self.new_spec(role, next_worker_id(role, {*self.supervisor.slots, *self.starting}))
        slot = Slot(spec, None)
        self.starting[spec.worker_id] = slot
        log.warning("scaling up: starting worker %s", spec.worker_id)
        return slot

    def _call_off(self, slot: Slot) -> None:
        """A start no longer wanted: its actor goes now (a wait for it to serve then fails), or as soon as made."""
        slot.leaving = True
        log.warning("scaling down: worker %s is no longer wanted before it serves", slot.spec.worker_id)
        if slot.actor is not None:
            self._spawn(asyncio.to_thread(self._kill_quietly, slot.actor))

    async def _start(self, slot: Slot, placement_wait_s: float | None = None) -> None:
        """Lists the worker once it serves (warmed up), as at the fleet's start; a worker that cannot start in
        `start_timeout_s` (no node can host it, say), or whose actor no node took within `placement_wait_s`, is
        killed, and the next pass tries a new one."""
        name = slot.spec.worker_id
        try:
            await _on_own_thread(self._create, slot)  # may wait seconds for Ray to free the name
            if placement_wait_s is not None:  # its constructor returns at once: an answer means a node took it
                await self.supervisor.call(slot.actor.requested_spec, timeout_s=placement_wait_s)
            state = None if slot.leaving else await self._serving(slot)
            if state is None or slot.leaving:
                raise RuntimeError("called off")
        except asyncio.CancelledError:  # the fleet stops: no one else knows this actor, and a detached one serves on
            slot.leaving = True  # one still being made is killed as it comes (`_create`)
            if slot.actor is not None:
                self._kill_quietly(slot.actor)  # now: an await here could be cancelled in turn
            raise
        except Exception as e:
            log.log(logging.INFO if slot.leaving else logging.ERROR, "worker %s not started: %r", name, e)
            if slot.actor is not None:
                await asyncio.to_thread(self._kill_quietly, slot.actor)
            return
        finally:
            self.starting.pop(name, None)
        self.supervisor.slots[name] = slot  # the fleet's from here on, before any await: its stop finds it
        slot.listed, slot.address = True, state.address
        try:
            await asyncio.to_thread(self.registry.publish, state)
        except Exception as e:  # Redis down: the worker's own heartbeat lists it once Redis answers
            log.warning("could not list worker %s in the registry: %r", name, e)
        log.warning("worker %s ready at %s (scaled up)", name, state.address)

    def _create(self, slot: Slot) -> None:
        """In a thread: the actor goes into its slot as soon as made, and is killed here if its start was called off
        or cancelled meanwhile, since a cancelled start no longer waits for it."""
        slot.actor = self.create(slot.spec)
        if slot.leaving:
            self._kill_quietly(slot.actor)

    async def _serving(self, slot: Slot) -> WorkerState:
        return await asyncio.wait_for(_on_own_thread(self.await_start, slot), self.start_timeout_s)

    def _kill_quietly(self, actor: Any) -> None:
        try:
            self.kill(actor)
        except Exception as e:  # gone already
            log.info("kill: %r", e)

    async def _remove(self, slot: Slot) -> None:
        name = slot.spec.worker_id
        log.warning("scaling down: draining worker %s at %s", name, slot.address)
        if self.publish:  # out of placement now, not at the supervisor's next check
            found = [w for w in self.registry.workers() if w.worker_id == name]
            if found:
                w = found[0]  # its load as sampled then: as old now as it was, on this process's clock
                self.registry.publish(replace(w, draining=True, load_age_s=time.monotonic() - w.load_sampled_at))
        try:
            await self.drain(slot)
        except Exception as e:  # unreachable or dead: what it held moves as after a crash
            log.error("worker %s did not drain (%r); stopping it anyway", name, e)
        if slot.actor is not None:  # none: its new actor was under way, and the supervisor stops that one
            await asyncio.to_thread(self._kill_quietly, slot.actor)
        self.supervisor.slots.pop(name, None)  # first: a check under way then publishes its state no more
        try:
            await asyncio.to_thread(self.registry.retire, name)
        except Exception as e:  # Redis down: its key's TTL removes it, and routers take it for gone, not retired
            log.warning("could not retire worker %s in the registry: %r", name, e)
        log.warning("worker %s removed (scaled down)", name)


async def drain_over_rpc(slot: Slot, timeout_s: float) -> None:
    """The worker's own WorkerControl `Drain`, as `pdserve drain` asks it; returns once it drained."""
    from pdserve.rpc.server import internal_channel
    from pdserve.v1 import worker_pb2 as wpb
    from pdserve.v1 import worker_pb2_grpc

    async with internal_channel(slot.address) as ch:
        r = await worker_pb2_grpc.WorkerControlStub(ch).Drain(
            wpb.DrainRequest(timeout_s=timeout_s), timeout=timeout_s + DRAIN_ANSWER_SLACK_S
        )
    log.warning(
        "worker %s drained in %.1f s: held %d requests, %d moved; %d KV blocks left",
        *(r.worker_id, r.seconds, r.held, r.moved, r.kv_blocks_left),
    )
