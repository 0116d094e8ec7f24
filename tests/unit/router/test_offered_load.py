"""The router counts what its admission shed for the cluster's load beside what it admitted (the load clients
offered, which `pdserve autoscale` plans for); a key's own quota refusing a request is no demand on the cluster."""

from __future__ import annotations

import pytest

from pdserve.errors import OverloadedError
from pdserve.protocol.admitted import AdmittedTotals
from pdserve.security.api_keys import KeyTable, Tenant, digest
from pdserve.security.quotas import LocalQuotas
from pdserve.v1 import generate_pb2 as pb
from services.router.generation import generate
from services.router.ticket import Ticket
from tests.unit.router.router_builder import Router, worker

KEY = {"authorization": "Bearer k1"}


async def refused(lifecycle, prompt_tokens: int, max_tokens: int, match: str) -> None:  # type: ignore[no-untyped-def]
    async def admitted(ticket: Ticket) -> None:
        raise AssertionError("admitted")

    req = pb.GenerateRequest(prompt_token_ids=[5] * prompt_tokens, sampling=pb.SamplingParams(max_tokens=max_tokens))
    with pytest.raises(OverloadedError, match=match):
        async for _ in generate(lifecycle, req, KEY, lambda: 10.0, admitted):
            pass


async def test_a_request_shed_for_the_clusters_load_is_counted_and_one_over_its_keys_quota_is_not() -> None:
    busy = Router([worker("p0", queued_prefill_tokens=30_000), worker("d0", "decode")])
    tenant = Tenant("team", "k", requests_per_second=2)  # a burst of two requests
    lifecycle = busy.lifecycle(KeyTable({digest("k1"): tenant}), quotas=LocalQuotas())
    await refused(lifecycle, 100, 8, "prefill queue full|TTFT")
    await refused(lifecycle, 40, 8, "prefill queue full|TTFT")
    await refused(lifecycle, 40, 8, "requests_per_second")  # the key's limit, not the cluster's
    assert lifecycle.admitted == AdmittedTotals(shed=2, shed_prompt_tokens=140)
