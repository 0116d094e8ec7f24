"""The admission arithmetic the router sheds by and the planner simulates."""

from __future__ import annotations

import pytest

from pdserve.protocol.admission_rules import queue_full, queue_room_s, ttft_budget_s


def test_an_empty_queue_takes_any_prompt_and_a_busy_one_only_within_its_bound() -> None:
    assert not queue_full(0, 10_000, bound=1000)
    assert not queue_full(400, 600, bound=1000)
    assert queue_full(400, 601, bound=1000)


def test_a_default_slo_always_leaves_some_queueing_beyond_the_requests_own_cost_an_explicit_one_is_kept() -> None:
    """A prompt whose own cost reached the default was left no queueing: shed behind any work for as long as the
    cluster stayed busy (one decoding stream's step was enough), its retry hint never coming true."""
    assert ttft_budget_s(0.5, own_s=2.0, explicit=False, first_token_s=60.0) == pytest.approx(2.05)
    assert ttft_budget_s(0.5, own_s=2.0, explicit=True, first_token_s=60.0) == 0.5
    assert ttft_budget_s(3.0, own_s=2.0, explicit=False, first_token_s=60.0) == 3.0
    assert ttft_budget_s(3.0, own_s=2.9, explicit=False, first_token_s=60.0) == pytest.approx(3.2)
    assert queue_room_s(ttft_budget_s(3.0, own_s=3.0, explicit=False, first_token_s=60.0), 3.0, 0.8) > 0.2


def test_no_slo_holds_a_request_past_the_first_token_bound() -> None:
    assert ttft_budget_s(120.0, own_s=2.0, explicit=True, first_token_s=60.0) == 60.0
    assert ttft_budget_s(0.5, own_s=90.0, explicit=False, first_token_s=60.0) == 60.0


def test_the_headroom_applies_to_the_queueing_part_only() -> None:
    assert queue_room_s(1.0, own_s=0.2, headroom=0.8) == pytest.approx(0.64)
    assert queue_room_s(2.0, own_s=2.0, headroom=0.8) == 0.0
