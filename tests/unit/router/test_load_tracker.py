"""What the tracker counts since a heartbeat is the same whether read back from the newest entry or summed whole."""

from __future__ import annotations

import random
from unittest import mock

import pytest

from pdserve.protocol.perf_profile import QueuedPrefill
from services.router.load_tracker import LoadTracker


def test_counts_since_a_time_match_the_whole_history() -> None:
    rng = random.Random(7)
    now = [1000.0]
    with mock.patch("services.router.load_tracker.time.monotonic", lambda: now[0]):
        tracker = LoadTracker()
        prefilled: list[tuple[float, float, int]] = []  # (when its prefill ended, when placed, prompt tokens)
        ended: list[tuple[float, float]] = []  # (when it ended, when it was placed)
        live: list[tuple[int, float]] = []
        for _ in range(400):
            now[0] += rng.random() * 0.01
            tokens = rng.randint(1, 900)
            live.append((tracker.start("p0", "d0", tokens, 0.01, 2, tokens), now[0]))
            if live and rng.random() < 0.9:  # requests end out of order
                placement, placed = live.pop(rng.randrange(len(live)))
                tracker.prefilled(placement)
                prefilled.append((now[0], placed, tracker._sent[placement].prompt_tokens))
                tracker.finished(placement)
                ended.append((now[0], placed))
        for since in [now[0] - x for x in (0.0, 0.01, 0.1, 0.5, 1.0, 3.0, 100.0)]:
            ours = [t for at, placed, t in prefilled if placed <= since < at]  # in a report sampled at `since`
            assert tracker.prefilled_since("p0", since) == QueuedPrefill(len(ours), sum(ours), sum(t * t for t in ours))
            assert tracker.streams_ended_since("d0", since, "", 0) == sum(1 for e, p in ended if p <= since < e)


def test_prefills_ending_in_another_order_than_they_started_leave_no_queue_behind() -> None:
    """0.1 + 0.2 + 0.7 taken off as 0.1, 0.7, 0.2 left ~5.6e-17 s queued on an idle worker: a prompt whose own
    cost set its budget (no room for queueing) was shed for it, again and again, on an idle cluster (a review)."""
    t = LoadTracker()
    placed = [t.start("p0", "d0", 100, seconds, 10, 100) for seconds in (0.1, 0.2, 0.7)]
    for p in (placed[0], placed[2]):
        t.prefilled(p)
    assert t.pending_prefill_s["p0"] == pytest.approx(0.2)  # what is still ours there stays counted
    t.prefilled(placed[1])
    assert t.pending_prefill_s["p0"] == 0.0
