"""Fault injection at a worker's start (`env.fault_config`): a start that fails, a profile that reads slow."""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path

from pdserve import env
from pdserve.protocol.perf_profile import PerfProfile


def fail_first_start(worker_id: str) -> None:
    """PDSERVE_FAULT_FIRST_START_FAILS_DIR: this worker's first start fails, its next succeeds."""
    folder = env.fault_config().first_start_fails_dir
    if folder and not (marker := Path(folder) / worker_id).exists():
        marker.touch()
        raise RuntimeError(f"fault injected: the first start of {worker_id} fails")


def slowed_profile(profile: PerfProfile, worker_id: str) -> PerfProfile:
    """PDSERVE_FAULT_SLOW_PROFILE_WORKER_ID/_TIMES: the profile this worker measured, every time in it that many
    times longer, as if timed while other processes loaded its host."""
    times = env.fault_config().profile_times_for(worker_id)
    if times == 1.0:
        return profile
    return replace(profile, **{f.name: getattr(profile, f.name) * times for f in fields(profile)})
