"""The stall bound: a decode stream that goes silent mid-stream is cancelled and blamed on its decode worker."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from pdserve.config import RouterConfig
from pdserve.errors import UnavailableError
from pdserve.protocol.outputs import PREEMPTED_NOTICE_S
from pdserve.rpc.server import channel
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc
from services.router.retry import blamed_worker, ejection_reason
from services.router.stall import read_within
from tests.unit.router.router_builder import Router, prompt, worker
from tests.unit.router.stand_in_decode import StandInDecode, serving


class Call:
    """A stream whose messages come after the given delays, then never (a SIGSTOPped worker keeps it open)."""

    def __init__(self, *delays_s: float) -> None:
        self.delays = list(delays_s)
        self.cancelled = False

    async def read(self) -> object:
        if not self.delays:
            await asyncio.Event().wait()
        await asyncio.sleep(self.delays.pop(0))
        return grpc.aio.EOF

    def cancel(self) -> bool:
        self.cancelled = True
        return True


def test_a_message_within_the_bound_passes_and_silence_past_it_cancels_the_call_blaming_the_decode_worker():
    router = Router([worker("p0"), worker("d0", "decode")])
    placed = router.place(prompt(40), 8, 1.0)
    call = Call(0.01)

    async def run() -> UnavailableError:
        assert await read_within(call, 0.5, placed.decode) is None  # the stream's end
        with pytest.raises(UnavailableError) as err:
            await read_within(call, 0.1, placed.decode)
        return err.value

    error = asyncio.run(run())
    assert call.cancelled
    assert "d0" in str(error) and "stall bound" in str(error)
    assert blamed_worker(error, placed) is placed.decode  # ejected, and the request migrates
    assert ejection_reason(error) == "stalled"  # counted apart from a worker lost


def test_the_stall_bound_must_be_a_positive_number():
    assert RouterConfig().stall_timeout_s == 5.0
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="stall_timeout_s"):
            RouterConfig(stall_timeout_s=bad)


def test_the_stall_bound_outlasts_two_preemption_notices():
    """A bound within a notice or two of silence would move a stream its decode worker preempted."""
    assert RouterConfig(stall_timeout_s=2 * PREEMPTED_NOTICE_S).stall_timeout_s == 2.0
    for short in (PREEMPTED_NOTICE_S, 1.9):
        with pytest.raises(ValueError, match="stall_timeout_s must be at least 2 s"):
            RouterConfig(stall_timeout_s=short)


async def tokens_read_through_a_hold(bound_s: float, hold_at_s: float) -> int:
    """The tokens read, each within `bound_s`, from a stand-in decode worker sending 60 tokens 20 ms apart, while
    the reading loop is held for 1.5 s `hold_at_s` after the first."""
    decode = worker("d0", "decode")
    async with serving(StandInDecode(gap_s=0.02)) as address, channel(address) as ch:
        call = worker_pb2_grpc.DecodeWorkerStub(ch).Generate(
            wpb.WorkerGenerateRequest(request_id="r", sampling=pb.SamplingParams(max_tokens=60))
        )
        assert await read_within(call, bound_s, decode) is not None
        asyncio.get_running_loop().call_later(hold_at_s, time.sleep, 1.5)
        tokens = 1
        while await read_within(call, bound_s, decode) is not None:
            tokens += 1
    return tokens


async def test_a_router_loop_held_past_the_bound_is_not_a_stalled_worker():
    """The router's own event loop held for 1.5 s (a huge JSON body parsed, a long GC) while a decode worker
    streams a token every 20 ms: its messages wait in the channel, and the 0.5 s bound must not count the time the
    router could not read them (before, it cancelled the healthy worker's stream and ejected the worker)."""
    assert await tokens_read_through_a_hold(0.5, 0.1) == 60


async def test_a_router_loop_held_past_the_bound_and_all_its_graces_at_once_is_not_a_stalled_worker(monkeypatch):
    """One hold longer than the bound plus HELD_MAX_S (a router SIGSTOPped 20 s, a frozen VM): its first check
    runs that late, the healthy worker's messages waiting unread. It blamed every decode worker (a fault review)."""
    from services.router import stall

    monkeypatch.setattr(stall, "HELD_MAX_S", 0.2)
    assert await tokens_read_through_a_hold(0.3, 0.05) == 60


async def test_a_silent_worker_is_still_caught_after_the_loop_was_held():
    decode = worker("d0", "decode")
    call = Call()  # never sends
    asyncio.get_running_loop().call_later(0.05, time.sleep, 0.3)
    started = time.monotonic()
    with pytest.raises(UnavailableError, match="stall bound"):
        await read_within(call, 0.1, decode)
    assert call.cancelled and time.monotonic() - started < 2.0  # the bound, the hold, one grace


async def test_a_loop_late_at_every_check_still_catches_a_silent_worker(monkeypatch):
    """Each check runs late (the loop held 80 ms a turn): graces are given only until the bound plus HELD_MAX_S
    has passed, so a silent worker is caught then, not only once the loop stops being late."""
    from services.router import stall

    monkeypatch.setattr(stall, "HELD_MAX_S", 1.0)
    loop = asyncio.get_running_loop()

    def hog() -> None:
        time.sleep(0.08)
        handle[0] = loop.call_soon(hog)

    handle = [loop.call_soon(hog)]
    started = time.monotonic()
    try:
        with pytest.raises(UnavailableError, match="stall bound"):
            await read_within(Call(), 0.2, worker("d0", "decode"))
    finally:
        handle[0].cancel()
    assert time.monotonic() - started < 0.2 + 1.0 + 1.0  # the bound, HELD_MAX_S, a grace and the last hold
