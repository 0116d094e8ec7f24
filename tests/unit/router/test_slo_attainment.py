"""Each finished request counts in `pdserve_requests_slo_total` by whether its TTFT and TPOT met the SLO it was held
to: its own where it set one, else its priority class's, else the default; each label exported from 0, so that
attainment (the share with both met) reads per class."""

from __future__ import annotations

import pytest

from pdserve.config import RouterConfig, SLOClass
from pdserve.protocol.sampling import SamplingParams
from pdserve.telemetry import Telemetry
from pdserve.v1 import generate_pb2 as pb
from services.router.generation import generate
from services.router.request import RoutedRequest
from services.router.slo_attainment import judged_slo, slo_labels
from services.router.ticket import Ticket
from tests.unit.router.router_builder import Router, worker
from tests.unit.router.stand_in_decode import StandInDecode, serving

pytestmark = pytest.mark.timeout(60)
CLASSES = (SLOClass(5, ttft_ms=60_000, tpot_ms=0.5), SLOClass(1, ttft_ms=2000, tpot_ms=200))


def request(priority: int = 0, ttft_ms: float = 0, tpot_ms: float = 0) -> RoutedRequest:
    return RoutedRequest("r", [5, 6], SamplingParams(), ttft_ms, tpot_ms, priority)


def test_a_request_is_held_to_its_own_slo_else_its_class_else_the_default():
    config = RouterConfig(slo_classes=CLASSES, default_ttft_ms=5000, default_tpot_ms=500)
    assert list(slo_labels(config)) == ["own", "default", "priority>=5", "priority>=1"]
    assert judged_slo(config, request(0)) == ("default", 5.0, 0.5)
    assert judged_slo(config, request(3)) == ("priority>=1", 2.0, 0.2)
    assert judged_slo(config, request(9)) == ("priority>=5", 60.0, 0.0005)
    assert judged_slo(config, request(9, ttft_ms=100)) == ("own", 0.1, 0.0005)  # its TPOT still its class's
    assert judged_slo(config, request(-1, tpot_ms=50)) == ("own", 5.0, 0.05)


def slo_counts(telemetry: Telemetry) -> dict[tuple[str, str, str], float]:
    """(slo, ttft, tpot) -> finished requests counted, for the open cluster's tenant, as a scrape reads them."""
    return {
        (s.labels["slo"], s.labels["ttft"], s.labels["tpot"]): s.value
        for f in telemetry.registry.collect()
        for s in f.samples
        if s.name == "pdserve_requests_slo_total"
    }


async def test_finished_requests_count_by_what_they_met():
    """A stand-in decode worker sends a token every 20 ms: past priority 5's TPOT SLO of 0.5 ms, within the
    default's 500 ms and a request's own 300 ms."""
    async with serving(StandInDecode(gap_s=0.02)) as address:
        decode = worker("d0", "decode", address=address)
        telemetry = Telemetry("test-router")
        lifecycle = Router([worker("p0"), decode], slo_classes=CLASSES).lifecycle(telemetry=telemetry)
        counts = slo_counts(telemetry)
        assert len(counts) == 4 * 4 and not any(counts.values())  # every label from 0
        for priority, slo in ((0, None), (0, None), (7, None), (7, pb.SLO(ttft_ms=60_000, tpot_ms=300))):
            msg = pb.GenerateRequest(
                prompt_token_ids=[5, 6, 7], sampling=pb.SamplingParams(max_tokens=3), priority=priority, slo=slo
            )
            messages = [m async for m in generate(lifecycle, msg, {}, lambda: 60.0, none)]
            assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
        counted = {key: n for key, n in slo_counts(telemetry).items() if n}
        assert counted == {("default", "met", "met"): 2, ("priority>=5", "met", "missed"): 1, ("own", "met", "met"): 1}


async def none(ticket: Ticket) -> None:
    pass
