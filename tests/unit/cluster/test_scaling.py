"""The fleet's scaler against stand-ins for Ray actor handles: which ids new workers get, which worker leaves, that a
new worker is listed only once it serves, that a leaving one drains, is killed and is not brought back, and that no
role goes below one worker."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import pytest

from pdserve.cluster.rollout import Rollout
from pdserve.cluster.scaling import next_worker_id, pick_leaving
from pdserve.cluster.supervisor import Slot
from pdserve.cluster.worker_spec import WorkerSpec
from pdserve.protocol.roles import Role
from pdserve.registry.base import WorkerState
from tests.unit.cluster.fleet_harness import Fleet, StandInActor, spec, until

pytestmark = pytest.mark.timeout(30)


def test_new_ids_follow_the_highest_index_in_use_across_roles() -> None:
    assert next_worker_id(Role.PREFILL, {"prefill-0", "decode-1"}) == "prefill-2"
    assert next_worker_id(Role.DECODE, {"prefill-0", "decode-1", "prefill-2"}) == "decode-3"
    assert next_worker_id(Role.COLOCATED, set()) == "colocated-0"


def test_the_least_loaded_worker_leaves_and_on_a_tie_the_newest() -> None:
    slots = [Slot(spec(Role.DECODE, i), None, listed=True) for i in ("decode-1", "decode-2", "decode-3")]
    states = {i: WorkerState(i, Role.DECODE, "", running=r) for i, r in (("decode-1", 0), ("decode-2", 3))}
    states["decode-3"] = WorkerState("decode-3", Role.DECODE, "", running=1)
    assert [s.spec.worker_id for s in pick_leaving(slots, states, 1)] == ["decode-1"]
    states["decode-3"] = WorkerState("decode-3", Role.DECODE, "", running=0)
    assert [s.spec.worker_id for s in pick_leaving(slots, states, 2)] == ["decode-3", "decode-1"]


def test_workers_out_of_service_leave_first_and_the_last_one_in_service_never() -> None:
    slots = [Slot(spec(Role.DECODE, i), None, listed=True) for i in ("decode-1", "decode-2", "decode-3")]
    states = {s.spec.worker_id: WorkerState(s.spec.worker_id, Role.DECODE, "", running=3) for s in slots}
    slots[0].listed = False  # restarting: no state, so it reads as idle
    states["decode-1"] = None
    states["decode-2"] = WorkerState("decode-2", Role.DECODE, "", running=5, draining=True)  # `pdserve drain`
    assert [s.spec.worker_id for s in pick_leaving(slots, states, 3)] == ["decode-1", "decode-2"]
    states["decode-2"] = WorkerState("decode-2", Role.DECODE, "", running=5)
    slots[1].draining = True  # a rollout's drain, not yet in its state
    assert [s.spec.worker_id for s in pick_leaving(slots, states, 3)] == ["decode-1", "decode-2"]
    slots[1].draining = False
    assert [s.spec.worker_id for s in pick_leaving(slots, states, 1)] == ["decode-1"]
    assert [s.spec.worker_id for s in pick_leaving(slots, states, 3)] == ["decode-1", "decode-3"]


async def test_a_scale_down_removes_a_restarting_worker_rather_than_the_only_working_one() -> None:
    fleet = Fleet({"prefill-0": 0, "decode-1": 0, "decode-2": 0})

    async def not_started() -> WorkerState:  # Ray restarting it, or its replacement crash-looping
        raise RuntimeError("worker decode-1 is not started")

    fleet.supervisor.slots["decode-1"].actor.state.answer = not_started
    await fleet.supervisor.check_all()
    fleet.registry.set_desired_counts({Role.PREFILL: 1, Role.DECODE: 1})
    await fleet.scaler.reconcile()
    await fleet.scaler.settle()
    assert fleet.drained == ["decode-1"] and fleet.killed == ["decode-1"]
    assert fleet.ids() == ["decode-2", "prefill-0"] and fleet.listed() == ["decode-2", "prefill-0"]


async def test_a_scale_down_during_a_rollouts_drain_never_drains_the_roles_other_worker() -> None:
    fleet = Fleet({"prefill-0": 0, "decode-1": 4, "decode-2": 0})
    release = asyncio.Event()

    async def rollout_drain(slot: Slot) -> None:  # its long streams finish meanwhile
        await release.wait()

    async def spec_of(actor: StandInActor) -> WorkerSpec:  # decode-1 runs an earlier spec
        return replace(actor.spec, log_level="DEBUG") if actor.spec.worker_id == "decode-1" else actor.spec

    async def no_surge(slot: Slot) -> bool:
        return False

    rollout = Rollout(fleet.supervisor, spec_of, rollout_drain, no_surge)
    step = asyncio.create_task(rollout.step())
    await asyncio.sleep(0.05)
    fleet.registry.set_desired_counts({Role.PREFILL: 1, Role.DECODE: 1})
    await fleet.scaler.reconcile()
    await fleet.scaler.settle()
    assert fleet.drained == ["decode-1"] and fleet.killed == ["decode-1"]  # the one already leaving service goes
    assert fleet.ids() == ["decode-2", "prefill-0"] and fleet.listed() == ["decode-2", "prefill-0"]
    release.set()
    assert await step == "decode-1"


async def test_a_new_actor_made_while_a_scale_down_drops_its_slot_is_killed_not_left_serving() -> None:
    fleet = Fleet({"prefill-0": 0, "decode-1": 0, "decode-2": 5})
    asked, made_free = threading.Event(), threading.Event()
    made: list[StandInActor] = []
    killed: list[StandInActor | None] = []

    def slow_new_actor(s: WorkerSpec) -> StandInActor:  # Ray still freeing the drained actor's name
        asked.set()
        made_free.wait(5)
        made.append(StandInActor(s))
        return made[-1]

    async def port_closed(slot: Slot) -> None:
        raise ConnectionError("the drained worker's port refuses connections")

    fleet.supervisor.new_actor, fleet.scaler.drain = slow_new_actor, port_closed
    fleet.supervisor.kill = fleet.scaler.kill = killed.append
    drained = fleet.supervisor.slots["decode-1"].actor
    drained.drained = True  # a rollout drained it: the supervisor restarts it with a new actor
    check = asyncio.create_task(fleet.supervisor.check_all())
    await asyncio.to_thread(asked.wait, 5)
    fleet.registry.set_desired_counts({Role.PREFILL: 1, Role.DECODE: 1})
    await fleet.scaler.reconcile()  # decode-1, with no actor meanwhile, is out of service: it goes
    await fleet.scaler.settle()
    made_free.set()
    await check
    assert fleet.ids() == ["decode-2", "prefill-0"] and len(made) == 1
    assert killed == [drained, made[0]]  # the new actor too: no slot holds it


async def test_scaling_up_lists_each_new_worker_only_once_it_serves() -> None:
    fleet = Fleet({"prefill-0": 0, "decode-1": 0})
    fleet.registry.set_desired_counts({Role.PREFILL: 2, Role.DECODE: 3})
    await fleet.scaler.reconcile()
    await fleet.scaler.settle()
    assert sorted(fleet.started) == ["decode-3", "decode-4", "prefill-2"]  # ids given in the fleet's role order
    assert fleet.listed_while_starting == [False, False, False]
    assert len(fleet.ids()) == 5 and fleet.listed() == fleet.ids()
    await fleet.scaler.reconcile()  # at its counts: nothing more
    assert len(fleet.started) == 3 and not fleet.drained


async def test_scaling_down_drains_the_least_loaded_and_nothing_brings_it_back() -> None:
    fleet = Fleet({"prefill-0": 0, "decode-1": 4, "decode-2": 1, "decode-3": 2})
    fleet.registry.set_desired_counts({Role.PREFILL: 1, Role.DECODE: 1})
    await fleet.scaler.reconcile()
    await fleet.scaler.settle()
    assert sorted(fleet.drained) == ["decode-2", "decode-3"] and sorted(fleet.killed) == ["decode-2", "decode-3"]
    assert fleet.ids() == ["decode-1", "prefill-0"] and fleet.listed() == ["decode-1", "prefill-0"]
    assert fleet.registry.retired() == {"decode-2", "decode-3"}  # routers stop counting them as coming back
    await fleet.supervisor.check_all()
    assert fleet.replaced == [] and fleet.ids() == ["decode-1", "prefill-0"]  # the supervisor restarted nothing


async def test_no_role_goes_below_one_worker_and_other_modes_counts_are_ignored() -> None:
    fleet = Fleet({"prefill-0": 0, "decode-1": 0})
    fleet.registry.set_desired_counts({Role.PREFILL: 0, Role.DECODE: 1, Role.COLOCATED: 4})
    await fleet.scaler.reconcile()
    await fleet.scaler.settle()
    assert fleet.ids() == ["decode-1", "prefill-0"] and not fleet.started and not fleet.drained


async def test_a_worker_of_the_other_modes_fleet_serves_until_this_fleets_roles_do_then_drains_away() -> None:
    """A controller restarted as disaggregated adopted colocated-0 (`leaving`); routers place on colocated workers
    alone while one is listed. It once served on, unsupervised, holding its GPU for good."""
    fleet = Fleet({"colocated-0": 0, "prefill-1": 0, "decode-2": 0})
    fleet.registry.set_desired_counts({Role.PREFILL: 1, Role.DECODE: 1})
    fleet.supervisor.slots["colocated-0"].leaving = True  # as the fleet's start adopts it
    fleet.supervisor.slots["decode-2"].listed = False  # still loading its model
    scaling = asyncio.create_task(fleet.scaler.run(0.01))
    await asyncio.sleep(0.3)
    assert not fleet.drained and "colocated-0" in fleet.listed()  # still the one serving
    fleet.supervisor.slots["decode-2"].listed = True
    for _ in range(100):  # past ROUTERS_SEE_S
        if "colocated-0" not in fleet.supervisor.slots:
            break
        await asyncio.sleep(0.05)
    scaling.cancel()
    assert fleet.drained == ["colocated-0"] and fleet.killed == ["colocated-0"]
    assert fleet.ids() == ["decode-2", "prefill-1"] and fleet.listed() == ["decode-2", "prefill-1"]
    assert not fleet.started and not fleet.replaced


async def test_unknown_counts_keep_the_fleet_as_it_is() -> None:
    fleet = Fleet({"prefill-0": 0, "decode-1": 0})
    await fleet.scaler.reconcile()  # nothing set in the registry yet
    assert fleet.ids() == ["decode-1", "prefill-0"] and not fleet.started


async def test_a_worker_that_cannot_start_is_killed_and_tried_again_next_pass() -> None:
    fleet = Fleet({"prefill-0": 0, "decode-1": 0})
    attempts: list[str] = []

    def fails_once(slot: Slot) -> WorkerState:
        attempts.append(slot.spec.worker_id)
        if len(attempts) == 1:
            raise RuntimeError("its start failed")
        return slot.actor.worker_state()

    fleet.scaler.await_start = fails_once
    fleet.registry.set_desired_counts({Role.PREFILL: 2, Role.DECODE: 1})
    await fleet.scaler.reconcile()
    await fleet.scaler.settle()
    assert fleet.killed == ["prefill-2"] and fleet.ids() == ["decode-1", "prefill-0"]
    await fleet.scaler.reconcile()
    await asyncio.wait_for(fleet.scaler.settle(), 5)
    assert fleet.ids() == ["decode-1", "prefill-0", "prefill-2"] and not fleet.scaler.starting


async def test_a_start_no_longer_wanted_is_called_off_before_any_serving_worker_drains() -> None:
    fleet = Fleet({"prefill-0": 0, "decode-1": 0})
    release = asyncio.Event()
    loop = asyncio.get_running_loop()

    def slow_start(slot: Slot) -> WorkerState:
        asyncio.run_coroutine_threadsafe(release.wait(), loop).result()  # until its actor is killed, say
        return slot.actor.worker_state()

    fleet.scaler.await_start = slow_start
    fleet.registry.set_desired_counts({Role.PREFILL: 2, Role.DECODE: 1})
    await fleet.scaler.reconcile()  # never waits on the start
    assert list(fleet.scaler.starting) == ["prefill-2"]
    await until(lambda: fleet.scaler.starting["prefill-2"].actor is not None)  # made, waiting to serve
    fleet.registry.set_desired_counts({Role.PREFILL: 1, Role.DECODE: 1})
    await fleet.scaler.reconcile()
    await until(lambda: bool(fleet.killed))  # on a thread: its kill may take a while on a loaded host
    assert fleet.killed == ["prefill-2"] and not fleet.drained  # the one still starting goes, no drain
    release.set()
    await asyncio.wait_for(fleet.scaler.settle(), 5)
    assert fleet.ids() == ["decode-1", "prefill-0"] and not fleet.scaler.starting


async def test_a_start_that_never_serves_is_killed_after_the_start_timeout() -> None:
    fleet = Fleet({"prefill-0": 0, "decode-1": 0})
    fleet.scaler.start_timeout_s = 0.2
    never = threading.Event()
    fleet.scaler.await_start = lambda slot: never.wait(2) and slot.actor.worker_state()  # no node can host it
    fleet.registry.set_desired_counts({Role.PREFILL: 2, Role.DECODE: 1})
    await fleet.scaler.reconcile()
    await asyncio.wait_for(fleet.scaler.settle(), 5)
    assert fleet.killed == ["prefill-2"] and fleet.ids() == ["decode-1", "prefill-0"]


async def test_workers_loading_their_models_hold_none_of_asyncios_default_threads() -> None:
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(2))  # min(32, cores + 4) on a small host
    fleet = Fleet({"prefill-0": 0, "decode-1": 0})
    release = threading.Event()
    fleet.scaler.await_start = lambda slot: release.wait(10) and slot.actor.worker_state()
    fleet.registry.set_desired_counts({Role.PREFILL: 3, Role.DECODE: 3})
    await fleet.scaler.reconcile()
    await asyncio.sleep(0.2)
    assert len(fleet.scaler.starting) == 4
    await asyncio.wait_for(fleet.scaler.reconcile(), 2)  # its read of the counts, on the default pool, answers
    release.set()
    await asyncio.wait_for(fleet.scaler.settle(), 5)
    assert len(fleet.listed()) == 6


@pytest.mark.parametrize("phase", ["made", "loading"])
async def test_a_start_cancelled_as_the_fleet_stops_kills_its_actor(phase: str) -> None:
    fleet = Fleet({"prefill-0": 0, "decode-1": 0})
    reached, release = threading.Event(), threading.Event()

    def blocks(then: Callable[[], Any]) -> Callable[..., Any]:
        def wait(arg: Any) -> Any:
            reached.set()
            release.wait(5)
            return then(arg)

        return wait

    if phase == "made":  # Ray still freeing the name it wants
        fleet.scaler.create = blocks(StandInActor)
    else:  # its model loading
        fleet.scaler.await_start = blocks(lambda slot: slot.actor.worker_state())
    fleet.registry.set_desired_counts({Role.PREFILL: 1, Role.DECODE: 2})
    watcher = asyncio.create_task(fleet.scaler.run(0.05))
    await asyncio.to_thread(reached.wait, 5)
    watcher.cancel()  # `pdserve up` / `controller` stopping
    with pytest.raises(asyncio.CancelledError):
        await watcher
    release.set()
    for _ in range(100):
        if fleet.killed:
            break
        await asyncio.sleep(0.05)
    assert fleet.killed == ["decode-2"] and not fleet.scaler.starting and fleet.ids() == ["decode-1", "prefill-0"]


async def test_a_surge_lists_the_successor_before_the_worker_it_replaces_drains() -> None:
    fleet = Fleet({"prefill-0": 0, "decode-1": 2})
    fleet.registry.set_desired_counts({Role.PREFILL: 1, Role.DECODE: 1})
    listed_at_drain: list[list[str]] = []
    drain = fleet.drain

    async def drain_seen(slot: Slot) -> None:
        listed_at_drain.append(fleet.listed())
        await drain(slot)

    fleet.drain = fleet.scaler.drain = drain_seen
    surge = asyncio.create_task(fleet.scaler.surge(fleet.supervisor.slots["decode-1"], placement_wait_s=5))
    while not surge.done():  # scaling passes meanwhile neither call the successor off nor drain another
        await fleet.scaler.reconcile()
        await asyncio.sleep(0.01)
    assert surge.result() is True
    assert fleet.started == ["decode-2"] and fleet.drained == ["decode-1"] and fleet.killed == ["decode-1"]
    assert listed_at_drain == [["decode-1", "decode-2", "prefill-0"]]
    assert fleet.ids() == ["decode-2", "prefill-0"] and fleet.listed() == ["decode-2", "prefill-0"]


async def test_a_surge_whose_successor_cannot_start_leaves_the_worker_serving() -> None:
    fleet = Fleet({"prefill-0": 0, "decode-1": 0})

    def fails(slot: Slot) -> WorkerState:
        raise RuntimeError("no node has room for it")

    fleet.scaler.await_start = fails
    old = fleet.supervisor.slots["decode-1"]
    assert await fleet.scaler.surge(old, placement_wait_s=5) is False
    assert not old.leaving and fleet.killed == ["decode-2"] and not fleet.drained
    assert fleet.ids() == ["decode-1", "prefill-0"] and fleet.listed() == ["decode-1", "prefill-0"]


async def test_a_surge_no_node_takes_in_time_is_called_off_and_zero_never_surges() -> None:
    fleet = Fleet({"prefill-0": 0, "decode-1": 0})

    def unplaced(spec: WorkerSpec) -> StandInActor:
        actor = StandInActor(spec)
        actor.placed.clear()  # pending in Ray: no node has room for one more
        return actor

    fleet.scaler.create = unplaced
    old = fleet.supervisor.slots["decode-1"]
    assert await fleet.scaler.surge(old, placement_wait_s=0.2) is False
    assert fleet.killed == ["decode-2"] and fleet.started == [] and not old.leaving
    assert await fleet.scaler.surge(old, placement_wait_s=0) is False
    assert fleet.killed == ["decode-2"] and not fleet.scaler.starting  # nothing was made


async def test_desired_counts_the_registry_lost_are_written_back_and_a_newer_scale_kept() -> None:
    """A Redis restarted empty: the fleet writes back the last counts it read, unless a scale set new ones, and
    its flags' counts (a later controller with these flags keeps the scale, as before the restart)."""
    fleet = Fleet({"prefill-0": 0, "decode-1": 0, "decode-2": 0})
    fleet.registry.set_desired_counts({Role.PREFILL: 1, Role.DECODE: 2})
    await fleet.scaler.reconcile()
    fleet.registry.set_desired_counts({}, from_flags=True)  # the registry restarted empty
    await fleet.scaler.reconcile()
    assert fleet.ids() == ["decode-1", "decode-2", "prefill-0"] and not fleet.drained and not fleet.started
    assert fleet.registry.flag_counts() == {Role.PREFILL: 1, Role.DECODE: 2}
    fleet.registry.restore_desired_counts({Role.PREFILL: 9, Role.DECODE: 9}, {Role.DECODE: 9})  # present: no effect
    assert fleet.registry.desired_counts() == {Role.PREFILL: 1, Role.DECODE: 2}
    assert fleet.registry.flag_counts() == {Role.PREFILL: 1, Role.DECODE: 2}
