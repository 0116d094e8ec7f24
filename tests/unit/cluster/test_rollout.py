"""The rollout's decisions against stand-in actors: which adopted workers it drains (those whose spec differs from
their slot's), one of a role at a time and only while the rest of the role serves, and each actor checked once."""

from __future__ import annotations

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


def fleet(*made_with: tuple[str, EngineConfig]) -> tuple[Rollout, Supervisor, list[str]]:
    supervisor = Supervisor(InMemoryRegistry(), publish=True, new_actor=lambda spec: None)
    for worker_id, engine in made_with:
        role = worker_id.split("-")[0]
        made = Actor(WorkerSpec(role, engine, worker_id=worker_id))
        supervisor.slots[worker_id] = Slot(WorkerSpec(role, NEW, worker_id=worker_id), made, listed=True)
    drained: list[str] = []

    async def spec_of(actor: Actor) -> WorkerSpec:
        actor.asked += 1
        return actor.spec

    async def drain(slot: Slot) -> None:
        drained.append(slot.spec.worker_id)
        slot.listed = False  # as the supervisor sees a drained worker until its new actor serves

    return Rollout(supervisor, spec_of, drain), supervisor, drained


async def test_only_workers_made_with_another_spec_are_drained_one_per_role_at_a_time() -> None:
    rollout, supervisor, drained = fleet(("prefill-0", OLD), ("prefill-1", OLD), ("decode-2", NEW), ("decode-3", OLD))
    assert await rollout.step() == "prefill-0"
    assert await rollout.step() == "decode-3"  # another role may roll meanwhile
    assert await rollout.step() is None  # prefill-1 waits: prefill-0 is not back yet
    new = supervisor.slots["prefill-0"]
    new.actor, new.listed = Actor(new.spec), True  # the supervisor's restart, from the slot's (new) spec
    assert await rollout.step() == "prefill-1"
    assert drained == ["prefill-0", "decode-3", "prefill-1"]


async def test_each_actor_is_asked_once() -> None:
    rollout, supervisor, drained = fleet(("prefill-0", NEW), ("decode-1", NEW))
    for _ in range(3):
        assert await rollout.step() is None
    assert [s.actor.asked for s in supervisor.slots.values()] == [1, 1] and not drained


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


async def test_a_drain_that_failed_is_tried_again() -> None:
    supervisor = Supervisor(InMemoryRegistry(), publish=True, new_actor=lambda spec: None)
    supervisor.slots["decode-0"] = Slot(
        WorkerSpec("decode", NEW, worker_id="decode-0"), Actor(WorkerSpec("decode", OLD))
    )
    supervisor.slots["decode-0"].listed = True
    tries: list[int] = []

    async def spec_of(actor: Actor) -> WorkerSpec:
        return actor.spec

    async def drain(slot: Slot) -> None:
        tries.append(1)
        if len(tries) == 1:
            raise ConnectionError("unreachable")

    rollout = Rollout(supervisor, spec_of, drain)
    with pytest.raises(ConnectionError):
        await rollout.step()
    assert await rollout.step() == "decode-0" and len(tries) == 2
    assert await rollout.step() is None  # drained once it worked; not again
