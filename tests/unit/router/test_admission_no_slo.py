"""Admission of a request that sets no SLO: the default never sheds it for its own size, and leaves it some
queueing however large it is."""

from __future__ import annotations

import pytest

from services.router.admission import MIN_RETRY_MS
from tests.unit.router.router_builder import Router, prompt, shed, worker


def test_no_slo_request_larger_than_the_default_is_served_on_an_idle_cluster():
    r = Router([worker("p0"), worker("d0", "decode")])
    placed = r.admit(prompt(2000), slo_s=(1.0, 1.0), explicit=False)  # own cost 2.01 s > the 1 s default
    assert placed.own_ttft_s > 1.0


def test_no_slo_request_larger_than_the_default_is_shed_behind_a_queue_with_a_retry_hint():
    r = Router([worker("p0", queued_prefill_tokens=500), worker("d0", "decode")])
    err = shed(r, prompt(2000), "TTFT", slo_s=(1.0, 1.0), explicit=False)
    # The queue must drain to what it may always queue, a tenth of the default (80 ms with the headroom): 420 ms.
    assert err.retry_after_ms == pytest.approx(420, abs=2)


def test_no_slo_request_larger_than_the_default_is_not_shed_behind_a_decoding_stream():
    """Its budget was its own cost alone, no queueing: one stream decoding on the decode worker (half a step's
    wait for the hand-off) shed it, again and again for as long as any stream ran (a fault review)."""
    r = Router([worker("p0"), worker("d0", "decode", running=1)])
    placed = r.admit(prompt(2000), slo_s=(1.0, 1.0), explicit=False)
    assert placed.queue_s > 0 and placed.own_ttft_s > 1.0


def test_no_slo_request_within_the_default_keeps_the_default_and_margin():
    # Own 110 ms, default 1 s: the queue may fill 0.8 * 890 = 712 ms.
    r = Router([worker("p0", queued_prefill_tokens=700), worker("d0", "decode")])
    r.admit(prompt(100), slo_s=(1.0, 1.0), explicit=False)
    r2 = Router([worker("p0", queued_prefill_tokens=750), worker("d0", "decode")])
    assert shed(r2, prompt(100), "TTFT", slo_s=(1.0, 1.0), explicit=False).retry_after_ms == MIN_RETRY_MS
