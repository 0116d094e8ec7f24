"""Whether the client sent the rate asked: the achieved send rate, its send lag and the warning when it fell
behind, on hand-made records (scheduled and actual send times set, not measured)."""

from __future__ import annotations

import math

import pytest

from loadgen.pacing import pacing
from loadgen.record import RequestRecord

RATE = 10.0


def sent(scheduled_s: list[float], late_s: list[float], wait_s: float = 0.0) -> list[RequestRecord]:
    return [
        RequestRecord(f"r{i}", 4, 4, s, start_s=s + late + wait_s, wait_s=wait_s)
        for i, (s, late) in enumerate(zip(scheduled_s, late_s, strict=True))
    ]


ON_TIME = [0.1 * (i + 1) for i in range(10)]  # drawn as vLLM draws them: the last due at n / rate = 1 s


def test_a_client_on_schedule_sends_the_rate_asked_and_warns_of_nothing():
    figures = pacing(sent(ON_TIME, [0.0] * 10), RATE, trace=False)
    assert figures["achieved_request_rate"] == pytest.approx(RATE)
    assert figures["max_send_lag_ms"] == pytest.approx(0.0)
    assert figures["warnings"] == []


def test_a_client_that_fell_behind_reports_the_rate_it_sent_and_warns():
    late = [0.05 * i for i in range(10)]  # the last went 0.45 s late: 10 requests in 1.45 s
    figures = pacing(sent(ON_TIME, late), RATE, trace=False)
    assert figures["achieved_request_rate"] == pytest.approx(10 / 1.45)
    assert figures["max_send_lag_ms"] == pytest.approx(450.0)
    assert figures["p50_send_lag_ms"] == pytest.approx(225.0)
    (warning,) = figures["warnings"]
    assert "sent 6.9 req/s of the 10 asked" in warning
    assert "(achieved rate under 95% of the asked and p99 send lag over 25 ms)" in warning
    assert warning.endswith("the server was offered less than request_rate says")


def test_a_late_tail_warns_even_when_the_rate_over_the_run_holds():
    late = [0.0] * 9 + [0.03]  # the rate is 9.7 req/s, within 5%, but the p99 lag is past 25 ms
    (warning,) = pacing(sent(ON_TIME, late), RATE, trace=False)["warnings"]
    assert "loadgen fell behind (p99 send lag over 25 ms): it sent 9.7 req/s" in warning
    assert warning.endswith("the rate held over the run, but the arrivals sent were not the ones drawn")


def test_the_concurrency_bounds_wait_is_not_send_lag_but_lowers_the_rate_sent():
    figures = pacing(sent(ON_TIME, [0.0] * 10, wait_s=0.5), RATE, trace=False)
    assert figures["max_send_lag_ms"] == pytest.approx(0.0)
    assert figures["max_concurrency_wait_ms"] == pytest.approx(500.0)
    assert figures["achieved_request_rate"] == pytest.approx(10 / 1.5)
    (warning,) = figures["warnings"]
    assert "loadgen fell behind (achieved rate under 95% of the asked): it sent 6.7 req/s" in warning


def test_a_trace_is_counted_as_its_offered_rate_is_from_its_first_send():
    """Its gaps per second: three lines 0.5 s apart, all sent 0.2 s late, were still sent at 2 req/s."""
    figures = pacing(sent([0.0, 0.5, 1.0], [0.2] * 3), 2.0, trace=True)
    assert figures["achieved_request_rate"] == pytest.approx(2.0)


def test_all_at_once_has_no_rate_to_fall_behind():
    figures = pacing(sent([0.0] * 4, [0.0, 0.1, 0.2, 0.3]), math.inf, trace=False)
    assert figures["warnings"] == []
    assert pacing([], RATE, trace=False) == {"achieved_request_rate": None, "warnings": []}


def test_a_run_cut_short_is_judged_against_the_part_of_its_schedule_it_reached():
    """Ctrl-C after 4 of 10 sends: a Poisson prefix strays from the whole run's rate by chance alone (here it was
    due at 4 / 0.8 s = 5 req/s, not 10), so sent on time it is no client that fell behind."""
    prefix = [0.2, 0.4, 0.6, 0.8]
    figures = pacing(sent(prefix, [0.0] * 4), RATE, trace=False, interrupted=True)
    assert figures["achieved_request_rate"] == pytest.approx(5.0)
    assert figures["warnings"] == []
    late = [0.0, 0.0, 0.0, 0.4]  # its last send 0.4 s late: 4 in 1.2 s where 4 in 0.8 s were due
    (warning,) = pacing(sent(prefix, late), RATE, trace=False, interrupted=True)["warnings"]
    assert "it sent 3.3 req/s of the 5.0 its schedule asked before the cut" in warning
