"""The CPUs this process may use: its affinity, capped by its cgroup's CPU quota (a Kubernetes pod's CPU limit).

`os.cpu_count()` counts the node's cores; a worker pod limited to 4 CPUs on a 64-core node that ran 64 torch
threads would spend its quota in a few milliseconds of each period and stall for the rest.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def usable_cpus(cgroup_root: Path = CGROUP_ROOT) -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cgroup_quota(cgroup_root)
    return max(1, min(cpus, math.ceil(quota))) if quota else max(1, cpus)


def _cgroup_quota(root: Path) -> float | None:
    """CPUs' worth of the quota (cgroup v2 `cpu.max`, else v1 `cpu.cfs_quota_us`), or None when unlimited."""
    try:
        quota, period = (root / "cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 else None
