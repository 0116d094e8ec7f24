"""The stall bound: a decode stream that goes silent mid-stream is cancelled and blamed on its decode worker."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.config import RouterConfig
from pdserve.errors import UnavailableError
from services.router.retry import blamed_worker
from services.router.stall import read_within
from tests.unit.router.router_builder import Router, prompt, worker


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
        assert await read_within(call, 0.5, placed.decode) is grpc.aio.EOF
        with pytest.raises(UnavailableError) as err:
            await read_within(call, 0.1, placed.decode)
        return err.value

    error = asyncio.run(run())
    assert call.cancelled
    assert "d0" in str(error) and "stall bound" in str(error)
    assert blamed_worker(error, placed) is placed.decode  # ejected, and the request migrates


def test_the_stall_bound_must_be_a_positive_number():
    assert RouterConfig().stall_timeout_s == 5.0
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="stall_timeout_s"):
            RouterConfig(stall_timeout_s=bad)
