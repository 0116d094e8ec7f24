"""When a live scale has settled: each role it named serves its count, with none of that role still draining
away; roles it did not name are another scale's business."""

from __future__ import annotations

from pdserve.planner.live_scale import settled
from pdserve.v1 import admin_pb2 as apb


def status(*workers: tuple[str, str, bool]) -> apb.ClusterStatusResponse:
    """(role, health, draining) per worker."""
    return apb.ClusterStatusResponse(
        workers=[apb.WorkerStatus(id=f"w{i}", role=r, health=h, draining=d) for i, (r, h, d) in enumerate(workers)]
    )


def test_a_scale_settles_on_the_roles_it_named() -> None:
    two_prefill = status(("prefill", "SERVING", False), ("prefill", "SERVING", False), ("decode", "SERVING", False))
    assert settled(two_prefill, {"prefill": 2})
    assert settled(two_prefill, {"prefill": 2, "decode": 1})
    assert not settled(two_prefill, {"prefill": 2, "decode": 4})  # another scale's roles, when named, count
    assert not settled(two_prefill, {"prefill": 3})


def test_a_worker_starting_or_draining_away_is_not_settled_yet() -> None:
    starting = status(("prefill", "SERVING", False), ("prefill", "NOT_SERVING", False))
    leaving = status(("prefill", "SERVING", False), ("prefill", "SERVING", True))
    assert not settled(starting, {"prefill": 2}) and not settled(leaving, {"prefill": 1})
