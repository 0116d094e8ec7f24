"""What the offer is judged at: the profile's speed until a worker's corrections were watched for WINDOW_S, then the
best speed they showed over the last WINDOW_S; a gone worker's is forgotten."""

from __future__ import annotations

from services.router import best_speed
from services.router.best_speed import WINDOW_S, BestSpeeds


def test_the_profile_stands_until_the_corrections_were_watched_then_the_best_they_showed(monkeypatch):
    now = [50.0]
    monkeypatch.setattr(best_speed.time, "monotonic", lambda: now[0])
    speeds = BestSpeeds()
    assert speeds.best("p0", "ttft", 1.0) == 1.0  # uncorrected: nothing learnt
    assert speeds.best("p0", "ttft", 0.5) == 0.5  # faster than the profile counts at once
    assert speeds.best("p1", "ttft", 2.5) == 1.0 and speeds.best("p1", "ttft", 2.2) == 1.0
    now[0] += WINDOW_S
    assert speeds.best("p1", "ttft", 3.0) == 2.2  # the best it showed, not the slowdown of the moment
    assert speeds.best("p1", "tpot", 3.0) == 1.0  # each measure learns on its own
    now[0] += 1
    assert speeds.best("p1", "ttft", 3.0) == 3.0  # 2.2 was seen a window ago: corrections converging, not its best
    assert speeds.worker_ids() == {"p0", "p1"}
    assert speeds.forget("p1") and speeds.worker_ids() == {"p0"}


def test_the_watch_starts_at_the_first_correction_not_at_the_first_look(monkeypatch):
    """A worker looked at (every request prices every worker) before anything corrected its factor has taught
    nothing: a slow first correction a window later is not yet its best."""
    now = [50.0]
    monkeypatch.setattr(best_speed.time, "monotonic", lambda: now[0])
    speeds = BestSpeeds()
    assert speeds.best("p0", "ttft", 1.0) == 1.0
    now[0] += WINDOW_S + 1
    assert speeds.best("p0", "ttft", 2.5) == 1.0
