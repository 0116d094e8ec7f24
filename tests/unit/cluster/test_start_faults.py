"""Faults injected at a worker's start (cluster/start_faults.py): the profile of the worker
PDSERVE_FAULT_SLOW_PROFILE_WORKER_ID names prices every step PDSERVE_FAULT_SLOW_PROFILE_TIMES times what it measured,
as one timed while other processes loaded its host; every other worker's is as measured."""

from __future__ import annotations

import pytest

from pdserve.cluster.start_faults import slowed_profile
from pdserve.protocol.perf_profile import PerfProfile

MEASURED = PerfProfile(0.01, 1e-3, 1e-8, 0.02, 0.005, 1e-7)


def test_the_named_workers_profile_reads_k_times_slow_and_the_others_as_measured(monkeypatch) -> None:
    monkeypatch.setenv("PDSERVE_FAULT_SLOW_PROFILE_WORKER_ID", "prefill-1")
    monkeypatch.setenv("PDSERVE_FAULT_SLOW_PROFILE_TIMES", "4")
    slowed = slowed_profile(MEASURED, "prefill-1")
    assert slowed.prefill_s(300, cached=100) == pytest.approx(4 * MEASURED.prefill_s(300, cached=100))
    assert slowed.decode_step_s(8, 1000) == pytest.approx(4 * MEASURED.decode_step_s(8, 1000))
    assert slowed_profile(MEASURED, "prefill-0") is MEASURED


def test_no_profile_is_slowed_unless_asked() -> None:
    assert slowed_profile(MEASURED, "prefill-1") is MEASURED
