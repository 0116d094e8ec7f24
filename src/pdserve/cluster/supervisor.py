"""The launcher's supervision of its worker actors: who is in placement, and a new actor for one that died for good.

Ray restarts a worker actor whose process died while it has restarts left; calls to it wait meanwhile. This loop
checks every actor at once (one slow actor never delays the others' checks), each within a timeout, and takes
any actor that does not answer with its state out of placement: dead, restarting, starting, or leaving because
its engine died, at once; silent (the check timed out) only after two checks in a row, and never the last worker of
its role in placement (on a loaded machine a healthy actor misses a check now and then), and only while another
actor answers (none answering is this process's own trouble: Ray out of reach, or no CPU). An actor that answers
again rejoins. Ray itself takes over a second to notice a killed
process, so each check first knocks on the worker's gRPC port: a refused connection is a dead process, out at
once. One whose restarts are used up (every call fails at once with ActorDiedError, twice in a row: a call in
flight when a process dies fails once too) is replaced by a new actor with the same spec, so the cluster keeps its
shape; when a replacement dies before it ever served (a start that fails every time: a bad model path, no
memory), the next one waits, 10 s doubling up to 5 minutes, as Kubernetes backs off a crash loop. So is one that
drained (its state raises WorkerDrainedError): a drain means restart, and it costs the slot
none of Ray's restarts. A slot the fleet scales away (`leaving`) is neither restarted nor replaced: the scaler
drains it and drops it, and a new actor that was under way for it meanwhile is killed as it comes. No error of one
actor ends the loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.addresses import split_host_port
from pdserve.cluster.actor_calls import ActorCall, answer
from pdserve.cluster.actors import actor_error_reason
from pdserve.cluster.drain import WorkerDrainedError
from pdserve.cluster.worker_spec import WorkerSpec
from pdserve.protocol.roles import Role
from pdserve.registry.base import Registry, WorkerState
from pdserve.registry.memory import InMemoryPrefixIndex

log = logging.getLogger(__name__)
CHECK_TIMEOUT_S = 1.0  # an actor's state() is cheap: one that takes longer is restarting, or stuck
KNOCK_TIMEOUT_S = 0.25  # a port that neither accepts nor refuses by then: the state check decides
DEAD_AFTER = 2  # ActorDiedErrors in a row that mean the actor is dead for good
STUCK_AFTER = 2  # checks in a row without an answer that mean stuck (one alone: often a CPU-starved moment)
REPLACE_BACKOFF_S = (10.0, 300.0)  # first and longest wait before replacing a replacement that never served


class _LinkLost(Exception):
    """A check failed because this process lost its connection to Ray, not because of the actor."""


def _kill(actor: Any) -> None:
    import ray

    ray.kill(actor, no_restart=True)


@dataclass
class Slot:
    """One worker the cluster wants, and the actor filling it now."""

    spec: WorkerSpec
    actor: Any
    listed: bool = False  # in placement: its last check succeeded
    address: str = ""  # host:port of its gRPC server, as its last state said
    instance: str = ""  # its process's, as its last state said: an actor Ray restarted in place has a new one
    died: int = 0  # ActorDiedErrors in a row
    timeouts: int = 0  # checks in a row that got no answer in time
    silent_since: float = 0.0  # when the first of those checks asked (the supervisor's clock)
    replacements: int = 0
    backoff_s: float = 0.0  # the wait before replacing a replacement that dies unserved; 0 once its actor served
    replace_at: float = 0.0  # set while backing off: no replacement before this time (the supervisor's clock)
    leaving: bool = False  # scaled down: draining for good, never restarted or replaced
    draining: bool = False  # a rollout's drain (a restart) under way: out of service, though its check may pass
    said_draining: bool = False  # its last state said draining (`pdserve drain`, a SIGTERM, a rollout's drain)
    prefix_lost: bool = False  # its last prefix-cache take never reached the index: the next must be whole


class Supervisor:
    """`publish`: the launcher keeps the (embedded) registry current itself; with Redis the workers heartbeat
    and the supervisor only removes the ones it finds gone, which beats waiting for their key's TTL."""

    def __init__(
        self,
        registry: Registry,
        publish: bool,
        new_actor: Callable[[WorkerSpec], Any],
        on_replaced: Callable[[WorkerSpec], None] = lambda spec: None,
        check_timeout_s: float = CHECK_TIMEOUT_S,
        kill: Callable[[Any], None] = _kill,
        clock: Callable[[], float] = time.monotonic,
        connected: Callable[[], bool] = lambda: True,
        prefix_index: InMemoryPrefixIndex | None = None,
        call: ActorCall = answer,
    ) -> None:
        self.registry = registry
        self.prefix_index = prefix_index  # embedded: the workers' prefix-cache journals go there (Redis: heartbeats)
        self.publish = publish
        self.new_actor = new_actor
        self.on_replaced = on_replaced
        self.check_timeout_s = check_timeout_s
        self.kill = kill
        self.clock = clock
        self.connected = connected  # this process's own link to Ray: its loss is no worker's failure
        self.call = call
        self.slots: dict[str, Slot] = {}
        self._answered_at = float("-inf")  # when an actor last answered its check: the link to Ray then worked
        self.passed_at: float | None = None  # when `run` last ended a pass (its clock): the controller's liveness
        # Actors being made on threads, and those made that no slot took yet: a supervision cancelled meanwhile
        # never takes them, and whoever stops the workers must (`orphans`).
        self._made = threading.Condition()
        self._making = 0
        self._unclaimed: list[Any] = []

    async def run(self, interval_s: float) -> None:
        """Checks every slot each `interval_s`, each on its own: a slot busy making a new actor (seconds, while Ray
        frees its name) holds up neither the other workers' checks nor, with the embedded registry, their
        republishing, without which they would drop out of placement after its TTL."""
        checking: dict[str, asyncio.Task[None]] = {}
        try:
            while True:
                for worker_id, slot in list(self.slots.items()):
                    task = checking.get(worker_id)
                    if task is None or task.done():
                        checking[worker_id] = asyncio.ensure_future(self._reported(slot))
                for worker_id in [w for w, t in checking.items() if t.done() and w not in self.slots]:
                    del checking[worker_id]
                self.passed_at = self.clock()
                await asyncio.sleep(interval_s)
        finally:
            for task in checking.values():
                task.cancel()

    async def check_all(self) -> None:
        """One check of every slot, together, returning once the slowest is done: a pass of `run`'s checks that a
        caller can wait for (`run` itself never waits on a slow slot, so tests step through passes with this)."""
        await asyncio.gather(*(self._reported(s) for s in list(self.slots.values())))

    async def _reported(self, slot: Slot) -> None:
        try:
            await self._check(slot)
        except Exception as e:  # a bug in the check itself: reported, and the loop goes on
            log.error("worker check failed: %r", e, exc_info=e)

    async def _check(self, slot: Slot) -> None:
        from ray.exceptions import ActorDiedError

        if slot.actor is None:  # its replacement could not be made: tried again, backing off (unless scaled away)
            if not slot.leaving:
                await self._replace(slot, RuntimeError("no actor: its replacement could not be created"))
            return
        if slot.listed and not await _port_open(slot.address):
            await self._unlist(slot, f"its port {slot.address} refuses connections")
        asked = self.clock()
        try:
            state = await self._state(slot)
        except _LinkLost:  # every call fails now: the process ends (controller.py), the workers serve on
            return
        except ActorDiedError as e:
            slot.died += 1
            await self._unlist(slot, "its actor died")
            if slot.died >= DEAD_AFTER and not slot.leaving:
                await self._replace(slot, e)
            return
        except TimeoutError:
            if not slot.timeouts:
                slot.silent_since = asked
            slot.died, slot.timeouts = 0, slot.timeouts + 1
            # Stuck, when another actor answered meanwhile; when none did, this process lost Ray or the CPU
            # (a Ray Client's head gone hangs every call for its reconnect grace): nobody leaves for that.
            stuck = slot.timeouts >= STUCK_AFTER and self._answered_at > slot.silent_since
            if stuck and self._another_listed(slot):
                await self._unlist(slot, f"no answer within {self.check_timeout_s:g}s (restarting, or stuck)")
            return
        except Exception as e:  # starting, leaving (its engine died, or drained), or an error of its own
            slot.died = 0
            await self._unlist(slot, actor_error_reason(e))
            if isinstance(getattr(e, "cause", None) or e, WorkerDrainedError) and not slot.leaving:
                await self._restart_drained(slot)
            return
        slot.died = slot.timeouts = 0
        self._answered_at = max(self._answered_at, self.clock())
        slot.backoff_s = slot.replace_at = 0.0  # it serves: a later death is replaced at once
        slot.address, slot.instance, slot.said_draining = state.address, state.instance, state.draining
        if self.publish and self.slots.get(slot.spec.worker_id) is slot:  # not one scaled away during the check
            self.registry.publish(state)
            await self._index_prefix_changes(slot, state)
        if not slot.listed:
            log.info("worker %s in placement at %s", slot.spec.worker_id, state.address)
            slot.listed = True

    def _another_listed(self, slot: Slot) -> bool:
        """A check that times out (the port still accepts) is as likely this process starved of CPU as the worker
        stuck: the last worker of a role in placement stays there on that alone (the router's first-token and stall
        bounds cover one truly stuck), since taking it out fails every request at once."""
        return any(s is not slot and s.listed and s.spec.role == slot.spec.role for s in self.slots.values())

    async def _index_prefix_changes(self, slot: Slot, state: WorkerState) -> None:
        """What the worker's prefix cache keyed and evicted since the last check, into the router's prefix index."""
        if self.prefix_index is None or slot.spec.role == Role.DECODE:  # a decode worker caches no prefixes
            return
        try:
            take = slot.actor.take_prefix_changes
            changes = await self.call(take, slot.prefix_lost, timeout_s=self.check_timeout_s, task_events=False)
        except Exception as e:  # a lost take: the next one is the whole cache
            if not slot.prefix_lost:  # once per run of failures (an actor of a build without the method: each check)
                log.warning("prefix-cache changes of %s not taken: %r", slot.spec.worker_id, e)
            slot.prefix_lost = True
            return
        slot.prefix_lost = False
        if changes is not None:
            self.prefix_index.apply(state.cache_key, changes)

    async def _state(self, slot: Slot) -> Any:
        """The actor's state, within the check's timeout."""
        try:
            return await self.call(slot.actor.state, timeout_s=self.check_timeout_s, task_events=False)
        except Exception as e:
            if not isinstance(e, TimeoutError) and not self.connected():
                raise _LinkLost from e
            raise

    async def _unlist(self, slot: Slot, why: str) -> None:
        if not slot.listed:
            return
        slot.listed = False
        log.warning("worker %s left placement: %s", slot.spec.worker_id, why)
        # Only the process its last state named: one Ray restarted while this process was frozen (SIGSTOP, a stalled
        # VM) listed itself in Redis already, and deleting its entry hid it from every router until its next beat.
        if self.publish:
            self.registry.remove(slot.spec.worker_id, slot.instance)
        else:  # Redis: a blocking call, off the loop; the worker's own heartbeat re-adds it if it is alive
            try:
                await asyncio.to_thread(self.registry.remove, slot.spec.worker_id, slot.instance)
            except Exception as e:  # Redis down: its key's TTL removes it
                log.warning("could not remove worker %s from the registry: %r", slot.spec.worker_id, e)

    async def _replace(self, slot: Slot, error: BaseException) -> None:
        now = self.clock()
        if slot.backoff_s and not slot.replace_at:  # the last replacement never served
            slot.replace_at = now + slot.backoff_s
            log.error(
                "worker %s has not served since its last replacement (%s); the next replacement in %g s",
                *(slot.spec.worker_id, actor_error_reason(error), slot.backoff_s),
            )
        if now < slot.replace_at:
            return
        slot.replacements += 1
        log.error(
            "worker %s is dead for good (its restarts are used up: %s); replacing it with a new actor (replacement %d)",
            *(slot.spec.worker_id, actor_error_reason(error), slot.replacements),
        )
        first, longest = REPLACE_BACKOFF_S
        slot.backoff_s, slot.replace_at = min(longest, max(first, 2 * slot.backoff_s)), 0.0
        if await self._new_actor(slot):  # its name still held, Ray unreachable: the next check tries again
            slot.died = 0
            self.on_replaced(slot.spec)

    async def _restart_drained(self, slot: Slot) -> None:
        log.warning("worker %s drained; a new actor takes its place", slot.spec.worker_id)
        await asyncio.to_thread(self.kill, slot.actor)  # a Ray Client's kill waits for the head: off the loop
        await self._new_actor(slot)  # none made: the next check replaces it, as a dead one

    async def _new_actor(self, slot: Slot) -> bool:
        """Puts a new actor in `slot`; False when none came. The wait (up to seconds, for the old name) leaves the
        slot without an actor, unlisted: a scale-down may take it away meanwhile, and then the new actor is killed
        here, since no one else would ever see it (a detached one would serve on, unsupervised)."""
        slot.actor = None  # the old actor's handle goes first: Ray frees its name (the worker id) only then
        slot.address = ""  # the new one has served nowhere yet
        try:
            actor = await asyncio.to_thread(self._make, slot.spec)  # may wait for the name, off the loop
        except Exception as e:
            log.error("worker %s: no new actor (%s); trying again", slot.spec.worker_id, actor_error_reason(e))
            return False
        with self._made:
            handed_over = actor not in self._unclaimed  # to a stop, which kills it
            if not handed_over:
                self._unclaimed.remove(actor)
        if handed_over:
            return False
        if slot.leaving:
            log.warning(
                "worker %s was scaled away while its new actor was made; stopping that actor", slot.spec.worker_id
            )
            try:
                await asyncio.to_thread(self.kill, actor)
            except Exception as e:  # gone already
                log.info("kill: %r", e)
            return False
        slot.actor = actor
        return True

    def _make(self, spec: WorkerSpec) -> Any:
        """On a thread: `new_actor`, kept among the unclaimed until the slot takes it."""
        with self._made:
            self._making += 1
        try:
            actor = self.new_actor(spec)
            with self._made:
                self._unclaimed.append(actor)
            return actor
        finally:
            with self._made:
                self._making -= 1
                self._made.notify_all()

    def orphans(self, timeout_s: float) -> list[Any]:
        """Blocks until no actor is being made (at most `timeout_s`), then hands over the ones made that no slot
        took: the supervision ended while they were made, and a detached one would serve on, unsupervised."""
        with self._made:
            self._made.wait_for(lambda: self._making == 0, timeout_s)
            orphans, self._unclaimed = self._unclaimed, []
        return orphans


async def _port_open(address: str) -> bool:
    """False only when the port refuses connections (nothing listens: the process is gone)."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(*split_host_port(address)), KNOCK_TIMEOUT_S)
    except (ConnectionRefusedError, ValueError):
        return False
    except (TimeoutError, OSError):  # slow or unreachable, not refused: not proof of death
        return True
    writer.close()
    return True
