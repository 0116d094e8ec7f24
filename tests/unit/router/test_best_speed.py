"""What the offer is judged at: the profile's speed until a worker's corrections were watched for WINDOW_S, then the
best speed they showed over the last WINDOW_S; a gone worker's is forgotten."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from pdserve.errors import InvalidRequestError
from services.router import best_speed
from services.router.best_speed import WINDOW_S, BestSpeeds
from tests.unit.router.router_builder import Router, prompt, shed, worker


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


def test_once_a_worker_was_watched_its_best_speed_is_the_offer_and_an_slo_the_offer_meets_is_admitted(monkeypatch):
    """A worker that never ran at its profile's speed (its steps' own overhead, which the profile leaves out):
    after WINDOW_S of corrections, an SLO between the profile and the best speed seen is INVALID_ARGUMENT naming
    what the cluster can offer, and that value is admitted on the idle cluster, not shed for ever."""
    now = [1000.0]
    monkeypatch.setattr(best_speed.time, "monotonic", lambda: now[0])
    slow = Router([worker("p0", speed_factor=2.0), worker("d0", "decode", speed_factor=2.0)])
    shed(slow, prompt(500), "TTFT", slo_s=(0.6, 1.0))  # ~510 ms on the profile, ~1 s at this speed: may pass
    now[0] += best_speed.WINDOW_S
    with pytest.raises(InvalidRequestError, match="slo.ttft_ms") as ttft:
        slow.admit(prompt(500), slo_s=(0.6, 1.0))
    offered_ms = int(re.search(r"can offer is (\d+) ms", str(ttft.value)).group(1))
    assert 0.95 < offered_ms / 1020 < 1.05, str(ttft.value)
    slow.admit(prompt(500), slo_s=(offered_ms / 1e3, 1.0))  # the advice taken: admitted, nothing queued
    with pytest.raises(InvalidRequestError, match="slo.tpot_ms") as tpot:
        slow.admit(prompt(100), slo_s=(5.0, 0.03))  # 25 ms on the profile, 50 ms at this speed
    offered_ms = int(re.search(r"can offer is (\d+) ms", str(tpot.value)).group(1))
    slow.admit(prompt(100), slo_s=(5.0, offered_ms / 1e3))


def test_a_worker_slower_now_than_its_best_is_offered_at_its_speed_now_which_is_admitted(monkeypatch):
    """INVALID_ARGUMENT is judged at the best speed of the last WINDOW_S, which noise alone puts below the speed of
    the moment: the value the refusal names is the larger of the two, so asking for it is admitted on the idle
    cluster. A soak saw the best speed's value shed (RESOURCE_EXHAUSTED) 48 times in 48, nothing queued."""
    now = [1000.0]
    monkeypatch.setattr(best_speed.time, "monotonic", lambda: now[0])
    p0, d0 = worker("p0", speed_factor=2.0), worker("d0", "decode", speed_factor=2.0)
    r = Router([p0, d0])
    shed(r, prompt(500), "TTFT", slo_s=(0.6, 1.0))  # watched from here
    now[0] += best_speed.WINDOW_S
    with pytest.raises(InvalidRequestError, match="slo.ttft_ms"):  # its best, 2x the profile, seen
        r.admit(prompt(500), slo_s=(0.6, 1.0))
    for w in (p0, d0):
        r.registry.publish(replace(w, speed_factor=2.4))
    with pytest.raises(InvalidRequestError, match="slo.ttft_ms") as ttft:
        r.admit(prompt(500), slo_s=(0.6, 1.0))
    offered_ms = int(re.search(r"can offer is (\d+) ms", str(ttft.value)).group(1))
    assert 0.95 < offered_ms / (1020 * 1.2) < 1.05, str(ttft.value)  # now's, not the best's 1020 ms
    r.admit(prompt(500), slo_s=(offered_ms / 1e3, 1.0))
    with pytest.raises(InvalidRequestError, match="slo.tpot_ms") as tpot:
        r.admit(prompt(100), slo_s=(5.0, 0.03))
    offered_ms = int(re.search(r"can offer is (\d+) ms", str(tpot.value)).group(1))
    r.admit(prompt(100), slo_s=(5.0, offered_ms / 1e3))
