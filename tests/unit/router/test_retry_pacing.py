"""Retry hints that spread a crowd of shed requests over the rate the router admits (services/router/retry_pacing.py),
alone and through admission: a crowd shed together is told to come back apart, later the larger it is; a request shed
alone, or after the crowd's slots have passed, gets admission's own hint; one whose deadline ends first takes no slot;
a KV claim calls back one request of its size at its own hint."""

from __future__ import annotations

import random
import time
from dataclasses import replace

import pytest

from pdserve.errors import OverloadedError
from services.router.admission import MAX_RETRY_MS, SLOTarget
from services.router.retry_pacing import MAX_SLOT_S, WINDOW_S, RetryPacing
from tests.unit.hand_clock import HandClock
from tests.unit.router.router_builder import Router, prompt, replace_free, shed, worker


def pacing(admissions: int, clock: HandClock) -> RetryPacing:
    """A router that admitted `admissions` requests over the last WINDOW_S."""
    p = RetryPacing(clock, random.Random(0))
    for _ in range(admissions):
        p.admitted()
    return p


def test_a_request_shed_alone_gets_admissions_own_hint():
    assert pacing(100, HandClock()).hint_ms(500, MAX_RETRY_MS) == 500


def test_a_crowd_shed_at_once_is_told_to_come_back_one_slot_apart_at_the_rate_admitted():
    """100 admissions in the last 10 s: slots of 0.1 s. The k-th request shed gets a point within the k-th slot past
    admission's own 500 ms, so the crowd comes back at about the rate places free, not as one wave."""
    clock = HandClock()
    p = pacing(100, clock)
    assert p.slot_s() == pytest.approx(WINDOW_S / 100)
    hints = [p.hint_ms(500, MAX_RETRY_MS) for _ in range(50)]
    assert hints[0] == 500
    for k, hint in enumerate(hints[1:], start=1):
        assert 500 + 100 * k <= hint <= 500 + 100 * (k + 1) + 1, (k, hint)
    assert len(set(hints)) == len(hints)


def test_the_hint_grows_with_the_crowd_and_stops_at_the_longest_without_taking_a_slot():
    clock = HandClock()
    p = pacing(10, clock)  # 1 s slots
    hints = [p.hint_ms(100, 5_000) for _ in range(8)]
    assert hints[:5] == sorted(hints[:5]) and hints[4] >= 4_100
    assert hints[5:] == [5_000, 5_000, 5_000]  # past the longest: told the longest
    clock.now += 5.0  # the slots given meanwhile have passed: none was taken past the longest
    assert p.hint_ms(100, 5_000) == 100


def test_a_caller_whose_deadline_ends_before_its_slot_is_told_so_and_leaves_the_slot_to_the_next():
    """The schedule holds the retries that can still come back: a slot past the caller's deadline is not taken."""
    clock = HandClock()
    p = pacing(10, clock)  # 1 s slots
    assert p.hint_ms(100, MAX_RETRY_MS) == 100
    assert p.hint_ms(100, MAX_RETRY_MS, left_s=0.5) == 1_100  # its slot starts 1.1 s on: past its 0.5 s
    assert 1_100 <= p.hint_ms(100, MAX_RETRY_MS, left_s=60.0) <= 2_100  # the next one shed gets that slot


def test_a_router_that_admits_little_spaces_retries_at_most_the_widest_slot_apart():
    clock = HandClock()
    p = pacing(0, clock)
    assert p.slot_s() == MAX_SLOT_S
    p = pacing(30, clock)
    clock.now += WINDOW_S  # its admissions are past the window
    assert p.slot_s() == MAX_SLOT_S


def test_admission_paces_a_crowd_shed_for_a_full_batch_at_the_rate_it_admitted(clock):
    """Through admission: 20 requests admitted (slots of 10 s / 20), then the decode batch is full, and the requests
    shed for it are told hints one slot apart, later in turn."""
    d0 = worker("d0", "decode", max_num_seqs=20)
    r = Router([worker("p0"), d0])
    for seed in range(20):
        r.admit(prompt(16, seed), slo_s=(60.0, 1.0))
    r.registry.publish(replace(d0, sequences=20, updated_at=time.time()))  # their streams fill its batch
    hints = [shed(r, prompt(16), "room in its batch", slo_s=(60.0, 1.0)).retry_after_ms for _ in range(5)]
    own = hints[0]
    for k, hint in enumerate(hints[1:], start=1):
        assert own + 500 * k <= hint <= own + 500 * (k + 1) + 1, (k, hints)


def test_admission_gives_no_slot_to_a_caller_whose_deadline_ends_before_it(clock):
    r = Router([worker("p0"), worker("d0", "decode", sequences=2, max_num_seqs=2)])
    own = shed(r, prompt(100), "room in its batch", slo_s=(5.0, 1.0)).retry_after_ms
    placed, slo = r.place(prompt(100), 16, 1.0), SLOTarget(5.0, 1.0)
    with pytest.raises(OverloadedError) as info:
        r.admission.check_load(placed, 100, 0, slo, left_s=0.5)
    assert info.value.retry_after_ms == pytest.approx(own + 1000, abs=5)  # nothing admitted lately: 1 s slots
    assert shed(r, prompt(100), "room in its batch", slo_s=(5.0, 1.0)).retry_after_ms <= own + 2005  # that slot


def test_a_kv_claim_calls_back_one_request_of_its_size_at_its_own_hint_and_paces_the_others(clock):
    """A claim keeps blocks for one request of its size: that one is told admission's own hint, to come for them;
    the others of its size, refused at the same time, are paced behind it (they would be refused again)."""
    d0 = worker("d0", "decode", kv_blocks_free=40)
    r = Router([worker("p0"), d0])
    large = prompt(800)  # 51 blocks
    for _ in range(7):  # refused past its 5 s TTFT SLO: it claims the blocks
        hint = shed(r, large, "51 free KV blocks now$", slo_s=(5.0, 1.0)).retry_after_ms
        clock[0] += 0.9  # past the hint the claim called it back at
    called = shed(r, large, "51 free KV blocks now$", slo_s=(5.0, 1.0)).retry_after_ms
    others = [shed(r, large, "51 free KV blocks now$", slo_s=(5.0, 1.0)).retry_after_ms for _ in range(3)]
    assert called == hint  # its own hint, as at the refusal that claimed the blocks
    assert others == sorted(others) and others[0] > called + 900, (called, others)  # nothing admitted: 1 s slots
    r.registry.publish(replace_free(d0, 60))
    assert r.admit(large, slo_s=(5.0, 1.0)).decode.worker_id == "d0"
