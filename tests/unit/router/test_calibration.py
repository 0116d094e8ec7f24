"""The router's TTFT calibration per prefill worker: predictions move toward measured TTFTs, bounded, and requests
predicted with one factor that are observed later do not compound."""

from __future__ import annotations

import pytest

from pdserve.config import RouterConfig
from services.router.calibration import TTFTCalibration
from services.router.load_tracker import LoadTracker
from services.router.predictor import Predictor
from tests.unit.router.router_builder import worker


def test_calibration_moves_predictions_toward_measured_ttfts_per_worker():
    cal = TTFTCalibration(alpha=0.5)
    pred = Predictor(RouterConfig(), LoadTracker(), cal)
    w = worker("p0")
    before = pred.ttft_s(w, 500, 0)
    for _ in range(30):  # the worker is really half as fast as profiled
        cal.observe("p0", pred.ttft_s(w, 500, 0), 2 * before, cal.factor("p0"))
    assert pred.ttft_s(w, 500, 0) == pytest.approx(2 * before, rel=1e-3)
    assert pred.ttft_s(worker("p1"), 500, 0) == pytest.approx(before)  # only the worker it measured
    for _ in range(100):
        cal.observe("p0", 1.0, 100.0, 1.0)
    assert cal.factor("p0") == pytest.approx(4.0)  # bounded
    cal.observe("p0", 0.0, 1.0, 1.0)  # nothing to learn from
    assert cal.factor("p0") == pytest.approx(4.0)


def test_requests_predicted_with_one_factor_that_end_later_do_not_push_it_past_the_truth():
    """Observed when their streams end, requests placed before any of them ended were all predicted with the
    same factor: each moves it toward the factor that would have predicted it, not by a step on top of the last
    (which took a worker 2x slower than profiled to the cap of 4)."""
    cal = TTFTCalibration(alpha=0.3)
    for _ in range(20):
        cal.observe("p0", 1.0, 2.0, 1.0)
    assert cal.factor("p0") == pytest.approx(2.0, rel=1e-3)
