"""A worker's thread count follows the CPUs its pod may use, not the node's core count."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pdserve.config import ClusterConfig, EngineConfig
from pdserve.cpus import usable_cpus

AFFINITY = len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"cpu.max": "max 100000\n"}, AFFINITY),  # v2, unlimited
        ({"cpu.max": "50000 100000\n"}, 1),  # half a CPU: still one thread
        ({"cpu.max": "150000 100000\n"}, min(AFFINITY, 2)),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, AFFINITY),  # v1, unlimited
        ({"cpu/cpu.cfs_quota_us": "100000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1),
        ({}, AFFINITY),  # no cgroup files
    ],
)
def test_the_cgroup_quota_caps_the_affinity(tmp_path: Path, files: dict[str, str], expected: int) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert usable_cpus(tmp_path) == expected


def test_a_worker_on_a_node_of_its_own_picks_its_threads_there() -> None:
    assert ClusterConfig(role_resources=True).worker_engine().num_threads is None  # the worker decides on its pod
    assert ClusterConfig(role_resources=True, engine=EngineConfig(num_threads=3)).worker_engine().num_threads == 3
    shared = ClusterConfig(prefill=1, decode=1).worker_engine().num_threads  # one machine: a share each
    assert shared == max(1, (os.cpu_count() or 1) // 2)
