"""The worker fleet: the actors a cluster wants, started (or found again), supervised, scaled to the registry's
desired counts, and stopped or left running.

`pdserve controller` runs this alone, with Redis; `pdserve up` runs it beside a router in the same process.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

from pdserve.build import current_build
from pdserve.cluster.actor_calls import answer
from pdserve.cluster.actors import WorkerActors, actor_error_reason
from pdserve.cluster.factories import WorkerServices
from pdserve.cluster.ray_join_check import TokenRefused
from pdserve.cluster.rollout import Rollout
from pdserve.cluster.scaling import START_TIMEOUT_S, FleetScaler, drain_over_rpc
from pdserve.cluster.supervisor import REPLACE_BACKOFF_S, Slot, Supervisor
from pdserve.cluster.worker_runtime import EXIT_GRACE_S
from pdserve.cluster.worker_spec import WorkerSpec
from pdserve.config import ClusterConfig
from pdserve.protocol.roles import Role
from pdserve.registry.base import Registry, WorkerState
from pdserve.registry.memory import InMemoryPrefixIndex

log = logging.getLogger(__name__)
SPEC_TIMEOUT_S = 5.0  # an actor answers what it was asked to be at once, unless it is restarting
STOP_CHECK_S = 1.0  # how long a start waits on Ray between looks at whether the process is stopping
ORPHAN_WAIT_S = 30.0  # a stop waits this long for an actor being made (Ray frees the old one's name first)
# A Ray cluster a controller joins that does not answer (its head restarting: a pod rescheduled, the GCS reloading
# its tables) is tried again for this long, JOIN_RETRY_S after each failed try (a Ray Client's try takes its 30 s
# connection timeout), before the process gives up (and its Deployment restarts it, backing off). A controller's
# wait for its Redis comes out of the same window (controller.py), so the chart's startup probe allows one.
JOIN_WINDOW_S = 300.0
JOIN_RETRY_S = 5.0


class StartStopped(Exception):
    """The process was told to stop while its workers started."""


class WorkerStartError(RuntimeError):
    """A worker never served: its starts failed past their restarts, or no node took it in time."""


def _client_server_failed_to_start(e: ConnectionError) -> bool:
    """Whether a Ray Client join failed because the head's proxier could not start this client's own server (a
    race in Ray's proxier: the process it started read as a zombie, or exited at once): the next try gets another
    server, so even a first join tries again. Ray raises it as ConnectionAbortedError, which `WorkerActors.connect`
    words as a join failure of ours (its cause)."""
    cause = e.__cause__ if e.__cause__ is not None else e
    return isinstance(cause, ConnectionAbortedError) and "Initialization failure" in str(cause)


def _refused_as_asked(e: ConnectionError) -> bool:
    """Whether Ray refused the join for what it was asked (an address it cannot parse, no auth token where the
    cluster wants one, a token the head refuses): no later try differs, so a join that tries a Ray that does not answer
    again (a controller's) fails at once instead of for JOIN_WINDOW_S. `WorkerActors.connect` words Ray's error as a
    join failure of ours (its cause)."""
    from ray.exceptions import AuthenticationError

    return isinstance(e.__cause__, (ValueError, AuthenticationError, TokenRefused))


class Cluster:
    """`publish`: keep `registry` current for the workers (the embedded registry); with Redis the workers
    heartbeat themselves and the supervisor only removes the ones it finds gone."""

    def __init__(
        self,
        config: ClusterConfig,
        workers: WorkerServices,
        registry: Registry,
        publish: bool,
        prefix_index: InMemoryPrefixIndex | None = None,
    ) -> None:
        self.config = config
        self.registry = registry
        self.actors = WorkerActors(config, workers)
        self.stopping = threading.Event()  # set once: every start in progress gives up
        self.supervisor = Supervisor(
            registry,
            publish=publish,
            new_actor=self.actors.create,
            connected=self.actors.connected,
            prefix_index=prefix_index,
        )
        drain_s = config.worker_drain_timeout_s
        self.scaler = FleetScaler(
            registry,
            self.supervisor,
            tuple(dict.fromkeys(config.roles)),
            self.spec,
            lambda spec: self.actors.get_or_create(spec)[0],  # one left serving under this name is adopted
            self._await_start,
            partial(drain_over_rpc, timeout_s=drain_s),
            self.actors.kill,
            publish,
            dict(Counter(config.roles)),
        )
        surge = partial(self.scaler.surge, placement_wait_s=config.rollout_surge_wait_s)
        drain = partial(drain_over_rpc, timeout_s=drain_s)
        self.rollout = Rollout(self.supervisor, _requested_spec, drain, surge, _set_log_level)

    def spec(self, role: Role, worker_id: str) -> WorkerSpec:
        c = self.config
        return WorkerSpec(
            role,
            c.worker_engine(),
            c.host,
            c.worker_port,
            worker_id,
            c.redis_url,
            c.router.heartbeat_s,
            metrics_port=c.worker_metrics_port,
            log_level=c.log_level,
            kv_transfer_timeout_s=c.kv_transfer_timeout_s,
            drain_timeout_s=c.worker_drain_timeout_s,
            speed_recheck_idle_s=c.speed_recheck_idle_s,
            speed_recheck_s=c.speed_recheck_s,
            exit_on_fatal=True,
            advertise_host=c.advertise_host or "",
            transfer_port=c.transfer_port,
            build=current_build(),
        )

    def specs(self) -> list[WorkerSpec]:
        return [self.spec(role, f"{role}-{i}") for i, role in enumerate(self.config.roles)]

    def starting_specs(self, found: list[str]) -> list[WorkerSpec]:
        """Every worker `found` in the Ray namespace (a restarted controller adopts them whatever ids a scale or a
        rollout gave them, and those of the other mode's roles, to drain away), then the flags' own for a role with
        fewer than its desired count (a live scale's, kept across the restart, else the flags'): a role scaled down
        is not started back up only for the scaler to drain it. The scaler then brings each role to its desired
        count."""
        specs = [self.spec(Role(worker_id.rpartition("-")[0]), worker_id) for worker_id in found]
        have, desired = Counter(s.role for s in specs), self.registry.desired_counts() or Counter(self.config.roles)
        for spec in self.specs():
            if spec.worker_id not in found and have[spec.role] < desired.get(spec.role, 0):
                specs.append(spec)
                have[spec.role] += 1
        return specs

    def start_workers(self, fail_fast: bool = False) -> None:
        """Records the fleet's desired counts (what `pdserve scale` changes), creates each worker's actor or finds it
        in the Ray namespace (a restarted controller), and waits until every one serves or fails to. One that fails
        stays out of placement for the supervisor to replace, backing off: a controller that exited instead would
        be restarted, fail on the same worker again, and leave the healthy ones unsupervised meanwhile. With
        `fail_fast` (`pdserve up`, whose user waits on the start) it raises instead."""
        self._init_desired_counts()
        self.actors.connect()
        in_namespace = self.actors.found_worker_ids() if self.actors.detached else []
        found: set[str] = set()
        for spec in self.starting_specs(in_namespace):
            self._raise_if_stopping()
            actor, existed = self.actors.get_or_create(spec)
            # A role of the other mode's fleet: it serves until this fleet's do, then drains away (FleetScaler).
            self.supervisor.slots[spec.worker_id] = Slot(spec, actor, leaving=spec.role not in self.config.roles)
            if existed:
                found.add(spec.worker_id)
        for worker_id, slot in self.supervisor.slots.items():
            try:
                state = self._await_start(slot)
            except StartStopped:
                raise
            except Exception as e:
                if fail_fast:
                    raise
                log.error("%s; the supervisor replaces it, backing off", e)
                slot.backoff_s = REPLACE_BACKOFF_S[0]  # as a replacement that never served
                continue
            self.registry.publish(state)
            slot.listed, slot.address = True, state.address
            how = f"found running in Ray namespace {self.config.ray_namespace}" if worker_id in found else "started"
            log.info("worker %s ready at %s (%s)", worker_id, state.address, how)
            log.info("worker %s metrics at %s", worker_id, state.metrics_address)

    def _init_desired_counts(self) -> None:
        """The flags' counts, unless the fleet joined a Ray cluster whose registry holds counts that `pdserve scale`
        set since a fleet with these same flags started: those outlive the process, as its detached actors do (a
        restarted controller keeps a live scale). Other flags (a new revision's) apply, as a rollout would."""
        own = dict(Counter(self.config.roles))
        if self.actors.detached:
            kept, flags = self.registry.desired_counts(), self.registry.flag_counts()
            if kept and set(kept) == set(own) and flags == own:
                log.info("desired worker counts %s, kept from the registry (the flags ask for %s)", kept, own)
                return
            if kept:
                log.info("desired worker counts %s from the flags, which changed (the registry held %s)", own, kept)
        self.registry.set_desired_counts(own, from_flags=True)

    def _await_start(self, slot: Slot, timeout_s: float = START_TIMEOUT_S) -> WorkerState:
        """The worker's state once it serves. A failed start is logged with its reason, and Ray restarts the
        worker (it exits); when its restarts are used up, or it does not serve within `timeout_s` (an actor no node
        can host waits for one forever), starting fails instead of waiting forever."""
        from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

        worker_id, failures, died = slot.spec.worker_id, 0, 0
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._get(slot.actor.wait_ready.remote(), deadline)
                return self._get(slot.actor.state.remote(), deadline)
            except StartStopped:
                raise
            except GetTimeoutError:
                raise WorkerStartError(
                    f"worker {worker_id} did not serve within {timeout_s:g} s (no node for it?)"
                ) from None
            except ActorUnavailableError:  # Ray is restarting it
                time.sleep(0.5)
            except RayActorError as e:  # its process died; twice in a row at once: dead for good
                died += 1
                log.error("worker %s died while starting: %s", worker_id, actor_error_reason(e))
                if died >= 2:
                    raise WorkerStartError(f"worker {worker_id} could not be started: {actor_error_reason(e)}") from e
            except Exception as e:  # its start failed with this reason; it exits and Ray restarts it
                died, failures = 0, failures + 1
                log.error("worker %s failed to start (attempt %d): %s", worker_id, failures, actor_error_reason(e))
                if failures > self.config.max_restarts:
                    raise WorkerStartError(
                        f"worker {worker_id} failed to start {failures} times: {actor_error_reason(e)}"
                    ) from e
                time.sleep(2 * EXIT_GRACE_S)  # until the failed process is gone, not to ask it again

    def _get(self, ref: Any, deadline: float) -> Any:
        """`ray.get(ref)` by `deadline` (else GetTimeoutError), in slices so that a stop ends the wait."""
        import ray
        from ray.exceptions import GetTimeoutError

        while True:
            self._raise_if_stopping()
            left = deadline - time.monotonic()
            try:
                return ray.get(ref, timeout=min(max(left, 0.0), STOP_CHECK_S))
            except GetTimeoutError:
                if left <= STOP_CHECK_S:
                    raise

    def _raise_if_stopping(self) -> None:
        if self.stopping.is_set():
            raise StartStopped("the process is stopping")

    async def connect_until(self, stop: asyncio.Event, retry_join: bool = False, deadline: float | None = None) -> bool:
        """Connects to Ray (starting a local one), which cannot be interrupted; `retry_join`: tries a joined one
        again while it does not answer, until `deadline` (monotonic; default JOIN_WINDOW_S on; each try takes Ray's
        own connection timeout, 30 s for a Ray Client). False, disconnected again, when `stop` was set meanwhile.
        The caller takes its signals back after (`router_process.stop_signal`)."""
        deadline = time.monotonic() + JOIN_WINDOW_S if deadline is None else deadline
        while True:
            try:
                await asyncio.to_thread(self.actors.connect)
                break
            except ConnectionError as e:  # Ray Client's errors, and a GCS that does not answer
                retried = (retry_join and not _refused_as_asked(e)) or _client_server_failed_to_start(e)
                if not retried or time.monotonic() > deadline:
                    raise
                log.warning(
                    "Ray at %s: %s; trying again in %g s", self.config.ray_address, actor_error_reason(e), JOIN_RETRY_S
                )
                try:
                    await asyncio.wait_for(stop.wait(), JOIN_RETRY_S)
                except TimeoutError:
                    continue
                return False
        if stop.is_set():
            await asyncio.to_thread(self.actors.disconnect)
            return False
        return True

    async def start_until(self, stop: asyncio.Event, end: Callable[[], None], fail_fast: bool = False) -> bool:
        """`start_workers` on a thread, unless `stop` is set first (SIGTERM while the workers start): then the start
        gives up within STOP_CHECK_S (or once Ray is connected) and `end` (`stop_workers`, `leave_workers`) runs
        on what it started. False when stopped; a failed start runs `end` too, then raises."""
        starting = asyncio.ensure_future(asyncio.to_thread(self.start_workers, fail_fast))
        signalled = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait((starting, signalled), return_when=asyncio.FIRST_COMPLETED)
        finally:
            signalled.cancel()
        if stop.is_set():
            self.stopping.set()
        try:
            await starting
        except BaseException:
            await asyncio.to_thread(end)
            if stop.is_set():
                return False
            raise
        if stop.is_set():
            await asyncio.to_thread(end)
            return False
        return True

    @property
    def check_interval_s(self) -> float:
        """How often the supervision checks every worker: as often as the workers heartbeat."""
        return self.config.router.heartbeat_s

    async def watch(self) -> None:
        """Supervises the worker actors, scales them to the desired counts and rolls adopted ones onto this fleet's
        spec until cancelled (see `Supervisor`, `FleetScaler`, `Rollout`)."""
        await asyncio.gather(self.supervisor.run(self.check_interval_s), self.scaler.run(), self.rollout.run())

    async def supervise_until(self, stop: asyncio.Event) -> bool:
        """`watch` until `stop` is set (True), or until this process's connection to Ray is gone for good (False:
        every Ray call fails from then on, so nothing is supervised; the detached actors serve on). Supervision
        that fails raises here: a process serving on unsupervised would look healthy and heal nothing."""
        watcher = asyncio.create_task(self.watch())
        stopped, lost = asyncio.create_task(stop.wait()), asyncio.create_task(self.actors.until_disconnected())
        try:
            done, _ = await asyncio.wait([stopped, lost, watcher], return_when=asyncio.FIRST_COMPLETED)
            if watcher in done:
                watcher.result()  # its error
                raise RuntimeError("worker supervision ended on its own")
            return lost not in done
        finally:
            for task in (watcher, stopped, lost):
                task.cancel()

    async def rejoin(self, stop: asyncio.Event) -> bool:
        """After this process's link to a joined Ray was lost: joins again, trying while the head is away, and takes
        up the workers as a start does (those that outlived the head found by name, any missing started). False
        when `stop` was set meanwhile."""
        self.supervisor.slots.clear()  # handles of the lost connection
        self.scaler.starting.clear()
        await asyncio.to_thread(self.actors.disconnect)
        while True:
            try:
                if not await self.connect_until(stop, retry_join=True):
                    return False
                break
            except ConnectionError as e:
                if _refused_as_asked(e):  # tried again at once, for ever
                    raise
                log.warning("Ray at %s: %s; still trying", self.config.ray_address, actor_error_reason(e))
        return await self.start_until(stop, self.stop_workers)

    def stop_workers(self) -> None:
        import ray

        self.stopping.set()
        for slot in [*self.supervisor.slots.values(), *self.scaler.starting.values()]:
            if slot.actor is None:
                continue
            if slot.address:  # it served: its server stops cleanly (one still starting would hold this up)
                try:
                    ray.get(slot.actor.stop.remote(), timeout=30)
                except Exception as e:  # dead already, or stuck: killed below either way
                    log.warning("worker did not stop cleanly: %r", e)
            self.actors.kill(slot.actor)
        self.supervisor.slots.clear()
        for actor in self.supervisor.orphans(timeout_s=ORPHAN_WAIT_S):  # made while the supervision ended
            self.actors.kill(actor)
        if self.actors.started_ray:
            self.actors.disconnect()

    def leave_workers(self) -> None:
        """Ends this process's part and leaves the (detached) actors serving, for the next controller to find."""
        names = ", ".join(self.supervisor.slots)
        log.info("leaving workers %s running in Ray namespace %s", names, self.config.ray_namespace)
        self.supervisor.slots.clear()
        self.actors.disconnect()


async def _requested_spec(actor: Any) -> WorkerSpec | None:
    """None from an actor made by a pdserve that could not tell (it has no `requested_spec`)."""
    try:
        method = actor.requested_spec
    except AttributeError:
        return None
    return await answer(method, timeout_s=SPEC_TIMEOUT_S)


async def _set_log_level(actor: Any, level: str | None) -> bool:
    """False from an actor made by a pdserve that cannot (it has no `set_log_level`)."""
    try:
        method = actor.set_log_level
    except AttributeError:
        return False
    await answer(method, level, timeout_s=SPEC_TIMEOUT_S)
    return True
