"""The router forgets what it keeps per worker id once the worker has been out of the registry for a while, but
never a worker a request in flight was placed on, nor one back within that time."""

from __future__ import annotations

import asyncio

from pdserve.cluster.local_process import free_port
from pdserve.registry.redis import RedisRegistry
from services.router.gone_workers import GoneWorkers
from services.router.recent_latencies import RecentLatencies
from tests.unit.router.router_builder import Router, prompt, worker

GONE_AFTER_S = 300.0


class Cluster:
    """A router's per-worker state over its registry, as start_router wires it."""

    def __init__(self, workers: int) -> None:
        self.router = Router([worker("p0"), worker("d0", "decode")])
        self.recent = RecentLatencies()
        predictor = self.router.predictor
        self.parts = [
            self.router.tracker,
            predictor.calibration,
            predictor.best,
            self.recent,
            self.router.placement.offered,
        ]
        self.gone = GoneWorkers(self.router.registry, self.parts, gone_after_s=GONE_AFTER_S)
        self.next_id = 1
        for _ in range(workers - 1):
            self.churn()

    def churn(self) -> None:
        """A replacement pair joins under new ids, the old pair leaves the registry."""
        old = {w.worker_id for w in self.router.registry.workers()}
        n = self.next_id
        self.next_id += 1
        self.router.registry.publish(worker(f"p{n}"))
        self.router.registry.publish(worker(f"d{n}", "decode"))
        for worker_id in old:
            self.router.registry.remove(worker_id)

    def start(self, seed: int) -> int:
        """A request placed as the router places it: (placement number), with latencies observed."""
        placed = self.router.place(prompt(64, seed), 16, 1.0)
        p, d = placed.prefill_worker.worker_id, placed.decode.worker_id
        number = self.router.tracker.start(p, d, 64, 0.01, 5, 64)
        self.router.predictor.calibration.observe(p, 0.01, 0.02, 1.0)
        self.recent.add(p, "ttft", 0.02)
        self.recent.add(d, "tpot", 0.005)
        return number

    def serve(self, seed: int) -> None:
        number = self.start(seed)
        self.router.tracker.prefilled(number)
        self.router.tracker.finished(number)

    def held(self) -> set[str]:
        return set().union(*(part.worker_ids() for part in self.parts))


def test_gone_workers_are_forgotten_after_the_grace_and_the_state_stays_bounded() -> None:
    c = Cluster(workers=1)
    for generation in range(50):  # 50 rollouts, a few requests each
        for i in range(4):
            c.serve(generation * 10 + i)
        c.churn()
        c.gone.sweep(now=generation * GONE_AFTER_S)
    live = {w.worker_id for w in c.router.registry.workers()}
    # the pair gone in the last round is within its grace; everything older is forgotten by every part
    assert c.held() <= live | {"p49", "d49"}
    assert {"p48", "d48"}.isdisjoint(c.held())
    assert c.router.tracker.worker_ids() and c.recent.worker_ids()  # the test served on something


def test_a_worker_with_a_request_in_flight_is_kept_until_it_ends() -> None:
    c = Cluster(workers=1)
    number = c.start(seed=1)
    c.churn()
    c.gone.sweep(now=0.0)
    assert c.gone.sweep(now=GONE_AFTER_S) == set()  # the request placed on p0/d0 has not ended
    assert {"p0", "d0"} <= c.router.tracker.worker_ids()
    c.router.tracker.prefilled(number)
    c.router.tracker.finished(number)
    assert c.router.tracker.decoding["d0"] == 0  # counted on the kept entry, not a fresh one going negative
    assert c.gone.sweep(now=GONE_AFTER_S + 1) == {"p0", "d0"}
    assert {"p0", "d0"}.isdisjoint(c.held())


def test_a_worker_back_within_the_grace_keeps_its_correction() -> None:
    c = Cluster(workers=1)
    c.serve(seed=1)
    factor = c.router.predictor.calibration.factor("p0")
    assert factor != 1.0
    c.router.registry.remove("p0")  # a Redis outage dropped it from the view
    c.gone.sweep(now=0.0)
    c.router.registry.publish(worker("p0"))
    c.gone.sweep(now=GONE_AFTER_S - 1)
    c.router.registry.remove("p0")  # gone again: its grace starts over
    assert c.gone.sweep(now=GONE_AFTER_S + 1) == set()
    assert c.router.predictor.calibration.factor("p0") == factor
    assert c.gone.sweep(now=2 * GONE_AFTER_S + 1) == {"p0"}
    assert c.router.predictor.calibration.factor("p0") == 1.0


def test_nothing_is_gone_while_the_registry_redis_does_not_answer() -> None:
    """A Redis outage empties the router's view after its age limit: the workers in it are not gone, and keep
    their corrections however long the outage lasts."""
    c = Cluster(workers=1)
    c.serve(seed=1)

    async def outage() -> set[str]:
        registry = RedisRegistry(f"redis://127.0.0.1:{free_port()}/0", max_view_age_s=0.0)  # nothing listens there
        await registry.start()  # its first refresh fails: an outage from the start
        try:
            assert not registry.view_current() and registry.workers() == []
            gone = GoneWorkers(registry, c.parts, gone_after_s=GONE_AFTER_S)
            return set().union(*(gone.sweep(now=minutes * 60.0) for minutes in range(0, 60, 5)))
        finally:
            await registry.close()

    assert asyncio.run(outage()) == set()
    assert c.router.predictor.calibration.factor("p0") != 1.0
