"""An idle worker that takes prompts re-checks its speed (cluster/speed_recheck.py): a prefill worker whose start-up
profile read 8x slow (PDSERVE_FAULT_SLOW_PROFILE_*) publishes a corrected speed factor without any request, holding
no block after; a decode worker is not probed; a draining worker probes no more; each stops with its worker."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import pytest

from pdserve.cluster.drain import WorkerDrainedError
from pdserve.cluster.worker_runtime import WorkerRuntime
from pdserve.cluster.worker_spec import WorkerSpec
from pdserve.config import EngineConfig
from pdserve.protocol.roles import Role
from pdserve.rpc.server import channel
from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc
from services.workers import add_worker_services

pytestmark = pytest.mark.timeout(120)
ENGINE = EngineConfig(model="tiny-random", device="cpu", dtype="float32", num_kv_blocks=64, num_threads=1)
SLOW = 8.0


def until(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.02)


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[Role, WorkerRuntime]]:
    """A prefill worker whose profile reads SLOW times slow and a decode worker, both re-checking every 0.2 s."""
    monkeypatch.setenv("PDSERVE_FAULT_SLOW_PROFILE_WORKER_ID", "prefill-slowed")
    monkeypatch.setenv("PDSERVE_FAULT_SLOW_PROFILE_TIMES", str(SLOW))
    knobs = {"metrics_port": None, "speed_recheck_idle_s": 0.1, "speed_recheck_s": 0.2}
    workers = {
        role: WorkerRuntime(WorkerSpec(role, ENGINE, worker_id=f"{role}-slowed", **knobs), add_worker_services)
        for role in (Role.PREFILL, Role.DECODE)
    }
    try:
        for w in workers.values():
            w.wait_ready(timeout_s=60)
        yield workers
    finally:
        began = time.monotonic()
        for w in workers.values():
            w.stop()
        assert time.monotonic() - began < 10


def test_an_idle_prefill_worker_corrects_a_slow_profile_and_a_decode_worker_is_not_probed(started) -> None:
    prefill, decode = started[Role.PREFILL], started[Role.DECODE]
    until(lambda: prefill.state().speed_factor < 2 / SLOW, 10, "a probe to correct the prefill worker's speed")
    state = prefill.state()
    assert state.kv_blocks_used == state.kv_blocks_cached == 0  # each probe's blocks freed, none keyed
    assert decode.state().speed_factor == 1.0


def test_a_draining_worker_probes_no_more(started) -> None:
    """Probes every 0.2 s move the factor each time on tiny-random (its readings differ); from the drain's answer
    until the worker leaves (EXIT_GRACE_S) it stays put."""
    prefill = started[Role.PREFILL]
    factors: set[float] = set()

    def probed_twice() -> bool:
        factors.add(prefill.state().speed_factor)
        return len(factors) > 2

    until(probed_twice, 10, "two probes")

    async def drain() -> None:
        async with channel(prefill.address()) as ch:
            await worker_pb2_grpc.WorkerControlStub(ch).Drain(wpb.DrainRequest(timeout_s=1.0), timeout=10)

    asyncio.run(drain())
    during, began = set(), time.monotonic()
    with pytest.raises(WorkerDrainedError):
        while time.monotonic() - began < 10:
            during.add(prefill.state().speed_factor)
            time.sleep(0.02)
    assert len(during) == 1 and time.monotonic() - began > 0.5, during
