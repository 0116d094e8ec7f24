"""The client's own part in what it measures: its in-flight bound is timed by one rule whichever set it, its own
lateness is not the server's, and a stream with no token is no success."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from loadgen import client as client_module
from loadgen import metrics
from loadgen.client import Client, Send
from loadgen.metrics import GoodputSLO
from loadgen.pacing import pacing
from loadgen.record import EMPTY_STREAM, RequestRecord
from loadgen.workload import Request
from tests.unit.loadgen.scripted import ScriptedBackend

FIRST_TOKEN_S = 0.1


class TimedBackend:
    """A server that answers every request with one token after FIRST_TOKEN_S, or none for an empty prompt."""

    @asynccontextmanager
    async def session(self, max_concurrency: int) -> AsyncIterator[Send]:
        async def send(req: Request, record: RequestRecord) -> None:
            await asyncio.sleep(FIRST_TOKEN_S)
            record.message_times_s.append(FIRST_TOKEN_S)
            record.message_tokens.append(1 if req.prompt_token_ids else 0)

        yield send


BURST = [Request([1, 2, 3], output_len=1) for _ in range(6)]  # all due at once


async def test_one_rule_for_either_bound_the_hold_is_recorded_and_not_in_the_latencies(monkeypatch):
    """The default bound and --max-concurrency of the same size give the same latencies: each request is timed
    from its send, its wait for a slot recorded apart (the default's hold counted in TTFT, the flag's not)."""
    monkeypatch.setattr(client_module, "DEFAULT_MAX_CONCURRENCY", 2)
    for bound in (None, 2):
        records, _ = await Client(ScriptedBackend([(0.25, 1)]), max_concurrency=bound).run(BURST)
        assert [metrics.ttft_s(r) for r in records] == [0.25] * 6
        assert all(r.wait_s > 0 for r in records[2:])  # four waited for one of the two slots


async def test_the_clients_own_lateness_is_not_counted_as_the_servers():
    """A stall of loadgen's loop (a slow callback, a GC) delays the sends due meanwhile; with its bound never
    reached, none of that is a wait for the bound, and the TTFTs stay the server's."""
    stalled = []

    def stall_once(record: RequestRecord) -> None:
        if not stalled:
            stalled.append(record)
            time.sleep(5 * FIRST_TOKEN_S)

    paced = [Request([1, 2, 3], output_len=1, arrival_s=i * FIRST_TOKEN_S / 2) for i in range(6)]
    records, _ = await Client(TimedBackend()).run(paced, stall_once)
    assert all(r.wait_s < FIRST_TOKEN_S / 10 for r in records)
    assert max(metrics.ttft_s(r) for r in records) < 2 * FIRST_TOKEN_S


async def test_with_max_concurrency_asked_for_requests_are_timed_from_their_send_as_vllm_does():
    records, _ = await Client(TimedBackend(), max_concurrency=2).run(BURST)
    assert max(metrics.ttft_s(r) for r in records) < 2 * FIRST_TOKEN_S


async def test_a_stream_that_ends_ok_without_a_token_is_failed():
    records, _ = await Client(TimedBackend()).run([Request([], output_len=1), Request([1], output_len=1)])
    assert [r.status for r in records] == [EMPTY_STREAM, "OK"]
    summary = metrics.summarize(records, 1.0, GoodputSLO(ttft_ms=1000))
    assert summary["completed"] == 1 and summary["slo_attainment"] == pytest.approx(1 / 2)


BUILD_S = 0.05


class SlowToBuild:
    """A backend whose message takes BUILD_S to build before its send (as a long chat prompt's detokenizing takes
    the openai backend's), which is where it starts the request's clock."""

    @asynccontextmanager
    async def session(self, max_concurrency: int) -> AsyncIterator[Send]:
        async def send(req: Request, record: RequestRecord) -> None:
            time.sleep(BUILD_S)
            record.sent_clock = time.perf_counter()
            record.message_times_s.append(0.001)
            record.message_tokens.append(1)

        yield send


async def test_send_lag_and_the_rate_sent_count_to_the_actual_send_its_message_built():
    """The server is offered each request when it is sent, its message built: a build of BUILD_S is loadgen's own
    lateness, in its send lag (it was counted to the slot the request took before building, so read 0)."""
    paced = [Request([1, 2, 3], output_len=1, arrival_s=0.2 * (i + 1)) for i in range(3)]
    records, _ = await Client(SlowToBuild()).run(paced)
    assert all(r.start_s >= r.scheduled_s + BUILD_S for r in records), [(r.scheduled_s, r.start_s) for r in records]
    figures = pacing(records, 5.0, trace=False)
    assert figures["p50_send_lag_ms"] >= BUILD_S * 1e3 and figures["achieved_request_rate"] <= 3 / (0.6 + BUILD_S)
