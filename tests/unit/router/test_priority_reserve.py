"""While requests of a higher priority class are being served, a request below them leaves them the last
`low_priority_reserve` of the room (twice that below priority 0): shed RESOURCE_EXHAUSTED (reason `priority`, with a
retry hint) where a request of the higher class, or the same request with no higher class active, is admitted."""

from __future__ import annotations

import pytest

from pdserve.errors import OverloadedError
from pdserve.v1 import generate_pb2 as pb
from services.router.admission import SLOTarget
from services.router.placement import Placement
from services.router.priority_classes import PriorityClasses
from services.router.tenant_shares import ACTIVE_S
from tests.unit.hand_clock import HandClock
from tests.unit.router.router_builder import Router, prompt, worker
from tests.unit.router.stand_in_decode import OpenStreams, StandInDecode, serving

pytestmark = pytest.mark.timeout(60)
SLO = SLOTarget(5.0, 1.0)


def test_a_class_above_is_active_while_it_streams_or_asked_lately():
    clock = HandClock()
    classes = PriorityClasses(clock)
    assert not classes.higher_active(0) and not classes.higher_active(-3)
    classes.asked(7)
    assert classes.higher_active(0) and classes.higher_active(-1)
    assert not classes.higher_active(1)  # 7 and 1 are one class: the queue bound's, above 0
    clock.now += ACTIVE_S + 1
    assert not classes.higher_active(0)
    classes.entered(2)  # a stream in flight keeps its class active however long it runs
    clock.now += 10 * ACTIVE_S
    assert classes.higher_active(0)
    classes.left(2)
    assert classes.higher_active(0)  # for ACTIVE_S past its last stream
    clock.now += ACTIVE_S + 1
    assert not classes.higher_active(0)
    classes.asked(0)
    assert classes.higher_active(-1) and not classes.higher_active(0)


def place(r: Router, active: tuple[int, ...], tokens: int = 100) -> Placement:
    for priority in active:
        r.admission.classes.asked(priority)
    return r.place(prompt(tokens), 16, SLO.tpot_s)


def check(r: Router, placed: Placement, priority: int) -> None:
    r.admission.check_load(placed, 100, priority, SLO)  # the 100-token prompt `place` placed


def priority_shed(r: Router, placed: Placement, priority: int, what: str) -> None:
    with pytest.raises(OverloadedError, match=what) as info:
        check(r, placed, priority)
    assert info.value.reason == "priority" and 100 <= info.value.retry_after_ms <= 30_000
    assert f"a priority above {priority} are being served" in str(info.value)


def test_the_last_batch_places_are_kept_for_a_higher_class():
    """10 places, 7 held: priority 0 leaves 2 (0.2 of them) and gets in; below 0 it leaves 4 and does not."""
    decode = worker("d0", "decode", sequences=8, max_num_seqs=10)
    r = Router([worker("p0"), decode], low_priority_reserve=0.2)
    placed = place(r, (5,))
    priority_shed(r, placed, 0, "the last 2 batch places of its decode worker")
    check(r, placed, 5)
    check(r, placed, 9)  # a higher priority of the same class leaves nothing to it
    quiet = Router([worker("p0"), decode], low_priority_reserve=0.2)
    check(quiet, place(quiet, ()), 0)  # nobody above asking: it takes the last places
    off = Router([worker("p0"), decode], low_priority_reserve=0.0)
    check(off, place(off, (5,)), 0)
    seven = worker("d0", "decode", sequences=7, max_num_seqs=10)
    r = Router([worker("p0"), seven], low_priority_reserve=0.2)
    placed = place(r, (0,))
    check(r, placed, 0)
    priority_shed(r, placed, -1, "the last 4 batch places of its decode worker")
    r.admission.check_load(placed, 100, -1, SLO, tenant=None)  # a later choice of a request admitted at its first


def test_the_last_kv_blocks_are_kept_for_a_higher_class():
    decode = worker("d0", "decode", kv_blocks_total=1000, kv_blocks_free=150)
    r = Router([worker("p0"), decode], low_priority_reserve=0.2)
    placed = place(r, (1,))
    assert placed.blocks_needed < 150  # it fits in what is free, not beside the 200 kept
    priority_shed(r, placed, 0, "the last 200 KV blocks of its decode worker")
    check(r, placed, 1)


def test_the_last_of_the_prefill_queues_room_is_kept_for_a_higher_class():
    """A queue filling between 80 % and all of what the TTFT SLO leaves sheds only the lower class."""
    r = Router([worker("p0"), worker("d0", "decode")], max_queued_prefill_tokens=10**6)
    empty = r.place(prompt(100), 16, SLO.tpot_s)
    room = 0.8 * (SLO.ttft_s - empty.own_ttft_s)  # slo_headroom's share of what the request's own cost leaves
    per_token = r.predictor.queue_s(worker("p0", queued_prefill_tokens=10_000)) / 10_000
    r = Router(
        [worker("p0", queued_prefill_tokens=int(0.9 * room / per_token)), worker("d0", "decode")],
        max_queued_prefill_tokens=10**6,
    )
    placed = place(r, (3,))
    assert 0.8 * room < placed.queue_s <= room
    priority_shed(r, placed, 0, "the last 20% of its prefill worker's queue room")
    check(r, placed, 3)


async def test_through_the_request_path_a_stream_of_a_higher_class_keeps_the_last_place():
    """Real gRPC to a stand-in decode worker of 5 batch places: a priority 2 stream in flight keeps the last
    place (0.2 of 5) from priority 0, whose fourth stream is shed; a second priority 2 stream takes it."""
    stand_in = StandInDecode(gap_s=1.0)
    async with serving(stand_in) as address:
        decode = worker("d0", "decode", address=address, max_num_seqs=5)
        lifecycle = Router([worker("p0"), decode], low_priority_reserve=0.2).lifecycle()
        streams = OpenStreams(lifecycle)

        async def opened(priority: int) -> None:
            msg = pb.GenerateRequest(prompt_token_ids=[5, 6, 7, 8], sampling=pb.SamplingParams(max_tokens=50))
            msg.priority = priority
            await streams.open(msg)

        try:
            for priority in (2, 0, 0):
                await opened(priority)
            await opened(0)  # 4 of 5 held after it: the one left is the reserve
            with pytest.raises(OverloadedError, match="a priority above 0 are being served") as shed:
                await opened(0)
            assert shed.value.reason == "priority"
            await opened(2)  # the kept place
            assert dict(lifecycle.admission.classes.in_flight) == {1: 2, 0: 3}
            assert [r.priority for r in stand_in.requests] == [2, 0, 0, 0, 2]
        finally:
            await streams.close()
        assert not +lifecycle.admission.classes.in_flight


def test_an_idle_worker_takes_any_request_that_fits_it_whatever_the_reserve():
    """Kept room never shuts out a request an idle worker holds: refused there, it would be refused for as long as
    the class the room is kept for asks, its retry hint never coming true."""
    one_place = worker("d0", "decode", max_num_seqs=1)
    r = Router([worker("p0"), one_place], low_priority_reserve=0.2)
    check(r, place(r, (5,)), 0)  # 0.2 of 1 place rounds up to the only place: none is kept
    small = worker("d0", "decode", kv_blocks_total=100, kv_blocks_free=100)
    r = Router([worker("p0", kv_blocks_total=100, kv_blocks_free=100), small], low_priority_reserve=0.5)
    placed = r.place(prompt(100), 1200, SLO.tpot_s)
    assert 60 < placed.blocks_needed <= 100  # past what a reserve of 0.5 (twice it below 0) leaves
    r.admission.classes.asked(5)
    r.admission.check_load(placed, 100, 0, SLO)
    r.admission.check_load(placed, 100, -1, SLO)
