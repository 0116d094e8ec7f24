"""A request that finds no live worker of a role waits a moment for one (a drained worker's replacement, a worker
the supervisor lists again) before UNAVAILABLE, through the lifecycle's own admit(); a retry waits a moment for a
worker that did not fail it before it goes back to one that did."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from pdserve.errors import RouterDrainingError, UnavailableError
from pdserve.protocol.roles import Role
from pdserve.registry.base import WorkerState
from pdserve.security.api_keys import OPEN, Tenant
from pdserve.security.quotas import LocalQuotas, Release
from pdserve.telemetry import Telemetry
from pdserve.v1 import generate_pb2 as pb
from services.router.generation import generate
from services.router.lifecycle import RequestLifecycle
from services.router.placement import NoWorkersError
from services.router.retry import FailedWorkers
from services.router.ticket import Ticket
from tests.unit.router.request_counts import requests_by_outcome
from tests.unit.router.router_builder import Router, worker

pytestmark = pytest.mark.timeout(60)
WAIT_S = 4.0  # a moving stream's no_workers_wait_s: far past each bound it is told apart from
REQUEST = pb.GenerateRequest(prompt_token_ids=[5, 6, 7, 8], sampling=pb.SamplingParams(max_tokens=4))


async def admit(lc: RequestLifecycle, start: float) -> Ticket:
    async with lc.quotas.session(OPEN) as quota:
        return await lc.admit(REQUEST, lc.identify(REQUEST), start, quota)


async def test_a_request_waits_for_the_first_worker_of_a_role_to_come_back() -> None:
    router = Router([worker("p0")], no_workers_wait_s=5.0)
    asyncio.get_running_loop().call_later(0.3, router.registry.publish, worker("d0", "decode"))
    start = time.monotonic()
    ticket = await admit(router.lifecycle(), start)
    assert ticket.placement.decode.worker_id == "d0" and 0.25 < time.monotonic() - start < 4.0
    ticket.release()


async def test_with_none_coming_back_it_is_unavailable_after_the_wait() -> None:
    router = Router([worker("p0"), worker("d0", "decode", draining=True)], no_workers_wait_s=0.4)
    start = time.monotonic()
    lists = r"0 decode live .*`pdserve status` lists them\); retry later; the router waited 0.4 s for one"
    with pytest.raises(NoWorkersError, match=lists + r" \(its no_workers_wait_s\)$"):
        await admit(router.lifecycle(), start)
    assert time.monotonic() - start >= 0.4


def failed_at(router: Router, *workers: WorkerState) -> FailedWorkers:
    failed = FailedWorkers()
    failed.add(workers, router.registry, fault=True)
    return failed


async def test_a_moving_stream_waits_for_a_worker_that_did_not_fail_it_or_a_restart_before_going_back() -> None:
    """Going back at once to a worker whose process died spent every move in milliseconds while Ray restarted it
    (a user's review: three migrations in 4 ms, the stream lost). A worker heard from twice since it failed is alive."""
    d0 = worker("d0", "decode")
    router = Router(
        [worker("p0"), d0], no_workers_wait_s=WAIT_S
    )  # far past each bound below: a loaded machine's delays
    lc = router.lifecycle()
    ticket = await admit(lc, time.monotonic())
    ticket.release()
    loop = asyncio.get_running_loop()
    loop.call_later(0.3, router.registry.publish, worker("d1", "decode"))  # another comes
    start = time.monotonic()
    assert (await lc.waits.again(ticket.request, failed_at(router, d0), None)).decode.worker_id == "d1"
    assert 0.25 < time.monotonic() - start < 3.0

    router.registry.remove("d1")
    restarted = worker("d0", "decode", address="d0.local:50052")  # Ray's restart: a new process, a new port
    loop.call_later(0.3, router.registry.publish, restarted)
    start = time.monotonic()
    placement = await lc.waits.again(ticket.request, failed_at(router, d0), None)
    assert placement.decode.address == restarted.address and time.monotonic() - start < 3.0  # not the whole wait

    # Its heartbeats come, twice: alive (a transient failure), gone back to then. One alone may be a stale view's,
    # sent before the failure by a worker dead since: the wait goes on past it.
    failed = failed_at(router, restarted)
    loop.call_later(0.2, router.registry.publish, replace(restarted, updated_at=restarted.updated_at + 1))
    loop.call_later(1.0, router.registry.publish, replace(restarted, updated_at=restarted.updated_at + 2))
    start = time.monotonic()
    assert (await lc.waits.again(ticket.request, failed, None)).decode.worker_id == "d0"
    assert 0.95 < time.monotonic() - start < 3.0
    restarted = router.registry.workers(Role.DECODE)[0]

    start = time.monotonic()  # none comes and no heartbeat (hung): back to the one that failed it, after the wait
    assert (await lc.waits.again(ticket.request, failed_at(router, restarted), None)).decode.worker_id == "d0"
    assert time.monotonic() - start >= WAIT_S
    start = time.monotonic()  # within the caller's deadline
    assert (await lc.waits.again(ticket.request, failed_at(router, restarted), 0.2)).decode.worker_id == "d0"
    assert 0.2 <= time.monotonic() - start < 3.0


def test_heartbeats_from_a_worker_whose_clock_stepped_back_since_it_failed_are_heard() -> None:
    """A heartbeat is told from the last by its own stamp, never by which is later: an NTP step back on the worker's
    host left its next heartbeats "older" than the one before its failure, and it read as dead to moving streams."""
    d0 = worker("d0", "decode")
    router = Router([worker("p0"), d0])
    failed = failed_at(router, d0)
    assert failed.unheard(router.registry) == {"d0"}
    for beat in (1, 2):  # its clock stepped 30 s back
        router.registry.publish(replace(d0, updated_at=d0.updated_at - 30 + beat))
        heard = failed.unheard(router.registry)
    assert heard == frozenset()


async def test_a_retry_waits_as_a_stream_does_no_longer_than_the_wait_over_all_its_moves() -> None:
    """Before its first token too: it went back at once to a dead worker (and failed) while a request arriving
    then waited for the restart. The wait is the request's, not each move's: a worker that never comes back costs
    it `no_workers_wait_s` once, however many attempts it has."""
    d0 = worker("d0", "decode")
    router = Router([worker("p0"), d0], no_workers_wait_s=1.0)
    lc = router.lifecycle()
    ticket = await admit(lc, time.monotonic())
    ticket.release()
    failed, start = failed_at(router, d0), time.monotonic()
    assert (await lc.waits.again(ticket.request, failed, None)).decode.worker_id == "d0"  # never heard from
    assert time.monotonic() - start >= 1.0
    start = time.monotonic()
    assert (await lc.waits.again(ticket.request, failed, None)).decode.worker_id == "d0"
    assert time.monotonic() - start < 0.5  # its wait is spent
    router.registry.refresh_s = 0.5  # as a Redis view: another may be listed already, not yet seen here
    asyncio.get_running_loop().call_later(0.3, router.registry.publish, worker("d1", "decode"))
    start = time.monotonic()
    assert (await lc.waits.again(ticket.request, failed, None)).decode.worker_id == "d1"  # two refreshes, still
    assert time.monotonic() - start > 0.25


async def test_a_drain_counts_a_request_waiting_for_a_worker_and_refuses_it_once_placed() -> None:
    """A drain that starts while a request waits for its placement waits for it too (the server stops only after
    its answer), and the request, once a worker is back, is told the router drains instead of being admitted."""
    router = Router([worker("p0")], no_workers_wait_s=5.0)
    lc = router.lifecycle()
    waiting = asyncio.ensure_future(admit(lc, time.monotonic()))
    await asyncio.sleep(0.2)
    assert lc.in_flight == 1
    lc.draining = True
    router.registry.publish(worker("d0", "decode"))
    with pytest.raises(UnavailableError, match="draining"):
        await waiting
    assert lc.in_flight == 0


class RoundTripQuotas(LocalQuotas):
    """The key's token charge waits a round trip, as RedisQuotas' does; `charging` is set when it begins."""

    def __init__(self) -> None:
        super().__init__()
        self.charging = asyncio.Event()

    async def take_tokens(self, tenant: Tenant, tokens: int) -> Release:
        self.charging.set()
        await asyncio.sleep(0.2)
        return await super().take_tokens(tenant, tokens)


async def test_a_drain_begun_during_the_keys_token_charge_refuses_the_request() -> None:
    """Nothing counts the request in flight while its key is charged: a drain that began then would stop the server
    under it, were it admitted after."""
    quotas = RoundTripQuotas()
    lc = Router([worker("p0"), worker("d0", "decode")]).lifecycle(quotas=quotas)
    tenant = Tenant("team", "k", tokens_per_minute=100_000)

    async def admit_for_the_key() -> Ticket:
        async with lc.quotas.session(tenant) as quota:
            return await lc.admit(REQUEST, lc.identify(REQUEST), time.monotonic(), quota)

    admitting = asyncio.ensure_future(admit_for_the_key())
    await quotas.charging.wait()
    lc.draining = True
    assert lc.in_flight == 0  # what the drain sees: it would stop the server now
    with pytest.raises(RouterDrainingError):
        await admitting


async def test_a_draining_routers_refusal_is_counted_rejected_not_failed() -> None:
    """A rolling restart refuses new requests on the draining replica (UNAVAILABLE: retry on another one): that
    is no failure for an error-rate alert to page on, in the metrics or in the spans' status."""

    async def admitted(ticket: Ticket) -> None:
        pass

    exporter = InMemorySpanExporter()
    telemetry = Telemetry("test-router", SimpleSpanProcessor(exporter))
    lc = Router([worker("p0"), worker("d0", "decode")]).lifecycle(telemetry=telemetry)
    lc.draining = True
    with pytest.raises(UnavailableError, match="draining"):
        async for _ in generate(lc, REQUEST, {}, lambda: 10.0, admitted):
            pass
    assert requests_by_outcome(telemetry) == {("rejected", "anonymous"): 1}
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert "admission" not in spans  # refused before admission, before the key's rate is charged
    assert all(s.status.status_code != StatusCode.ERROR for s in spans.values())
    telemetry.shutdown()
