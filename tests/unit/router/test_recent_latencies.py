"""`pdserve status`'s p50 and p99 over a worker's recent samples: nearest-rank quantiles."""

from __future__ import annotations

from services.router.recent_latencies import RecentLatencies


def test_p50_and_p99_are_the_nearest_rank_samples():
    recent = RecentLatencies()
    for ms in range(1, 101):
        recent.add("d0", "ttft", ms / 1e3)
    assert recent.quantiles("d0", "ttft") == (0.050, 0.099)  # not 51 and the maximum
    recent.add("p0", "ttft", 0.007)
    assert recent.quantiles("p0", "ttft") == (0.007, 0.007)
    assert recent.quantiles("p0", "tpot") is None  # no samples: not 0, the best latency of all


def test_only_the_last_samples_count():
    recent = RecentLatencies(size=2)
    for s in (9.0, 1.0, 2.0):
        recent.add("d0", "tpot", s)
    assert recent.quantiles("d0", "tpot") == (1.0, 2.0)
