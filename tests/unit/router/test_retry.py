"""Retry before the first token: whom a failure blames, when a request may move, and placement around failed
workers (ejected for a while, or avoided for the rest of one request)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

import grpc
import pytest

from pdserve.config import RouterConfig
from pdserve.errors import ClusterAuthError, UnavailableError
from pdserve.metrics import RouterMetrics
from pdserve.rpc.metadata import HANDOFF_STARTED_KEY
from pdserve.telemetry import Telemetry
from pdserve.v1 import generate_pb2 as pb
from services.router.ejection import Ejections
from services.router.generation import generate
from services.router.retry import EJECTION_REASONS, Moves, blamed_worker, ejection_reason
from tests.unit.router.router_builder import Router, prompt, worker
from tests.unit.router.stand_in_decode import StandInDecode, serving


def cluster(**config: object) -> Router:
    return Router([worker("p0"), worker("p1"), worker("d0", "decode"), worker("d1", "decode")], **config)


def test_a_status_naming_the_prefill_address_blames_the_prefill_worker_else_the_decode_worker():
    placed = cluster().place(prompt(40), 8, 1.0)
    p, d = placed.prefill_worker, placed.decode
    via = UnavailableError(f"decode worker {d.worker_id} at {d.address}: KV transfer from {p.address} failed")
    assert blamed_worker(via, placed) is p
    gone = UnavailableError(f"decode worker {d.worker_id} at {d.address}: failed to connect (UNAVAILABLE)")
    assert blamed_worker(gone, placed) is d


def test_a_request_is_retried_up_to_max_attempts_then_migrated_up_to_the_limit_within_its_deadline():
    config = RouterConfig(max_attempts=3, migration_limit=2)
    moves = Moves()
    assert moves.allow(config, sent=-1, max_tokens=8, time_remaining=None)  # attempt 2
    assert moves.allow(config, sent=-1, max_tokens=8, time_remaining=5.0)  # attempt 3
    assert not moves.allow(config, sent=-1, max_tokens=8, time_remaining=None)  # 3 placements used
    assert moves.allow(config, sent=0, max_tokens=8, time_remaining=None)  # a message went out: migrated
    assert moves.allow(config, sent=3, max_tokens=8, time_remaining=None)
    assert not moves.allow(config, sent=4, max_tokens=8, time_remaining=None)  # migration_limit
    assert not Moves().allow(config, sent=-1, max_tokens=8, time_remaining=0.0)  # its deadline passed
    assert not Moves().allow(config, sent=8, max_tokens=8, time_remaining=None)  # nothing left to generate
    assert not Moves().allow(RouterConfig(max_attempts=1), sent=-1, max_tokens=8, time_remaining=None)
    assert not Moves().allow(RouterConfig(migration_limit=0), sent=2, max_tokens=8, time_remaining=None)


def test_placement_avoids_the_workers_that_failed_the_request_and_fails_when_none_is_left():
    r = cluster()
    for _ in range(4):
        placed = asyncio.run(r.placement.place(prompt(40), 8, 1.0, avoid=frozenset({"p0", "d1"})))
        assert (placed.prefill_worker.worker_id, placed.decode.worker_id) == ("p1", "d0")
    with pytest.raises(UnavailableError):
        asyncio.run(r.placement.place(prompt(40), 8, 1.0, avoid=frozenset({"p0", "p1"})))


def test_an_ejected_worker_leaves_placement_until_its_hold_ends_or_it_restarts(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("services.router.ejection.time.monotonic", lambda: clock[0])
    r = cluster(policy="round-robin", ejection_s=10.0)
    r.placement.ejections.eject(worker("p0"), "killed")
    assert {r.place(prompt(40), 8, 1.0).prefill_worker.worker_id for _ in range(4)} == {"p1"}
    r.registry.publish(replace(worker("p0"), address="p0.local:60000"))  # Ray restarted it elsewhere
    assert {r.place(prompt(40), 8, 1.0).prefill_worker.worker_id for _ in range(4)} == {"p0", "p1"}
    r.placement.ejections.eject(worker("p1"), "killed")
    clock[0] += 10.5
    assert {r.place(prompt(40), 8, 1.0).prefill_worker.worker_id for _ in range(4)} == {"p0", "p1"}


def test_a_worker_restarted_in_place_is_placed_again_at_once():
    """A pod's worker restarted by Ray keeps its address (the chart pins the port): its new instance ends the
    ejection, as a new address does; the failed process stays out (an HA review: a restarted worker sat out the
    whole hold on the router that saw it fail)."""
    ejections = Ejections(hold_s=60.0)
    failed = worker("d0", "decode", instance="a1")
    ejections.eject(failed, "unavailable")
    assert ejections.ejected(failed)
    assert not ejections.ejected(worker("d0", "decode", instance="b2"))  # same address, new process
    assert not ejections.ejected(worker("d0", "decode", instance="a1", address="d0.local:50099"))
    assert ejections.ejected(worker("d0", "decode", instance="a1"))


def test_ejections_never_leave_a_role_empty(monkeypatch):
    """All out: the one ejected longest ago rather than UNAVAILABLE, and not the one that failed a moment ago (CI's
    chaos run: a decode worker resumed after a stall, while requests went back to the one just killed)."""
    clock = [100.0]
    monkeypatch.setattr("services.router.ejection.time.monotonic", lambda: clock[0])
    ejections = Ejections(hold_s=10.0)
    p0, p1 = worker("p0"), worker("p1")
    ejections.eject(p0, "stalled")
    assert ejections.usable([p0, p1]) == [p1]
    clock[0] += 4
    ejections.eject(p1, "killed")
    assert ejections.usable([p0, p1]) == ejections.usable([p1, p0]) == [p0]
    clock[0] += 6.5  # p0's hold is over
    assert ejections.usable([p0, p1]) == [p0]
    assert ejections.usable([]) == []


def test_each_ejection_counts_once_by_worker_role_and_reason_and_logs_one_warning(monkeypatch, caplog):
    """What an alert on flapping workers reads: the requests in flight on a lost worker fail together, and renew its
    one ejection rather than count one each, or log a WARNING each."""
    clock = [100.0]
    monkeypatch.setattr("services.router.ejection.time.monotonic", lambda: clock[0])
    telemetry = Telemetry("test-router")
    ejections = Ejections(hold_s=10.0)
    ejections.on_eject = RouterMetrics(telemetry.meter).ejected
    with caplog.at_level(logging.DEBUG, logger="services.router.ejection"):
        for _ in range(3):
            ejections.eject(worker("d0", "decode"), "unavailable", "decode worker d0 at d0.local:50051: gone")
        clock[0] += 10.5  # its hold is over: ejected again
        ejections.eject(worker("d0", "decode"), "stalled")
        ejections.eject(worker("p0"), "draining")
    logged = [(r.levelno, r.worker_id, r.reason) for r in caplog.records]
    assert logged == [
        (logging.WARNING, "d0", "unavailable"),
        *[(logging.DEBUG, "d0", "unavailable")] * 2,  # renewed by its other requests
        (logging.WARNING, "d0", "stalled"),
        (logging.WARNING, "p0", "draining"),
    ]
    counted = {
        (s.labels["worker_id"], s.labels["role"], s.labels["reason"]): s.value
        for f in telemetry.registry.collect()
        for s in f.samples
        if s.name == "pdserve_worker_ejections_total"
    }
    assert counted == {
        ("d0", "decode", "unavailable"): 1,
        ("d0", "decode", "stalled"): 1,
        ("p0", "prefill", "draining"): 1,
    }
    assert ejection_reason(ClusterAuthError("decode worker d0: refused")) == "cluster_auth"
    assert ejection_reason(UnavailableError("decode worker d0: failed to connect")) == "unavailable"
    assert {"unavailable", "stalled", "draining", "cluster_auth"} < set(EJECTION_REASONS)
    telemetry.shutdown()


def test_max_attempts_below_one_and_a_negative_migration_limit_are_refused():
    with pytest.raises(ValueError, match="max_attempts"):
        RouterConfig(max_attempts=0)
    with pytest.raises(ValueError, match="migration_limit"):
        RouterConfig(migration_limit=-1)


def test_a_prefill_address_inside_another_hosts_name_is_not_the_prefill_worker_named():
    r = Router([worker("p0", address="node-1:7000"), worker("d0", "decode", address="gpu-node-1:7000")])
    placed = r.place(prompt(40), 8, 1.0)
    gone = UnavailableError("decode worker d0 at gpu-node-1:7000: failed to connect (UNAVAILABLE)")
    assert blamed_worker(gone, placed) is placed.decode
    via = UnavailableError("decode worker d0 at gpu-node-1:7000: prefill worker node-1:7000: KV transfer failed")
    assert blamed_worker(via, placed) is placed.prefill


class BrokenReceive(StandInDecode):
    """What a decode worker relays when the prefill worker's KV send to it fails on its own side."""

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
        self.calls += 1
        message = f"prefill worker {request.prefill_address}: KV transfer to decode worker d0 failed: refused"
        await context.abort(grpc.StatusCode.UNAVAILABLE, message)
        yield pb.GenerateResponse()


class HangsAfterHandoff(StandInDecode):
    """A decode worker stopped after it told the router it called its prefill worker (mid KV receive, say)."""

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
        self.calls += 1
        await context.send_initial_metadata(((HANDOFF_STARTED_KEY, "1"),))
        await asyncio.sleep(3600)
        yield pb.GenerateResponse()


@pytest.mark.parametrize(("faulty", "reason"), [(BrokenReceive, "unavailable"), (HangsAfterHandoff, "no_first_token")])
async def test_a_fault_blamed_on_the_prefill_worker_sends_the_retry_to_another_decode_worker(faulty, reason):
    """Which side failed is read from the decode worker's status, and a decode worker's own fault can name its
    prefill worker: the retry then avoids both, so it reaches a healthy decode worker instead of going back to
    the faulty one (which has the most free blocks) until the attempts run out. The prefill worker is ejected, and
    counted so, for what failed."""
    bad, healthy = faulty(), StandInDecode()
    telemetry = Telemetry("test-router")
    async with serving(bad) as d0, serving(healthy) as d1:
        r = Router(
            [worker("p0"), worker("d0", "decode", address=d0), worker("d1", "decode", address=d1, kv_blocks_free=2048)],
            first_token_timeout_s=0.5,
        )
        req = pb.GenerateRequest(prompt_token_ids=[5, 6, 7, 8], sampling=pb.SamplingParams(max_tokens=4))

        async def admitted(ticket: object) -> None:
            pass

        lifecycle = r.lifecycle(telemetry=telemetry)
        tokens = [t async for msg in generate(lifecycle, req, {}, lambda: 10.0, admitted) for t in msg.token_ids]
    assert len(tokens) == 4 and (bad.calls, healthy.calls) == (1, 1)
    ejected = [
        (s.labels["worker_id"], s.labels["role"], s.labels["reason"], s.value)
        for f in telemetry.registry.collect()
        for s in f.samples
        if s.name == "pdserve_worker_ejections_total"
    ]
    assert ejected == [("p0", "prefill", reason, 1.0)]
    telemetry.shutdown()


class FailsFirst(StandInDecode):
    """A decode worker whose engine thread is down: UNAVAILABLE before any message."""

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
        self.calls += 1
        await context.abort(grpc.StatusCode.UNAVAILABLE, "engine thread is down")
        yield pb.GenerateResponse()


async def test_a_retry_never_goes_to_a_decode_worker_whose_kv_cannot_hold_the_request():
    """Decode workers of different KV sizes (mixed GPUs): a retry is not judged by admission again, so placement
    itself keeps it off a worker too small for prompt + max_tokens, which would refuse it as INVALID_ARGUMENT (a
    promise that no retry succeeds). With no other worker holding it, the failure itself is the answer."""
    big, small = FailsFirst(), StandInDecode()
    async with serving(big) as d0, serving(small) as d1:
        r = Router(
            [
                worker("p0"),
                worker("d0", "decode", address=d0),
                worker("d1", "decode", address=d1, kv_blocks_total=2, kv_blocks_free=2),
            ]
        )
        req = pb.GenerateRequest(prompt_token_ids=[5, 6, 7, 8], sampling=pb.SamplingParams(max_tokens=40))

        async def admitted(ticket: object) -> None:
            pass

        with pytest.raises(UnavailableError, match="engine thread is down"):
            async for _ in generate(r.lifecycle(), req, {}, lambda: 10.0, admitted):
                pass
        assert big.calls >= 1 and small.calls == 0
        placed = await r.placement.place([5, 6, 7, 8], 12, 1.0, avoid=frozenset({"d0"}), must_hold=True)
        assert placed.decode.worker_id == "d1"  # a request it holds (1 block) still goes there
        placed = await r.placement.place(list(range(5, 25)), 13, 1.0, avoid=frozenset({"d0"}), must_hold=True)
        assert placed.decode.worker_id == "d1"  # 20 + 13 - 1 slots, its whole KV: the last token is never written


async def test_placement_keeps_a_prompt_off_a_prefill_worker_whose_kv_cannot_hold_it():
    """Prefill workers of different KV sizes: the prompt (5 blocks of 16 tokens) goes to the one that holds it,
    though the small one comes first (the same predicted TTFT, the lower id); with must_hold (a retry) and only
    the small one live, no placement at all, rather than one refused as invalid."""
    r = Router([worker("p-a", kv_blocks_total=4), worker("p-big"), worker("d0", "decode")])
    for must_hold in (False, True):
        placed = await r.placement.place(prompt(80), 8, 1.0, must_hold=must_hold)
        assert placed.prefill_worker.worker_id == "p-big"
    with pytest.raises(UnavailableError, match="no live prefill worker holds 5 KV blocks"):
        await r.placement.place(prompt(80), 8, 1.0, avoid=frozenset({"p-big"}), must_hold=True)
    assert (await r.placement.place(prompt(40), 8, 1.0, avoid=frozenset({"p-big"}))).prefill_worker.worker_id == "p-a"


async def test_a_retry_waits_rather_than_go_to_a_worker_whose_kv_cannot_hold_it():
    """A retry (must_hold) is not judged by admission again: with no prefill worker, live or registered, whose KV
    holds its prompt, no placement (it waits, then UNAVAILABLE), where a new request goes to the small one, which
    refuses it. Colocated, only a worker whose whole KV holds prompt + max_tokens takes it, though one that cannot
    comes first (neither has room now; the same TTFT, the lower id)."""
    alone = Router([worker("p-a", kv_blocks_total=4), worker("d0", "decode")])
    with pytest.raises(UnavailableError, match="no live prefill worker holds 5 KV blocks"):
        await alone.placement.place(prompt(80), 8, 1.0, must_hold=True)
    colocated = Router(
        [worker("c-a", "colocated", kv_blocks_total=4, kv_blocks_free=0), worker("c-b", "colocated", kv_blocks_free=0)]
    )
    assert (await colocated.placement.place(prompt(80), 8, 1.0)).decode.worker_id == "c-a"
    placed = await colocated.placement.place(prompt(80), 8, 1.0, must_hold=True)
    assert (placed.decode.worker_id, placed.prefill) == ("c-b", None)


async def test_a_prompt_only_a_draining_or_ejected_prefill_worker_holds_waits_for_it():
    """Not sent to the small live one, whose refusal (INVALID_ARGUMENT: never) would be false once the big one is
    back: no placement (the request waits up to no_workers_wait_s, then UNAVAILABLE). With no worker that could
    ever hold it, the small one's refusal is the truth."""
    draining = Router([worker("p-a", kv_blocks_total=4), worker("p-big", draining=True), worker("d0", "decode")])
    with pytest.raises(UnavailableError, match="no live prefill worker holds 5 KV blocks"):
        await draining.placement.place(prompt(80), 8, 1.0)
    big = worker("p-big")
    ejected = Router([worker("p-a", kv_blocks_total=4), big, worker("d0", "decode")])
    ejected.placement.ejections.eject(big, "stalled")
    with pytest.raises(UnavailableError, match="no live prefill worker holds 5 KV blocks"):
        await ejected.placement.place(prompt(80), 8, 1.0)
    alone = Router([worker("p-a", kv_blocks_total=4), worker("d0", "decode")])
    assert (await alone.placement.place(prompt(80), 8, 1.0)).prefill_worker.worker_id == "p-a"
