"""Why a request counted `rejected` in pdserve_requests_total was refused, in pdserve_requests_rejected_total{reason}:
admission's sheds each name theirs, a worker's refusal relayed is `worker`, an API key's quotas `quota`, a draining
router's refusal `draining`; pdserve_requests_total counts them all as `rejected`, as before."""

from __future__ import annotations

import pytest

from pdserve.errors import OverloadedError, RouterDrainingError
from pdserve.metrics import REJECTION_REASONS
from pdserve.security.api_keys import KeyTable, Tenant, digest
from pdserve.telemetry import Telemetry
from pdserve.v1 import generate_pb2 as pb
from services.router.caller_errors import for_the_caller
from services.router.generation import generate
from services.router.outcome import rejection_reason
from services.router.ticket import Ticket
from tests.unit.router.request_counts import requests_by_outcome
from tests.unit.router.router_builder import Router, prompt, shed, worker

SHEDS = {  # reason: (prefill worker's fields, decode worker's, router's config, the shed's words, TTFT and TPOT SLOs)
    "ttft": ({"queued_prefill_tokens": 8000}, {}, {"max_queued_prefill_tokens": 10**6}, "TTFT", (1.0, 1.0)),
    "queue": ({"queued_prefill_tokens": 9990}, {}, {"max_queued_prefill_tokens": 10_000}, "queue full", (1e3, 1.0)),
    "kv": ({}, {"kv_blocks_free": 3}, {}, "free KV blocks", (5.0, 1.0)),
    "batch": ({}, {"sequences": 2, "max_num_seqs": 2}, {}, "room in its batch", (5.0, 1.0)),
    "tpot": ({}, {"running": 100}, {}, "TPOT", (5.0, 0.1)),
}


@pytest.mark.parametrize("reason", SHEDS)
def test_each_admission_shed_names_its_reason(reason: str) -> None:
    prefill, decode, config, match, slo_s = SHEDS[reason]
    r = Router([worker("p0", **prefill), worker("d0", "decode", **decode)], **config)
    assert shed(r, prompt(100), match, slo_s=slo_s).reason == reason


def test_the_in_flight_cap_a_workers_refusal_and_a_drain_have_reasons_of_their_own():
    r = Router([worker("p0"), worker("d0", "decode")], max_in_flight=4)
    r.admission.in_flight = 4
    assert shed(r, prompt(10), "in flight").reason == "in_flight"
    relayed = OverloadedError("decode worker d0 at 10.0.0.1:50061: its batch is full")  # RESOURCE_EXHAUSTED
    assert rejection_reason(relayed) == "worker"
    assert rejection_reason(RouterDrainingError("draining")) == "draining"
    kv = OverloadedError("no decode worker has 8 free KV blocks now", 500, reason="kv")
    assert for_the_caller(kv, r.place(prompt(10), 8, 1.0)).reason == "kv"  # its text rewritten, its reason kept


async def test_rejections_are_counted_by_reason_and_tenant_from_zero_and_still_as_rejected() -> None:
    telemetry = Telemetry("test-router")
    keys = KeyTable({digest("k"): Tenant("team", "k", requests_per_second=0.01)})
    lifecycle = Router([worker("p0"), worker("d0", "decode")]).lifecycle(keys, telemetry=telemetry)

    async def admitted(ticket: Ticket) -> None:
        pass

    async def ask() -> None:
        request = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=2))
        with pytest.raises((OverloadedError, RouterDrainingError)):
            async for _ in generate(lifecycle, request, {"authorization": "Bearer k"}, lambda: None, admitted):
                pass

    lifecycle.draining = True
    await ask()  # refused before its key's rate is charged
    lifecycle.draining = False
    lifecycle.admission.in_flight = lifecycle.config.max_in_flight
    await ask()  # the key's one request of its second: shed at the router's cap
    await ask()  # over the key's requests_per_second
    rejected = {
        s.labels["reason"]: s.value
        for f in telemetry.registry.collect()
        for s in f.samples
        if s.name == "pdserve_requests_rejected_total" and s.labels["tenant"] == "team"
    }
    assert rejected == {**dict.fromkeys(REJECTION_REASONS, 0), "draining": 1, "in_flight": 1, "quota": 1}
    assert requests_by_outcome(telemetry) == {("rejected", "team"): 3}
    telemetry.shutdown()
