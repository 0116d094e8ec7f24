"""A stream whose decode worker dies is moved with the tokens already sent; when the worker it moves to has no
room for it (its reservation refused: RESOURCE_EXHAUSTED), that is not the caller's overload to retry, since a
retry would start over. Through a real lifecycle against stand-in decode workers on real gRPC servers: the stream
moves on to a worker with room, without ejecting the full one, or ends UNAVAILABLE."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import replace

import grpc
import pytest

from pdserve.errors import OverloadedError, UnavailableError
from pdserve.rpc.errors import RETRY_PUSHBACK_KEY
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import worker_pb2 as wpb
from services.router.generation import generate
from services.router.lifecycle import RequestLifecycle
from services.router.ticket import Ticket
from tests.unit.router.router_builder import Router, worker
from tests.unit.router.stand_in_decode import StandInDecode, serving

pytestmark = pytest.mark.timeout(60)
MAX_TOKENS = 6


class DiesAfter(StandInDecode):
    """Streams `sent` tokens, then fails as a lost worker does."""

    def __init__(self, sent: int) -> None:
        super().__init__()
        self.sent = sent

    async def Generate(  # noqa: N802
        self, request: wpb.WorkerGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.calls += 1
        for i in range(self.sent):
            yield pb.GenerateResponse(token_ids=[3 + i])
        await context.abort(grpc.StatusCode.UNAVAILABLE, "engine thread is down")


class Full(StandInDecode):
    """Refuses every request as a decode worker whose KV pool cannot reserve the prompt does."""

    async def Generate(  # noqa: N802
        self, request: wpb.WorkerGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.calls += 1
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free KV blocks")
        yield pb.GenerateResponse()  # unreachable: makes this a stream handler


class FullUntilFreed(StandInDecode):
    """Refuses as a decode worker whose batch is full does (with a retry hint of `hint_ms`, or none: the router
    takes 1 s), until `full` is cleared: then streams."""

    def __init__(self, hint_ms: int = 0) -> None:
        super().__init__()
        self.full, self.refused, self.hint_ms = True, 0, hint_ms

    async def Generate(  # noqa: N802
        self, request: wpb.WorkerGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        if self.full:
            self.refused += 1
            hint = ((RETRY_PUSHBACK_KEY, str(self.hint_ms)),) if self.hint_ms else ()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "its batch is full", trailing_metadata=hint)
        async for msg in super().Generate(request, context):
            yield msg


class Batch(StandInDecode):
    """A batch of `size` places, `busy` of them held by other routers' streams: refuses a stream when full."""

    def __init__(self, size: int, busy: int) -> None:
        super().__init__(gap_s=0.1)
        self.size, self.busy, self.running, self.refused = size, busy, 0, 0

    async def Generate(  # noqa: N802
        self, request: wpb.WorkerGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        if self.busy + self.running >= self.size:
            self.refused += 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "its batch is full")
        self.running += 1
        try:
            async for msg in super().Generate(request, context):
                yield msg
        finally:
            self.running -= 1


async def stream(lc: RequestLifecycle, out: list[int], max_tokens: int = MAX_TOKENS) -> None:
    async def admitted(ticket: Ticket) -> None:
        pass

    request = pb.GenerateRequest(prompt_token_ids=[5, 6, 7, 8], sampling=pb.SamplingParams(max_tokens=max_tokens))
    async for msg in generate(lc, request, {}, lambda: 10.0, admitted):
        out.extend(msg.token_ids)


async def test_a_stream_moved_to_a_full_worker_moves_on_to_one_with_room():
    dying, full, roomy = DiesAfter(sent=2), Full(), StandInDecode()
    async with serving(dying) as d0, serving(full) as d1, serving(roomy) as d2:
        # Placement prefers the most free blocks: the dying worker, then the full one, then the last.
        workers = [worker("d0", "decode", address=d0), worker("d1", "decode", address=d1, kv_blocks_free=2048)]
        router = Router([worker("p0"), *workers, worker("d2", "decode", address=d2, kv_blocks_free=1024)])
        out: list[int] = []
        await stream(router.lifecycle(), out)
    assert len(out) == MAX_TOKENS and (dying.calls, full.calls, roomy.calls) == (1, 1, 1)
    ejected = router.placement.ejections.ejected
    assert ejected(workers[0]) and not ejected(workers[1])  # full is not failed: it takes other requests


async def test_a_stream_with_only_a_full_worker_left_ends_unavailable_not_resource_exhausted():
    async with serving(DiesAfter(sent=2)) as d0, serving(Full()) as d1:
        router = Router(
            [worker("p0"), worker("d0", "decode", address=d0), worker("d1", "decode", address=d1, kv_blocks_free=2048)]
        )
        out: list[int] = []
        with pytest.raises(UnavailableError, match="no free KV blocks"):
            await stream(router.lifecycle(), out)
    assert len(out) == 2


async def test_a_moved_stream_waits_for_a_place_in_a_full_batch_instead_of_spending_its_moves_on_refusals():
    """The only other decode worker reports a full batch; a sequence there ends 0.3 s later (within the router's
    no-workers wait): the stream moves there once, when it has room, and completes. Admission meanwhile counts it
    waiting, so no new request takes that place."""
    dying, packed = DiesAfter(sent=2), FullUntilFreed()
    async with serving(dying) as d0, serving(packed) as d1:
        full = worker("d1", "decode", address=d1, kv_blocks_free=2048, sequences=4, max_num_seqs=4)
        router = Router([worker("p0"), worker("d0", "decode", address=d0), full])

        async def a_sequence_ends() -> int:
            await asyncio.sleep(0.3)
            packed.full = False
            waiting = router.tracker.moving  # new requests leave the stream the place that frees
            router.registry.publish(replace(full, sequences=3, updated_at=time.time()))
            return waiting

        out: list[int] = []
        _, waiting = await asyncio.gather(stream(router.lifecycle(), out), a_sequence_ends())
    assert len(out) == MAX_TOKENS and (packed.refused, packed.calls) == (0, 1)
    assert (waiting, router.tracker.moving) == (1, 0)


async def waits(router: Router, moving: Coroutine[object, object, None]) -> tuple[int, BaseException | None]:
    """Runs the stream `moving`; returns how many times the router began to wait for room for it (its count of
    streams waiting to move rising), sampled far more often than a wait lasts, and how the stream failed."""
    done, rises, last = asyncio.ensure_future(moving), 0, 0
    while not done.done():
        rises += last == 0 < router.tracker.moving
        last = router.tracker.moving
        await asyncio.sleep(0.01)
    return rises, done.exception()


async def test_a_moved_stream_goes_at_once_to_a_worker_with_blocks_for_its_prompt_though_not_for_all_it_may_add():
    """A decode worker reserves the prompt's blocks (the stream's tokens so far), not max_tokens' too: one with
    that much free takes the stream with no wait for room."""
    async with serving(DiesAfter(sent=2)) as d0, serving(roomy := StandInDecode()) as d1:
        tight = worker("d1", "decode", address=d1, kv_blocks_free=1, max_num_seqs=4)  # 1 block: the 6 tokens
        router = Router([worker("p0"), worker("d0", "decode", address=d0), tight], no_workers_wait_s=2.0)
        out: list[int] = []
        assert await waits(router, stream(router.lifecycle(), out, max_tokens=40)) == (0, None)
    assert len(out) == 40 and roomy.calls == 1


async def test_a_stream_waits_for_room_once_not_at_each_move():
    """Every move after the first wait for room (1.5 s here) waits out the refusing worker's hint alone (50 ms) and
    goes to the best placement there is: with moves refused by a full worker the stream waits for room once, then
    fails. Waiting for room at each move too would take at least 1.5 s more per move."""
    async with serving(DiesAfter(sent=2)) as d0, serving(packed := FullUntilFreed(hint_ms=50)) as d1:
        full = worker("d1", "decode", address=d1, kv_blocks_free=2048, sequences=4, max_num_seqs=4)
        router = Router([worker("p0"), worker("d0", "decode", address=d0), full], no_workers_wait_s=1.5)
        started = time.monotonic()
        rises, failed = await waits(router, stream(router.lifecycle(), []))
        took = time.monotonic() - started
    assert rises >= 1 and isinstance(failed, UnavailableError) and "batch is full" in str(failed)
    assert packed.refused >= 2 and took < 1.5 + 0.75 * (packed.refused - 1)
    assert router.tracker.moving == 0  # no longer waiting: new requests take every place again


async def test_a_move_refused_for_room_waits_out_the_workers_retry_hint_before_the_next():
    """A soak saw a stream's three moves spent on one full decode worker within 0.1 s: after the wait for room, each
    move went to it at once. Now each waits the refusing worker's hint (1 s; at most no_workers_wait_s): a sequence
    ending there meanwhile lets the next move in."""
    async with serving(DiesAfter(sent=2)) as d0, serving(packed := FullUntilFreed()) as d1:
        full = worker("d1", "decode", address=d1, kv_blocks_free=2048, sequences=4, max_num_seqs=4)
        router = Router([worker("p0"), worker("d0", "decode", address=d0), full], no_workers_wait_s=2.0)

        async def frees_after_its_first_refusal() -> None:
            while not packed.refused:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)
            packed.full = False

        out: list[int] = []
        await asyncio.gather(stream(router.lifecycle(), out), frees_after_its_first_refusal())
    assert len(out) == MAX_TOKENS and (packed.refused, packed.calls) == (1, 1)


async def test_a_place_freed_while_a_refused_stream_waits_out_the_hint_is_left_to_the_stream():
    """A stream refused for room waits out the worker's hint (1 s). A place that frees there meanwhile is the
    stream's: a new request is shed (its caller can retry), where it took the place and the stream, mid-answer,
    spent its moves on refusals and failed."""
    async with serving(DiesAfter(sent=2)) as d0, serving(batch := Batch(size=4, busy=4)) as d1:
        full = worker("d1", "decode", address=d1, kv_blocks_free=2048, sequences=4, max_num_seqs=4)
        router = Router([worker("p0"), worker("d0", "decode", address=d0), full], no_workers_wait_s=1.0)
        lc, out = router.lifecycle(), []
        moving = asyncio.ensure_future(stream(lc, out))
        while not batch.refused:  # it waited for room (1 s), went to d1 anyway and was refused
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # within the hint: a sequence on d1 ends, and its heartbeat says so
        batch.busy = 3
        router.registry.publish(replace(full, sequences=3, updated_at=time.time()))
        waiting = router.tracker.moving
        with pytest.raises(OverloadedError, match="no decode worker has room"):
            await stream(lc, [], max_tokens=60)
        await moving
    assert waiting == 1 and len(out) == MAX_TOKENS and batch.refused == 1


async def test_a_refused_attempt_holds_no_place_on_the_worker_while_its_stream_waits_to_move_again():
    """Its refusal ended the attempt there: counted on d1 until the next attempt was made, it made d1's one place
    look taken, and the stream waited all of no_workers_wait_s for a place that was free."""
    async with serving(DiesAfter(sent=2)) as d0, serving(packed := FullUntilFreed()) as d1:
        one = worker("d1", "decode", address=d1, kv_blocks_free=2048, sequences=0, max_num_seqs=1)
        router = Router([worker("p0"), worker("d0", "decode", address=d0), one], no_workers_wait_s=3.0)
        out: list[int] = []
        moving = asyncio.ensure_future(stream(router.lifecycle(), out))
        while not packed.refused:  # another router's stream took the place d1 reported free; it ends at once
            await asyncio.sleep(0.005)
        packed.full = False
        await asyncio.sleep(0.3)  # within the hint (1 s)
        held = router.tracker.decoding["d1"]
        await moving
    assert held == 0 and len(out) == MAX_TOKENS and (packed.refused, packed.calls) == (1, 1)


async def test_a_moved_stream_the_caller_stops_reading_is_released_at_once():
    """The caller closes the stream after the move: the moved attempt's ticket is released before the close
    returns, not later by the garbage collector's hook in another task."""

    async def admitted(ticket: Ticket) -> None:
        pass

    async with serving(DiesAfter(sent=2)) as d0, serving(StandInDecode(gap_s=0.2)) as d1:
        router = Router(
            [worker("p0"), worker("d0", "decode", address=d0), worker("d1", "decode", address=d1, kv_blocks_free=2048)]
        )
        lc = router.lifecycle()
        stream = generate(
            lc,
            pb.GenerateRequest(prompt_token_ids=[5, 6, 7, 8], sampling=pb.SamplingParams(max_tokens=40)),
            {},
            lambda: 10.0,
            admitted,
        )
        got = [await anext(stream) for _ in range(3)]  # two from d0, the third from d1 after the move
        assert lc.in_flight == 1
        await stream.aclose()
        assert lc.in_flight == 0
    assert len(got) == 3


async def test_a_request_refused_as_full_before_its_first_token_goes_to_another_worker_with_room():
    """Several routers share the decode workers: one this router saw room on may be full when the request gets
    there (another router's stream took the place). Another worker with room takes it; the full one is not
    ejected. (It reached the caller as RESOURCE_EXHAUSTED while the other worker had room.)"""
    async with serving(packed := FullUntilFreed()) as d0, serving(roomy := StandInDecode()) as d1:
        # Placement prefers the most free blocks: the full one first.
        workers = [worker("d0", "decode", address=d0), worker("d1", "decode", address=d1, kv_blocks_free=1024)]
        router = Router([worker("p0"), *workers])
        out: list[int] = []
        await stream(router.lifecycle(), out)
    assert len(out) == MAX_TOKENS and (packed.refused, roomy.calls) == (1, 1)
    assert not router.placement.ejections.ejected(workers[0])


async def test_a_request_refused_as_full_with_no_other_worker_with_room_is_shed_at_once():
    """The other decode worker reports a full batch: the refusal reaches the caller as the overload it is
    (RESOURCE_EXHAUSTED, a retry may fit), with no call to a worker this router knows is full."""
    async with serving(packed := FullUntilFreed()) as d0, serving(other := FullUntilFreed()) as d1:
        full = worker("d1", "decode", address=d1, sequences=4, max_num_seqs=4)
        router = Router([worker("p0"), worker("d0", "decode", address=d0, kv_blocks_free=8192), full])
        with pytest.raises(OverloadedError, match="batch is full"):
            await stream(router.lifecycle(), [])
    assert (packed.refused, other.refused) == (1, 0)
