"""The admission benchmark's figures from synthetic outcomes: error, SLO share, rejection times, idle rejections."""

from __future__ import annotations

import pytest

from pdserve.bench.admission_bench import AdmissionBench, Outcome, summarize


def test_summary_of_a_burst():
    bench = AdmissionBench(burst=5, ttft_slo_ms=1000.0)
    sequential = [(64, Outcome("OK", 0.0, 0.5, predicted_ms=550.0)), (128, Outcome("OK", 1.0, 2.0, 800.0))]
    burst = [
        Outcome("OK", 0.0, 0.9, predicted_ms=900.0),  # met, exact
        Outcome("OK", 0.0, 1.2, predicted_ms=600.0),  # missed, 50% under
        Outcome("RESOURCE_EXHAUSTED", 0.0, 0.05),  # while both admitted awaited their first token
        Outcome("RESOURCE_EXHAUSTED", 0.0, 0.15),
        Outcome("INVALID_ARGUMENT", 1.3, 1.4),  # after every admitted request had its first token: idle
    ]
    f = summarize(bench, sequential, burst)
    assert f["sequential_median_abs_error_pct"] == pytest.approx(15.0)  # 10% and 20%
    assert f["burst_median_abs_error_pct"] == pytest.approx(25.0)  # 0% and 50%
    assert f["admitted"] == 2 and f["admitted_meeting_slo"] == 1
    assert f["rejected"] == {"INVALID_ARGUMENT": 1, "RESOURCE_EXHAUSTED": 2}
    assert f["rejection_p50_ms"] == pytest.approx(100.0)
    assert 100.0 < f["rejection_p99_ms"] <= 150.0
    assert f["rejected_while_idle"] == 1
    assert f["admitted_ttft_ms"] == [900, 1200]


def test_summary_with_nothing_admitted_counts_every_rejection_as_idle():
    f = summarize(AdmissionBench(burst=2), [], [Outcome("RESOURCE_EXHAUSTED", 0.0, 0.01)] * 2)
    assert f["admitted"] == 0 and f["rejected_while_idle"] == 2
    assert f["sequential_median_abs_error_pct"] is None and f["burst_median_abs_error_pct"] is None
