"""The controller's liveness: its supervision loop records each pass, /healthz answers 200 while the last one is
recent and 503 naming its age once the loop stops, while /metrics (served from its own thread) still answers."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request

import pytest

from pdserve.cluster.liveness import STALE_PASSES, SupervisionLiveness
from pdserve.cluster.supervisor import Supervisor
from pdserve.registry.memory import InMemoryRegistry
from pdserve.telemetry import HEALTH_PATH, Telemetry
from tests.unit.hand_clock import HandClock

pytestmark = pytest.mark.timeout(30)
INTERVAL_S = 0.01


def supervisor(clock: HandClock) -> Supervisor:
    return Supervisor(InMemoryRegistry(), publish=True, new_actor=lambda spec: None, clock=clock)


async def passes(supervision: Supervisor, count: int) -> None:
    """Runs the loop for about `count` passes, then stops it, as a hung loop stops making them."""
    loop = asyncio.ensure_future(supervision.run(INTERVAL_S))
    await asyncio.sleep(count * INTERVAL_S)
    loop.cancel()
    with pytest.raises(asyncio.CancelledError):
        await loop


async def test_each_pass_of_the_loop_keeps_it_alive_until_the_bound_passes() -> None:
    clock = HandClock(100.0)
    supervision = supervisor(clock)
    liveness = SupervisionLiveness(supervision, INTERVAL_S)
    assert liveness.bound_s == STALE_PASSES * INTERVAL_S + supervision.check_timeout_s
    assert "not ended a pass yet" in str(liveness.problem())
    await passes(supervision, 3)
    assert liveness.problem() is None
    clock.now += liveness.bound_s - 0.05  # inside the bound: still alive
    assert liveness.problem() is None
    clock.now += 0.55
    assert f"ended {liveness.bound_s + 0.5:.1f} s ago" in str(liveness.problem())
    await passes(supervision, 3)  # a loop that comes back is alive again
    assert liveness.problem() is None


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


async def test_healthz_beside_metrics_answers_200_while_the_loop_passes_and_503_naming_the_age_once_it_stops() -> None:
    clock = HandClock(100.0)
    supervision = supervisor(clock)
    liveness = SupervisionLiveness(supervision, INTERVAL_S)
    telemetry = Telemetry("pdserve-controller")
    port = telemetry.serve_metrics("127.0.0.1", 0, health=liveness.problem)
    try:
        status, body = await asyncio.to_thread(get, port, HEALTH_PATH)
        assert (status, "not ended a pass yet" in body) == (503, True)
        await passes(supervision, 3)
        assert await asyncio.to_thread(get, port, HEALTH_PATH) == (200, "ok\n")
        clock.now += liveness.bound_s + 60
        status, body = await asyncio.to_thread(get, port, HEALTH_PATH)
        assert status == 503 and f"ended {liveness.bound_s + 60:.1f} s ago" in body, body
        status, body = await asyncio.to_thread(get, port, "/metrics")  # the thread that serves it lives on
        assert status == 200 and "process_start_time_seconds" in body
    finally:
        telemetry.shutdown()
