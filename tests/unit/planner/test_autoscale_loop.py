"""`pdserve autoscale`'s loop against a stand-in router: a ScaleWorkers that failed is asked again at the next
decision, with no cooldown, and no decision is made while the router cannot read the desired counts."""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest

from pdserve.planner import autoscale_loop
from pdserve.planner.autoscale_loop import AutoscaleConfig, run_autoscale
from pdserve.planner.plan import SLO
from pdserve.rpc.credentials import ClientCredentials
from pdserve.v1 import admin_pb2 as apb
from tests.unit.planner.synthetic import synthetic_profile

pytestmark = pytest.mark.timeout(30)
IDLE = dict(admitted_requests=10, admitted_prompt_tokens=1000, admitted_max_tokens=100)  # no new requests: idle


class Router:
    """Answers `statuses` in turn (the last one from then on); records each ScaleWorkers, failing the first
    `failing` with UNAVAILABLE; ends the loop at its `calls`th status."""

    def __init__(self, statuses: list[apb.ClusterStatusResponse], failing: int = 0, calls: int = 30) -> None:
        self.statuses, self.failing, self.calls = statuses, failing, calls
        self.asked = 0
        self.scaled: list[dict[str, int]] = []

    async def status(self, addr: str, credentials: ClientCredentials) -> apb.ClusterStatusResponse:
        self.asked += 1
        if self.asked > self.calls:
            raise EOFError("enough")
        return self.statuses[min(self.asked, len(self.statuses)) - 1]

    async def scale(self, addr: str, credentials: ClientCredentials, counts: dict[str, int]) -> Any:
        self.scaled.append(counts)
        if len(self.scaled) <= self.failing:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "the router is restarting")


def config(once: bool = False) -> AutoscaleConfig:
    return AutoscaleConfig(synthetic_profile(), SLO(1000, 100), 3, 0.01, 0.001, 1, 1000.0, once, dry_run=False)


async def run(router: Router, monkeypatch: pytest.MonkeyPatch, once: bool = False) -> None:
    monkeypatch.setattr(autoscale_loop, "cluster_status", router.status)
    monkeypatch.setattr(autoscale_loop, "scale_workers", router.scale)
    if once:
        assert await run_autoscale("router:50051", ClientCredentials(), config(once=True)) == 0
    else:
        with pytest.raises(EOFError):
            await run_autoscale("router:50051", ClientCredentials(), config())


async def test_a_scale_that_failed_is_asked_again_at_the_next_decision_then_cools_down(monkeypatch) -> None:
    router = Router([apb.ClusterStatusResponse(desired={"prefill": 2, "decode": 2}, **IDLE)], failing=1)
    await run(router, monkeypatch)
    assert router.scaled == [{"prefill": 1, "decode": 1}] * 2  # the second made it: no more within the cooldown


async def test_no_decision_is_made_while_the_desired_counts_are_unknown(monkeypatch, capsys) -> None:
    workers = [
        apb.WorkerStatus(id="prefill-0", role="prefill", health="SERVING"),
        apb.WorkerStatus(id="decode-1", role="decode", health="SERVING"),
        apb.WorkerStatus(id="decode-2", role="decode", health="SERVING", draining=True),  # scaled away
    ]
    redis_down = apb.ClusterStatusResponse(workers=workers, **IDLE)
    read = apb.ClusterStatusResponse(workers=workers, desired={"prefill": 1, "decode": 1}, **IDLE)
    router = Router([redis_down] * 5 + [read] * 2, calls=7)
    await run(router, monkeypatch)
    (line,) = capsys.readouterr().out.splitlines()
    # The window starts over once the registry answers: the second answer after is the first decision.
    assert json.loads(line)["current"] == {"prefill": 1, "decode": 1}
    assert router.scaled == []  # at the recommendation: the draining worker is not one to scale away again


async def test_once_with_the_routers_registry_down_ends_with_1_at_once(monkeypatch, capsys) -> None:
    """One decision asked for (a cron job's), none possible now: it waited for Redis for ever."""
    router = Router([apb.ClusterStatusResponse(**IDLE)] * 5)
    monkeypatch.setattr(autoscale_loop, "cluster_status", router.status)
    assert await run_autoscale("router:50051", ClientCredentials(), config(once=True)) == 1
    assert "no cluster state from router:50051" in capsys.readouterr().err and router.asked == 1


async def test_a_routers_own_totals_while_redis_is_down_are_no_load(monkeypatch, capsys) -> None:
    """While its registry is down a router answers its own admitted totals, a fraction of the cluster's: beside the
    cluster's before and after they would read as a burst of the whole history, and scale to the maximum."""
    desired = {"prefill": 1, "decode": 1}
    cluster = apb.ClusterStatusResponse(desired=desired, **IDLE)
    local = dict(admitted_requests=2, admitted_prompt_tokens=200, admitted_max_tokens=20)
    own = apb.ClusterStatusResponse(desired=desired, admitted_local_only=True, **local)
    router = Router([cluster] * 3 + [own] * 2 + [cluster] * 10, calls=15)
    await run(router, monkeypatch)
    assert router.scaled == []
    decisions = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert decisions and all(d["load"]["rate"] == 0 for d in decisions), decisions


@pytest.mark.parametrize(
    ("code", "once", "asked"),
    [
        (grpc.StatusCode.UNAVAILABLE, False, 3),  # the router restarting: asked again, until the stand-in ends it
        (grpc.StatusCode.UNAVAILABLE, True, 1),  # one decision asked for: none to make, exit 1
        (grpc.StatusCode.PERMISSION_DENIED, False, 1),  # a key without admin rights: no later call succeeds
    ],
)
async def test_a_status_refused_for_good_or_missing_under_once_ends_the_loop_with_1(
    monkeypatch, capsys, code: grpc.StatusCode, once: bool, asked: int
) -> None:
    calls = []

    async def refused(addr: str, credentials: ClientCredentials) -> apb.ClusterStatusResponse:
        calls.append(addr)
        if len(calls) == 3:
            raise EOFError("enough")
        raise grpc.aio.AioRpcError(code, None, None, "no")

    monkeypatch.setattr(autoscale_loop, "cluster_status", refused)
    if asked == 1:
        assert await run_autoscale("router:50051", ClientCredentials(), config(once=once)) == 1
        assert f"no status from router:50051: {code.name}" in capsys.readouterr().err
    else:
        with pytest.raises(EOFError):
            await run_autoscale("router:50051", ClientCredentials(), config(once=once))
    assert len(calls) == asked


async def test_after_the_status_failed_the_window_starts_over(monkeypatch, capsys) -> None:
    """The first sample after a gap in the router's answers, paired with the last before it, would read the whole
    gap's requests as the load of one window (here 990 of them, at 1000 req/s of a 1 ms window)."""
    desired = {"prefill": 1, "decode": 1}
    before = apb.ClusterStatusResponse(desired=desired, **IDLE)
    after = apb.ClusterStatusResponse(
        desired=desired, admitted_requests=1000, admitted_prompt_tokens=100_000, admitted_max_tokens=10_000
    )
    answers: list[apb.ClusterStatusResponse | None] = [before] * 3 + [None] * 2 + [after] * 5

    async def status(addr: str, credentials: ClientCredentials) -> apb.ClusterStatusResponse:
        if not answers:
            raise EOFError("enough")
        answer = answers.pop(0)
        if answer is None:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "the router is restarting")
        return answer

    router = Router([])
    monkeypatch.setattr(autoscale_loop, "cluster_status", status)
    monkeypatch.setattr(autoscale_loop, "scale_workers", router.scale)
    with pytest.raises(EOFError):
        await run_autoscale("router:50051", ClientCredentials(), config())
    decisions = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert decisions and all(d["load"]["rate"] == 0 for d in decisions), decisions
    assert router.scaled == []


async def test_a_scale_made_elsewhere_starts_the_cooldown_here_too(monkeypatch) -> None:
    """An operator's `pdserve scale`, or a second autoscaler's: this one does not undo it within its cooldown
    (two autoscalers out of phase undid each other's scales every window)."""
    before, after = {"prefill": 2, "decode": 2}, {"prefill": 3, "decode": 3}
    statuses = [apb.ClusterStatusResponse(desired=d, **IDLE) for d in (before, after)]
    router = Router(statuses)
    await run(router, monkeypatch)
    assert router.scaled == []  # idle: it would have scaled to 1 + 1 at once
    router = Router(statuses[:1])  # the same load, counts nobody else changed
    await run(router, monkeypatch)
    assert router.scaled == [{"prefill": 1, "decode": 1}]


@pytest.mark.parametrize(
    ("measured", "served", "refused"),
    [
        ("tiny-random", "smollm2-135m", True),
        ("smollm2-135m", "/root/.cache/pdserve/models/smollm2-135m", False),  # the same model named by its folder
        ("smollm2-135m", "", False),  # a router from before the field says nothing: taken at its word
    ],
)
async def test_a_profile_of_another_model_than_the_cluster_serves_is_refused_before_any_decision(
    monkeypatch, capsys, measured: str, served: str, refused: bool
) -> None:
    """Another model's costs would size the cluster: its decisions would look as sound as the right profile's."""
    busy = apb.ClusterStatusResponse(desired={"prefill": 2, "decode": 2}, model=served, **IDLE)
    router = Router([busy], calls=3)
    c = config(once=True)
    c.profile.meta["model"] = measured
    monkeypatch.setattr(autoscale_loop, "cluster_status", router.status)
    monkeypatch.setattr(autoscale_loop, "scale_workers", router.scale)
    assert await run_autoscale("router:50051", ClientCredentials(), c) == (2 if refused else 0)
    err = capsys.readouterr().err
    assert ("measured on model 'tiny-random', the cluster serves 'smollm2-135m'" in err) == refused, err
    assert router.scaled == [] if refused else router.asked >= 2


async def test_once_says_on_stderr_that_it_collects_the_window_and_prints_only_its_decision(
    monkeypatch, capsys
) -> None:
    """It printed nothing for its whole --window (60 s by default) before its one line."""
    router = Router([apb.ClusterStatusResponse(desired={"prefill": 1, "decode": 1}, **IDLE)])
    await run(router, monkeypatch, once=True)
    out, err = capsys.readouterr()
    assert err == "pdserve autoscale: collecting 0.001 s of router:50051's load (--window) for one decision\n"
    (line,) = out.splitlines()
    assert json.loads(line)["why"] == "one decision (--once)"
