"""The client's own part in what it measures: its in-flight bound (when it is loadgen's, not the user's
--max-concurrency) must not hide queueing from the latencies, and a stream with no token is no success."""

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
from loadgen.record import EMPTY_STREAM, RequestRecord
from loadgen.workload import Request

FIRST_TOKEN_S = 0.1


class TimedBackend:
    """A server that answers every request with one token after FIRST_TOKEN_S, or none for an empty prompt."""

    @asynccontextmanager
    async def session(self, max_in_flight: int) -> AsyncIterator[Send]:
        async def send(req: Request, record: RequestRecord) -> None:
            await asyncio.sleep(FIRST_TOKEN_S)
            record.message_times_s.append(FIRST_TOKEN_S)
            record.message_tokens.append(1 if req.prompt_token_ids else 0)

        yield send


BURST = [Request([1, 2, 3], output_len=1) for _ in range(6)]  # all due at once


async def test_requests_held_back_by_loadgens_own_bound_are_timed_from_their_arrival(monkeypatch):
    monkeypatch.setattr(client_module, "DEFAULT_MAX_IN_FLIGHT", 2)
    records, _ = await Client(TimedBackend()).run(BURST)
    ttfts = sorted(metrics.ttft_s(r) for r in records)
    assert ttfts[-1] >= 3 * FIRST_TOKEN_S * 0.9  # the third pair waited two answers for a slot
    assert metrics.summarize(records, 1.0, GoodputSLO(ttft_ms=150))["slo_attainment"] == pytest.approx(2 / 6)


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
