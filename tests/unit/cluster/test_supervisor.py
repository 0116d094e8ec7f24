"""The launcher's supervision loop against stand-ins for Ray actor handles (their `state.remote()` is awaitable, as a
Ray ObjectRef is): one actor's error never ends the loop, slow actors do not delay the others' checks, and an actor
dead for good is replaced."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any

import pytest
from ray.exceptions import ActorDiedError

from pdserve.addresses import join
from pdserve.cluster.drain import WorkerDrainedError
from pdserve.cluster.supervisor import Slot, Supervisor, _port_open
from pdserve.cluster.worker_spec import WorkerSpec
from pdserve.config import EngineConfig
from pdserve.protocol.roles import Role
from pdserve.registry.base import WorkerState
from pdserve.registry.memory import InMemoryRegistry
from pdserve.registry.redis import RedisRegistry
from tests.redis_server import emptied, started
from tests.unit.cluster.remote_method import RemoteMethod, call_on_loop

pytestmark = pytest.mark.timeout(30)
server = pytest.fixture(scope="module")(started)  # a redis-server, started only for the tests that use it
url = pytest.fixture(emptied)


class StandInActor:
    """Answers `state` with `behaviour()`: a coroutine that returns a state, raises, or takes its time."""

    address = ""  # a port that accepts connections: set by `listening`

    def __init__(self, worker_id: str, behaviour: str) -> None:
        self.worker_id = worker_id
        self.behaviour = behaviour
        self.instance = "first"  # its process's: Ray restarting the actor in place makes another
        self.state = RemoteMethod(self._state)

    async def _state(self) -> WorkerState:
        self.asked_at = asyncio.get_running_loop().time()
        if self.behaviour == "dead":
            raise ActorDiedError()
        if self.behaviour == "broken":
            raise RuntimeError("its own error")
        if self.behaviour == "drained":
            raise WorkerDrainedError(f"worker {self.worker_id} drained")
        if self.behaviour == "slow":
            await asyncio.sleep(10)
        if self.behaviour == "late":  # answers, after a while
            await asyncio.sleep(0.2)
        draining = self.behaviour == "draining"
        return WorkerState(self.worker_id, Role.DECODE, self.address, instance=self.instance, draining=draining)


@pytest.fixture(autouse=True)
async def listening() -> Any:
    """The stand-ins' gRPC port: it accepts, as a live worker's does (the supervisor knocks on it)."""
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    StandInActor.address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    yield
    server.close()


def supervisor(
    behaviours: dict[str, str], new_actor: Any = None, kill: Any = None
) -> tuple[Supervisor, InMemoryRegistry]:
    registry = InMemoryRegistry()
    sup = Supervisor(
        registry,
        publish=True,
        new_actor=new_actor or (lambda spec: None),
        check_timeout_s=0.3,
        kill=kill or (lambda actor: None),
        call=call_on_loop,
    )
    for worker_id, behaviour in behaviours.items():
        sup.slots[worker_id] = Slot(WorkerSpec(Role.DECODE, EngineConfig(), worker_id=worker_id), None)
        sup.slots[worker_id].actor = StandInActor(worker_id, behaviour)
    return sup, registry


async def test_slow_and_failing_actors_neither_stop_nor_delay_the_healthy_ones() -> None:
    sup, registry = supervisor({"slow-1": "slow", "slow-2": "slow", "broken": "broken", "ok": "ok"})
    await sup.check_all()
    asked = [s.actor.asked_at for s in sup.slots.values()]
    assert max(asked) - min(asked) < sup.check_timeout_s  # all asked at once: "ok" did not wait on the slow ones
    assert [w.worker_id for w in registry.workers()] == ["ok"]
    task = asyncio.create_task(sup.run(0.05))
    await asyncio.sleep(1.0)
    assert not task.done()  # the loop goes on through every round of errors
    task.cancel()


async def test_a_check_leaves_no_ray_task_event() -> None:
    """Ray's GCS keeps an event per actor call: checks at every heartbeat grew its memory without traffic."""
    sup, _ = supervisor({"a": "ok", "b": "ok"})
    for _ in range(3):
        await sup.check_all()
    calls = [call for slot in sup.slots.values() for call in slot.actor.state.calls]
    assert len(calls) == 6 and all(call == {"enable_task_events": False} for call in calls)


async def test_a_slot_making_its_new_actor_holds_up_no_other_workers_checks() -> None:
    """A drained worker's new actor waits seconds for Ray to free its name: meanwhile the loop keeps checking (and,
    with the embedded registry, republishing) the others, which would otherwise drop out of placement."""
    making = threading.Event()

    def slow_new_actor(spec: WorkerSpec) -> StandInActor:
        making.wait(10)
        return StandInActor(spec.worker_id, "ok")

    sup, registry = supervisor({"drained": "drained", "ok": "ok"}, slow_new_actor)
    task = asyncio.create_task(sup.run(0.05))
    try:
        await asyncio.sleep(0.3)
        first = sup.slots["ok"].actor.asked_at
        await asyncio.sleep(0.5)
        assert sup.slots["drained"].actor is None  # its new actor is still being made
        assert sup.slots["ok"].actor.asked_at > first  # the other worker was checked again meanwhile
    finally:
        making.set()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_an_actor_dead_for_good_leaves_placement_and_is_replaced() -> None:
    replaced: list[str] = []

    def new_actor(spec: WorkerSpec) -> StandInActor:
        replaced.append(spec.worker_id)
        return StandInActor(spec.worker_id, "ok")

    sup, registry = supervisor({"a": "ok", "b": "ok"}, new_actor)
    await sup.check_all()
    assert {w.worker_id for w in registry.workers()} == {"a", "b"}
    sup.slots["b"].actor.behaviour = "dead"
    await sup.check_all()
    assert {w.worker_id for w in registry.workers()} == {"a"}  # out at once
    assert replaced == []  # a call in flight at a process's death fails once even when Ray restarts it
    await sup.check_all()
    assert replaced == ["b"]
    assert sup.slots["b"].address == ""  # served nowhere yet: a stop at this point kills it without asking it
    await sup.check_all()
    assert {w.worker_id for w in registry.workers()} == {"a", "b"}  # the new actor is in placement


async def test_replacements_that_never_serve_back_off_and_one_that_serves_resets_it() -> None:
    now = [0.0]
    made: list[StandInActor] = []

    def new_actor(spec: WorkerSpec) -> StandInActor:
        made.append(StandInActor(spec.worker_id, "dead"))  # a start that fails every time
        return made[-1]

    sup, _ = supervisor({"a": "dead"}, new_actor)
    sup.clock = lambda: now[0]

    async def checks(n: int) -> None:
        for _ in range(n):
            await sup.check_all()

    await checks(2)
    assert len(made) == 1  # the first replacement at once
    await checks(5)
    assert len(made) == 1  # it died unserved: the next waits 10 s
    now[0] = 10.0
    await checks(1)
    assert len(made) == 2
    await checks(2)
    now[0] = 29.0
    await checks(1)
    assert len(made) == 2  # then 20 s from its death
    now[0] = 30.0
    await checks(1)
    assert len(made) == 3
    made[-1].behaviour = "ok"  # this one serves
    await checks(1)
    made[-1].behaviour = "dead"
    await checks(2)
    assert len(made) == 4 and sup.slots["a"].replacements == 4  # replaced at once again


async def test_a_replacement_that_could_not_be_created_is_tried_again() -> None:
    now, tries = [0.0], []

    def new_actor(spec: WorkerSpec) -> StandInActor:
        tries.append(spec.worker_id)
        if len(tries) == 1:
            raise ValueError("The name b is already taken")  # Ray has not freed the dead actor's name yet
        return StandInActor(spec.worker_id, "ok")

    sup, registry = supervisor({"a": "ok", "b": "dead"}, new_actor)
    sup.clock = lambda: now[0]
    for _ in range(3):
        await sup.check_all()  # the loop goes on, no actor in the slot
    assert tries == ["b"] and sup.slots["b"].actor is None
    now[0] = 10.0
    await sup.check_all()
    await sup.check_all()
    assert tries == ["b", "b"] and {w.worker_id for w in registry.workers()} == {"a", "b"}


async def test_a_silent_actor_leaves_placement_after_two_checks_while_others_answer() -> None:
    sup, registry = supervisor({"a": "ok", "b": "ok", "c": "ok"})
    await sup.check_all()
    sup.slots["a"].actor.behaviour = "slow"  # it stops answering in time; the others still answer
    await sup.check_all()
    assert {w.worker_id for w in registry.workers()} == {"a", "b", "c"}  # one missed check is not enough
    await sup.check_all()
    assert {w.worker_id for w in registry.workers()} == {"b", "c"}
    sup.slots["a"].actor.behaviour = "ok"
    await sup.check_all()
    assert {w.worker_id for w in registry.workers()} == {"a", "b", "c"}


async def test_when_no_actor_answers_none_leaves_placement() -> None:
    """Every call hanging is this process's trouble (a Ray Client whose head is gone hangs each call for its
    reconnect grace; a CPU-starved launcher looks the same), not every worker's at once."""
    sup, registry = supervisor({"a": "ok", "b": "ok", "c": "ok"})
    await sup.check_all()
    for slot in sup.slots.values():
        slot.actor.behaviour = "slow"
    for _ in range(4):
        await sup.check_all()
    assert {w.worker_id for w in registry.workers()} == {"a", "b", "c"}


async def test_the_last_listed_actor_of_its_role_stays_however_long_it_is_silent() -> None:
    sup, registry = supervisor({"a": "ok", "b": "ok"})
    await sup.check_all()
    sup.slots["a"].actor.behaviour = "slow"
    for _ in range(2):
        await sup.check_all()
    assert {w.worker_id for w in registry.workers()} == {"b"}
    sup.slots["b"].actor.behaviour = "slow"  # b answered after a went silent: stuck, but the last one listed
    for _ in range(3):
        await sup.check_all()
    assert {w.worker_id for w in registry.workers()} == {"b"}


async def test_a_drained_actor_is_killed_and_a_new_one_takes_its_slot_at_once() -> None:
    """A drain means restart: the slot keeps its shape without waiting for deaths or using Ray's restarts."""
    killed: list[StandInActor] = []
    sup, registry = supervisor(
        {"a": "ok", "b": "ok"}, lambda spec: StandInActor(spec.worker_id, "ok"), kill=killed.append
    )
    await sup.check_all()
    old = sup.slots["b"].actor
    old.behaviour = "drained"
    await sup.check_all()
    assert killed == [old] and sup.slots["b"].actor is not old
    assert {w.worker_id for w in registry.workers()} == {"a"}  # out of placement until the new one answers
    await sup.check_all()
    assert {w.worker_id for w in registry.workers()} == {"a", "b"}


async def test_an_actor_made_while_the_supervision_ended_is_handed_to_whoever_stops_the_workers() -> None:
    """The supervision is cancelled (the fleet stops) while Ray frees a drained worker's name for its successor: the
    successor, made after, is no slot's; `orphans` waits for it and hands it over, to be killed, not left serving
    unsupervised. Actors a slot took are not among them."""
    name_freed = threading.Event()

    def new_actor(spec: WorkerSpec) -> StandInActor:
        if spec.worker_id == "b":
            name_freed.wait(10)
        return StandInActor(spec.worker_id, "ok")

    sup, _ = supervisor({"a": "drained", "b": "drained"}, new_actor)
    checks = asyncio.ensure_future(sup.check_all())
    while sup.slots["b"].actor is not None or sup.slots["a"].actor is None:  # a replaced, b being made
        await asyncio.sleep(0.01)
    checks.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await checks
    sup.slots.clear()  # as a stop does
    stopping = asyncio.ensure_future(asyncio.to_thread(sup.orphans, 10))
    await asyncio.sleep(0.2)
    assert not stopping.done()  # it waits for the actor under way
    name_freed.set()
    (orphan,) = await stopping
    assert orphan.worker_id == "b"
    assert sup.orphans(0) == []


async def test_a_slot_scaled_away_while_it_had_no_actor_is_never_replaced() -> None:
    tries: list[str] = []

    def new_actor(spec: WorkerSpec) -> StandInActor:
        tries.append(spec.worker_id)
        return StandInActor(spec.worker_id, "ok")

    sup, _ = supervisor({"a": "ok", "b": "ok"}, new_actor)
    sup.slots["b"].actor, sup.slots["b"].leaving = None, True  # its new actor failed; the scaler took the slot
    await sup.check_all()
    await sup.check_all()
    assert tries == [] and sup.slots["b"].actor is None


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
async def test_the_port_knock_tells_a_listening_worker_from_a_gone_one(host: str) -> None:
    """On an IPv6 pod too, whose address brackets the literal (the knock once dialled "[::1]", failed to resolve,
    and took every worker for alive)."""
    try:
        server = await asyncio.start_server(lambda r, w: w.close(), host, 0)
    except OSError:
        pytest.skip(f"no {host} here")
    address = join(host, server.sockets[0].getsockname()[1])
    assert await _port_open(address)
    server.close()
    await server.wait_closed()
    assert not await _port_open(address)


async def test_a_check_keeps_whether_the_worker_said_it_drains() -> None:
    """What a rollout asks before it drains the role's other worker (an operator's drain, a SIGTERM)."""
    sup, _ = supervisor({"a": "draining", "b": "ok"})
    await sup.check_all()
    assert (sup.slots["a"].said_draining, sup.slots["b"].said_draining) == (True, False)
    sup.slots["a"].actor.behaviour = "ok"
    await sup.check_all()
    assert not sup.slots["a"].said_draining


async def test_a_check_that_answers_after_its_worker_was_scaled_away_publishes_nothing() -> None:
    """A scale-down retired the worker while its check waited for the state: publishing it would list a killed
    worker again for a TTL and undo its retirement."""
    sup, registry = supervisor({"a": "ok", "b": "late"})
    checking = asyncio.ensure_future(sup.check_all())
    await asyncio.sleep(0.05)
    del sup.slots["b"]  # as the scale-down does, before it retires the worker
    registry.retire("b")
    await checking
    assert [w.worker_id for w in registry.workers()] == ["a"] and registry.retired() == {"b"}


async def test_a_resumed_launcher_unlists_the_process_it_saw_not_the_one_ray_restarted_meanwhile(url, server) -> None:
    """With Redis the workers list themselves. A launcher frozen (SIGSTOP, ~40 s) while Ray restarted a worker on
    another port resumes to find the old port refused: its unlist deleted the new process's entry, which no router
    placed on until its next heartbeat re-listed it."""
    sup = Supervisor(RedisRegistry(url), publish=False, new_actor=lambda spec: None, call=call_on_loop)
    sup.slots["a"] = slot = Slot(WorkerSpec(Role.DECODE, EngineConfig(), worker_id="a"), StandInActor("a", "ok"))
    old_port = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    slot.actor.address = join("127.0.0.1", old_port.sockets[0].getsockname()[1])
    sup.registry.publish(await slot.actor._state())  # the first process's heartbeat
    await sup.check_all()
    assert slot.listed and slot.instance == "first"
    old_port.close()
    await old_port.wait_closed()
    slot.actor.instance, slot.actor.address = "second", StandInActor.address  # restarted while the launcher slept
    sup.registry.publish(await slot.actor._state())  # and listed itself
    await sup.check_all()  # resumed: the old port refuses, so out of placement, and the answer lists it again
    with server.client() as c:
        assert WorkerState.from_json(c.get("pdserve:worker:a")).instance == "second"
        assert c.smembers("pdserve:workers") == {b"a"}
    assert slot.listed and slot.instance == "second"
