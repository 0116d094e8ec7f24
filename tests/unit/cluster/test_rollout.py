"""The rollout's decisions against stand-in actors: which adopted workers it drains (those whose spec differs from
their slot's), one of a role at a time and only while the rest of the role serves, a role's only worker surged
rather than drained, and each actor checked once."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from pdserve.cluster.rollout import Rollout, _differences
from pdserve.cluster.supervisor import Slot, Supervisor
from pdserve.cluster.worker_spec import WorkerSpec
from pdserve.config import EngineConfig
from pdserve.registry.memory import InMemoryRegistry

OLD = EngineConfig(model="tiny-random", kv_cache_memory_gb=0.05)
NEW = replace(OLD, kv_cache_memory_gb=0.1)


class Actor:
    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.asked = 0
        self.stopped = False  # SIGSTOPped or hung: its spec read times out


def fleet(*made_with: tuple[str, EngineConfig], successor_starts: bool = True) -> tuple[Rollout, Supervisor, list[str]]:
    """`drained` records each in-place restart as the worker id, each surge as `surged:` and the worker id."""
    supervisor = Supervisor(InMemoryRegistry(), publish=True, new_actor=lambda spec: None)
    for worker_id, engine in made_with:
        role = worker_id.split("-")[0]
        made = Actor(WorkerSpec(role, engine, worker_id=worker_id))
        supervisor.slots[worker_id] = Slot(WorkerSpec(role, NEW, worker_id=worker_id), made, listed=True)
    drained: list[str] = []

    async def spec_of(actor: Actor) -> WorkerSpec:
        actor.asked += 1
        if actor.stopped:
            raise TimeoutError()  # as `answer` gives up on an actor call
        return actor.spec

    async def drain(slot: Slot) -> None:
        drained.append(slot.spec.worker_id)
        slot.listed = False  # as the supervisor sees a drained worker until its new actor serves

    async def surge(slot: Slot) -> bool:
        drained.append(f"surged:{slot.spec.worker_id}")
        if not successor_starts:
            return False
        successor = f"{slot.spec.role}-9"
        del supervisor.slots[slot.spec.worker_id]  # as FleetScaler.surge leaves it: the successor in its place
        spec = replace(slot.spec, worker_id=successor)
        supervisor.slots[successor] = Slot(spec, Actor(spec), listed=True)
        return True

    return Rollout(supervisor, spec_of, drain, surge), supervisor, drained


async def test_only_workers_made_with_another_spec_are_drained_one_per_role_at_a_time() -> None:
    rollout, supervisor, drained = fleet(("prefill-0", OLD), ("prefill-1", OLD), ("decode-2", NEW), ("decode-3", OLD))
    assert await rollout.step() == "prefill-0"
    assert await rollout.step() == "decode-3"  # another role may roll meanwhile
    assert await rollout.step() is None  # prefill-1 waits: prefill-0 is not back yet
    new = supervisor.slots["prefill-0"]
    new.actor, new.listed = Actor(new.spec), True  # the supervisor's restart, from the slot's (new) spec
    assert await rollout.step() == "prefill-1"
    assert drained == ["prefill-0", "decode-3", "prefill-1"]


async def test_no_worker_is_drained_while_its_roles_other_worker_says_it_drains() -> None:
    """An operator's `pdserve drain` or a SIGTERM (a Kubernetes eviction) drains a peer, whose check still passes:
    draining this one too would leave the role with no worker in service for a model load."""
    rollout, supervisor, drained = fleet(("decode-0", OLD), ("decode-1", NEW), ("prefill-2", NEW))
    supervisor.slots["decode-1"].said_draining = True  # as its last state said (the supervisor's check)
    assert await rollout.step() is None and drained == []
    supervisor.slots["decode-1"].said_draining = False  # it restarted and serves
    assert await rollout.step() == "decode-0"


async def test_a_roles_only_worker_is_surged_not_restarted_in_place() -> None:
    rollout, supervisor, drained = fleet(("prefill-0", OLD), ("prefill-1", NEW), ("decode-2", OLD))
    assert await rollout.step() == "prefill-0"  # a peer serves meanwhile: in place
    assert await rollout.step() == "decode-2"
    assert drained == ["prefill-0", "surged:decode-2"]
    assert sorted(supervisor.slots) == ["decode-9", "prefill-0", "prefill-1"]
    assert await rollout.step() is None  # the successor runs the fleet's spec


async def test_a_surge_whose_successor_cannot_start_restarts_in_place() -> None:
    rollout, supervisor, drained = fleet(("prefill-0", NEW), ("decode-1", OLD), successor_starts=False)
    assert await rollout.step() == "decode-1"
    assert drained == ["surged:decode-1", "decode-1"]


async def test_each_actor_is_asked_once() -> None:
    rollout, supervisor, drained = fleet(("prefill-0", NEW), ("decode-1", NEW))
    for _ in range(3):
        assert await rollout.step() is None
    assert [s.actor.asked for s in supervisor.slots.values()] == [1, 1] and not drained


async def test_a_stopped_worker_holds_up_no_other_and_is_asked_again(caplog) -> None:
    """A role's only worker SIGSTOPped (or hung) stays in placement, and its spec read times out at every pass: the
    workers after it still roll, it is logged once, not per pass, and it rolls once it answers again."""
    rollout, supervisor, drained = fleet(("decode-0", OLD), ("prefill-1", OLD), ("prefill-2", NEW))
    stopped = supervisor.slots["decode-0"].actor
    stopped.stopped = True
    with caplog.at_level(logging.WARNING, logger="pdserve.cluster.rollout"):
        assert await rollout.step() == "prefill-1"
        assert await rollout.step() is None  # prefill-2 runs the fleet's spec; prefill-1 is not back yet
    assert stopped.asked == 2
    unanswered = [r.getMessage() for r in caplog.records if "did not say" in r.getMessage()]
    assert unanswered == [
        "worker decode-0 did not say which spec it runs (TimeoutError()); the rollout checks the others and asks it "
        "again"
    ]
    stopped.stopped = False  # SIGCONT
    assert await rollout.step() == "decode-0"
    assert drained == ["prefill-1", "surged:decode-0"]


@pytest.mark.parametrize("leaving", [True, False])
async def test_a_worker_out_of_placement_or_leaving_is_left_alone(leaving: bool) -> None:
    rollout, supervisor, drained = fleet(("prefill-0", OLD), ("decode-1", NEW))
    slot = supervisor.slots["prefill-0"]
    slot.leaving, slot.listed = leaving, leaving  # scaled away, or not serving yet
    assert await rollout.step() is None and not drained


def test_the_log_names_what_differs() -> None:
    spec = WorkerSpec("prefill", NEW, worker_id="prefill-0")
    assert (
        _differences(replace(spec, engine=OLD, drain_timeout_s=9), spec)
        == "drain_timeout_s, engine.kv_cache_memory_gb differ"
    )
    assert _differences(None, spec) == "made by a pdserve that does not report it"
    new_image = replace(spec, build="img:v2")
    assert _differences(replace(spec, build="img:v1"), new_image) == "build 'img:v1' -> 'img:v2' differ"
    assert _differences(spec, new_image) == "build 'unnamed' -> 'img:v2' differ"  # a worker older than builds


async def test_a_worker_of_another_build_is_rolled_like_one_of_other_flags() -> None:
    """A new image with the same flags: only the build differs, and the workers still roll."""
    rollout, supervisor, drained = fleet(("prefill-0", NEW), ("decode-1", NEW))
    for slot in supervisor.slots.values():
        slot.spec = replace(slot.spec, build="img:v2")
        slot.actor.spec = replace(slot.actor.spec, build="img:v1")
    assert await rollout.step() == "prefill-0"
    assert await rollout.step() == "decode-1"
    assert drained == ["surged:prefill-0", "surged:decode-1"]
    assert await rollout.step() is None  # the successors run the fleet's build


async def test_a_drain_that_failed_is_tried_again() -> None:
    supervisor = Supervisor(InMemoryRegistry(), publish=True, new_actor=lambda spec: None)
    for worker_id, made_with in (("decode-0", OLD), ("decode-1", NEW)):  # a peer: restarted in place
        supervisor.slots[worker_id] = Slot(
            WorkerSpec("decode", NEW, worker_id=worker_id),
            Actor(WorkerSpec("decode", made_with, worker_id=worker_id)),
            listed=True,
        )
    tries: list[int] = []

    async def spec_of(actor: Actor) -> WorkerSpec:
        return actor.spec

    async def drain(slot: Slot) -> None:
        tries.append(1)
        if len(tries) == 1:
            raise ConnectionError("unreachable")

    async def no_surge(slot: Slot) -> bool:
        raise AssertionError("a role with a peer restarts in place")

    rollout = Rollout(supervisor, spec_of, drain, no_surge)
    with pytest.raises(ConnectionError):
        await rollout.step()
    assert await rollout.step() == "decode-0" and len(tries) == 2
    assert await rollout.step() is None  # drained once it worked; not again


@pytest.mark.parametrize("can_relevel", [True, False])
async def test_a_worker_whose_log_level_alone_differs_takes_it_where_it_runs(can_relevel: bool) -> None:
    """Turning DEBUG on for an incident restarted every worker. An actor of an earlier build, which cannot take a
    level where it runs, is rolled as before."""
    rollout, supervisor, drained = fleet(("prefill-0", NEW), ("prefill-1", NEW))
    for slot in supervisor.slots.values():
        slot.spec = replace(slot.spec, log_level="DEBUG")  # the fleet's new --log-level
    relevelled: list[tuple[str, str | None]] = []

    async def relevel(actor: Actor, level: str | None) -> bool:
        if can_relevel:
            relevelled.append((actor.spec.worker_id, level))
            actor.spec = replace(actor.spec, log_level=level)
        return can_relevel

    rollout.relevel = relevel
    while await rollout.step() is not None:
        pass
    if can_relevel:
        assert drained == [] and relevelled == [("prefill-0", "DEBUG"), ("prefill-1", "DEBUG")]
        restarted = supervisor.slots["prefill-0"]  # Ray restarted its actor in place: the spec it was made with
        restarted.actor.spec, restarted.instance = replace(restarted.actor.spec, log_level=None), "its next process"
        assert await rollout.step() is None
        assert relevelled[2:] == [("prefill-0", "DEBUG")] and drained == []
    else:
        assert drained == ["prefill-0"]  # and prefill-1 once it is back (one of a role at a time)
