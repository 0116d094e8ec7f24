"""The decode stream after its first message: what queued while the router was busy comes back as one message,
and a stream that goes silent mid-stream is cancelled and blamed on its decode worker."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.config import RouterConfig
from pdserve.errors import UnavailableError
from pdserve.v1 import generate_pb2 as pb
from services.router.retry import blamed_worker
from services.router.stream_reader import StreamReader
from tests.unit.router.router_builder import Router, prompt, worker


class Call:
    """A stream whose items come after the given delays, then never (a SIGSTOPped worker keeps it open)."""

    def __init__(self, *items: tuple[float, object]) -> None:
        self.items = list(items)
        self.cancelled = False

    async def read(self) -> object:
        if not self.items:
            await asyncio.Event().wait()
        delay, item = self.items.pop(0)
        await asyncio.sleep(delay)
        if isinstance(item, Exception):
            raise item
        return item

    def cancel(self) -> bool:
        self.cancelled = True
        return True


def token(i: int, finish: int = pb.FINISH_REASON_UNSPECIFIED) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(request_id="r", token_ids=[i], text=str(i), finish_reason=finish)
    if finish:
        msg.usage.cached_prompt_tokens = 16
    return msg


PLACED = Router([worker("p0"), worker("d0", "decode")]).place(prompt(40), 8, 1.0)


def test_what_queued_while_the_router_was_busy_comes_back_as_one_message_then_eof():
    call = Call((0, token(1)), (0, token(2)), (0, token(3, pb.FINISH_REASON_LENGTH)), (0, grpc.aio.EOF))

    async def run() -> list[object]:
        reader = StreamReader(call, 1.0, PLACED.decode)
        await asyncio.sleep(0.05)  # the router busy elsewhere: all of it arrives meanwhile
        return [await reader.read(), await reader.read()]

    merged, end = asyncio.run(run())
    assert list(merged.token_ids) == [1, 2, 3] and merged.text == "123"
    assert merged.finish_reason == pb.FINISH_REASON_LENGTH and merged.usage.cached_prompt_tokens == 16
    assert end is grpc.aio.EOF


def test_a_router_that_keeps_up_passes_each_message_on_alone():
    call = Call((0.02, token(1)), (0.02, token(2)), (0.02, grpc.aio.EOF))

    async def run() -> list[object]:
        reader = StreamReader(call, 1.0, PLACED.decode)
        return [await reader.read() for _ in range(3)]

    first, second, end = asyncio.run(run())
    assert list(first.token_ids) == [1] and list(second.token_ids) == [2] and end is grpc.aio.EOF


def test_the_messages_before_a_failure_come_first_then_the_failure():
    failure = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone")
    call = Call((0, token(1)), (0, token(2)), (0, failure))

    async def run() -> tuple[object, BaseException]:
        reader = StreamReader(call, 1.0, PLACED.decode)
        await asyncio.sleep(0.05)
        merged = await reader.read()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await reader.read()
        return merged, err.value

    merged, error = asyncio.run(run())
    assert list(merged.token_ids) == [1, 2] and error is failure


def test_a_message_within_the_bound_passes_and_silence_past_it_cancels_the_call_blaming_the_decode_worker():
    placed = PLACED
    call = Call((0.01, grpc.aio.EOF))

    async def run() -> UnavailableError:
        assert await StreamReader(call, 0.5, placed.decode).read() is grpc.aio.EOF
        silent = Call()
        with pytest.raises(UnavailableError) as err:
            await StreamReader(silent, 0.1, placed.decode).read()
        assert silent.cancelled
        return err.value

    error = asyncio.run(run())
    assert "d0" in str(error) and "stall bound" in str(error)
    assert blamed_worker(error, placed) is placed.decode  # ejected, and the request migrates


def test_the_stall_bound_must_be_a_positive_number():
    assert RouterConfig().stall_timeout_s == 5.0
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="stall_timeout_s"):
            RouterConfig(stall_timeout_s=bad)
