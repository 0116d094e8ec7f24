"""The admission ticket: the load bookkeeping of one admitted request, released exactly once."""

from __future__ import annotations

import pytest

from pdserve.protocol.sampling import SamplingParams
from services.router.request import RoutedRequest
from services.router.ticket import Ticket
from tests.unit.router.router_builder import Router, prompt, worker


def ticket(r: Router) -> Ticket:
    placed = r.admit(prompt(100))
    req = RoutedRequest("client", prompt(100), SamplingParams(max_tokens=16), 0.0, 0.0, 0)
    return Ticket("key", "client", req, placed, 0.0, r.tracker, r.admission)


def test_a_ticket_holds_the_load_until_released_once_however_often_it_is_released():
    r = Router([worker("p0"), worker("d0", "decode")])
    with ticket(r) as t:
        assert r.admission.in_flight == 1
        assert r.tracker.pending_prefill_tokens["p0"] == 100 and r.tracker.decoding["d0"] == 1
        assert r.predictor.queue_s(worker("p0")) == pytest.approx(t.placement.own_ttft_s)  # 110 ms
        t.prefilled()
        t.prefilled()
        assert r.tracker.pending_prefill_tokens["p0"] == 0 and r.tracker.pending_blocks["d0"] == 0
        assert r.tracker.decoding["d0"] == 1  # still streaming
        t.release()
    t.release()
    assert r.admission.in_flight == 0 and r.tracker.decoding["d0"] == 0
    assert r.tracker.pending_prefill_tokens["p0"] == 0 and r.tracker.pending_blocks["d0"] == 0


def test_a_ticket_released_by_an_error_before_its_first_token_returns_the_prefill_queue():
    r = Router([worker("p0"), worker("d0", "decode")])
    with pytest.raises(RuntimeError), ticket(r):
        raise RuntimeError("the decode worker went away")
    assert r.admission.in_flight == 0
    assert r.tracker.pending_prefill_tokens["p0"] == 0 and r.tracker.pending_prefill_s["p0"] == 0
    assert r.tracker.pending_blocks["d0"] == 0 and r.tracker.decoding["d0"] == 0


def test_a_ticket_ran_alone_only_when_nothing_of_ours_queued_before_or_behind_it():
    r = Router([worker("p0"), worker("d0", "decode")])
    with ticket(r) as first:
        assert first.ran_alone()
        with ticket(r) as second:
            assert not second.ran_alone()  # found the first one queued
            assert not first.ran_alone()  # the second was placed behind it before its first token
    with ticket(r) as third:
        third.prefilled()
        assert not third.ran_alone()  # asked once, at the first token, before `prefilled`
