"""A tenant over its share of a nearly full cluster leaves the last `fair_share_reserve` of the room to tenants
below theirs: shed RESOURCE_EXHAUSTED (reason `fair_share`, with a retry hint) where a tenant below its share, or
the same tenant alone, is admitted."""

from __future__ import annotations

import pytest

from pdserve.errors import OverloadedError
from pdserve.security.api_keys import KeyTable, Tenant, digest
from pdserve.security.quotas import LocalQuotas
from pdserve.telemetry import Telemetry
from pdserve.v1 import generate_pb2 as pb
from services.router.admission import SLOTarget
from services.router.placement import Placement
from services.router.tenant_shares import ACTIVE_S, TenantShares
from tests.unit.hand_clock import HandClock
from tests.unit.router.router_builder import Router, prompt, worker
from tests.unit.router.stand_in_decode import OpenStreams, StandInDecode, serving

pytestmark = pytest.mark.timeout(60)
SLO = SLOTarget(5.0, 1.0)
LONG = pb.GenerateRequest(prompt_token_ids=[5, 6, 7, 8], sampling=pb.SamplingParams(max_tokens=50))


def test_one_tenant_alone_is_never_over_its_share():
    shares = TenantShares()
    for _ in range(50):
        shares.entered("a")
    assert shares.over_share("a") is None


def test_a_tenant_holding_more_than_an_equal_share_of_the_active_tenants_streams_is_over():
    clock = HandClock()
    shares = TenantShares(clock)
    for _ in range(3):
        shares.entered("a")
    shares.asked("b")  # shed at every try, it still asks: active
    over = shares.over_share("a")
    assert over is not None and (over.held, over.total, over.active) == (3, 3, 2)
    assert shares.over_share("b") is None
    for _ in range(3):
        shares.entered("b")
    assert shares.over_share("a") is None and shares.over_share("b") is None  # 3 and 3: neither over
    for _ in range(3):
        shares.left("b")
    clock.now += ACTIVE_S + 1  # b asked nothing since its streams ended: no longer active
    assert shares.over_share("a") is None


def test_shares_follow_the_tenants_weights():
    """Weight 3 beside 1: a tenant's share is three quarters of the streams, not half."""
    shares = TenantShares()
    shares.weights = {"big": 3.0}
    for tenant, n in (("big", 6), ("small", 2)):
        for _ in range(n):
            shares.entered(tenant)
    assert shares.over_share("big") is None and shares.over_share("small") is None  # 6 of 8 is its share
    shares.entered("big")
    assert shares.over_share("big") is not None and shares.over_share("small") is None  # 7 of 9 is past it
    shares.weights = {}
    shares.left("big")
    assert shares.over_share("big") is not None  # 6 of 8 is past an equal share


def place(r: Router, tenant_streams: dict[str, int], tokens: int = 100) -> Placement:
    for tenant, n in tenant_streams.items():
        r.admission.shares.asked(tenant)
        for _ in range(n):
            r.admission.shares.entered(tenant)
    return r.place(prompt(tokens), 16, SLO.tpot_s)


def check(r: Router, placed: Placement, tenant: str) -> None:
    r.admission.check_load(placed, 100, 0, SLO, tenant=tenant)  # the 100-token prompt `place` placed


def fair_share_shed(r: Router, placed: Placement, tenant: str, what: str) -> OverloadedError:
    with pytest.raises(OverloadedError, match=what) as info:
        check(r, placed, tenant)
    assert info.value.reason == "fair_share" and 100 <= info.value.retry_after_ms <= 30_000
    assert f"tenant '{tenant}' holds" in str(info.value)
    return info.value


def test_the_last_batch_places_are_kept_for_a_tenant_below_its_share():
    """10 places, 9 held: a reserve of 0.1 keeps the last one from the tenant holding all of them."""
    decode = worker("d0", "decode", sequences=9, max_num_seqs=10)
    r = Router([worker("p0"), decode], fair_share_reserve=0.1)
    placed = place(r, {"flood": 9, "quiet": 0})
    fair_share_shed(r, placed, "flood", "the last 1 batch places of its decode worker")
    check(r, placed, "quiet")
    # A later choice (the HTTP API's n) of a request admitted at its first: its share was judged then.
    r.admission.check_load(placed, 100, 0, SLO, tenant=None)
    alone = Router([worker("p0"), decode], fair_share_reserve=0.1)
    check(alone, place(alone, {"flood": 9}), "flood")  # nobody else asking: it takes the last place
    off = Router([worker("p0"), decode], fair_share_reserve=0.0)
    check(off, place(off, {"flood": 9, "quiet": 0}), "flood")
    roomy = Router([worker("p0"), worker("d0", "decode", sequences=8, max_num_seqs=10)], fair_share_reserve=0.1)
    check(roomy, place(roomy, {"flood": 8, "quiet": 0}), "flood")  # two free: one is beyond the reserve


def test_the_last_kv_blocks_are_kept_for_a_tenant_below_its_share():
    decode = worker("d0", "decode", kv_blocks_total=1000, kv_blocks_free=100)
    r = Router([worker("p0"), decode], fair_share_reserve=0.1)
    placed = place(r, {"flood": 5, "quiet": 1})
    assert placed.blocks_needed < 100  # it fits in what is free, not beside the 100 kept
    fair_share_shed(r, placed, "flood", "the last 100 KV blocks of its decode worker")
    check(r, placed, "quiet")


def test_the_last_of_the_prefill_queues_room_is_kept_for_a_tenant_below_its_share():
    """A queue filling between 90 % and all of what the TTFT SLO leaves sheds only the tenant over its share."""
    r = Router([worker("p0"), worker("d0", "decode")], fair_share_reserve=0.1, max_queued_prefill_tokens=10**6)
    empty = r.place(prompt(100), 16, SLO.tpot_s)
    room = 0.8 * (SLO.ttft_s - empty.own_ttft_s)  # slo_headroom's share of what the request's own cost leaves
    per_token = r.predictor.queue_s(worker("p0", queued_prefill_tokens=10_000)) / 10_000
    queued = int(0.95 * room / per_token)
    r = Router(
        [worker("p0", queued_prefill_tokens=queued), worker("d0", "decode")],
        fair_share_reserve=0.1,
        max_queued_prefill_tokens=10**6,
    )
    placed = place(r, {"flood": 5, "quiet": 1})
    assert 0.9 * room < placed.queue_s <= room
    fair_share_shed(r, placed, "flood", "the last 10% of its prefill worker's queue room")
    check(r, placed, "quiet")


async def test_through_the_request_path_each_stream_counts_for_its_keys_tenant():
    """Real gRPC to a stand-in decode worker of 4 batch places, keys of two tenants: the flood's third stream
    would fit, but not beside the place kept for the quiet tenant, whose second stream takes it."""
    keys = KeyTable({digest("f"): Tenant("flood", "f"), digest("q"): Tenant("quiet", "q")})
    stand_in = StandInDecode(gap_s=1.0)
    async with serving(stand_in) as address:
        decode = worker("d0", "decode", address=address, max_num_seqs=4)
        telemetry = Telemetry("test-router")
        lifecycle = Router([worker("p0"), decode], fair_share_reserve=0.25).lifecycle(keys, LocalQuotas(), telemetry)
        streams = OpenStreams(lifecycle)

        async def opened(key: str) -> None:
            await streams.open(LONG, {"authorization": f"Bearer {key}"})

        try:
            for key in ("f", "f", "q"):
                await opened(key)
            with pytest.raises(OverloadedError, match="tenant 'flood' holds 2 of the 3 streams") as shed:
                await opened("f")
            assert shed.value.reason == "fair_share"
            await opened("q")  # the kept place
            assert dict(lifecycle.admission.shares.in_flight) == {"flood": 2, "quiet": 2} == in_flight(telemetry)
            # Each worker call names its tenant, which the workers' waiting queues take in turn (fair_queue.py).
            assert [r.tenant for r in stand_in.requests] == ["flood", "flood", "quiet", "quiet"]
        finally:
            await streams.close()
        assert not lifecycle.admission.shares.in_flight
        assert in_flight(telemetry) == {"flood": 0, "quiet": 0}  # each known tenant's series stays, at 0


def in_flight(telemetry: Telemetry) -> dict[str, float]:
    """The router's `pdserve_requests_in_flight` gauge by tenant, as a scrape reads it."""
    samples = (s for f in telemetry.registry.collect() for s in f.samples if s.name == "pdserve_requests_in_flight")
    return {s.labels["tenant"]: s.value for s in samples}
