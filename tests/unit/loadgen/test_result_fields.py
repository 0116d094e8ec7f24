"""What a result file records of its run, so that it can be read, identified and reproduced alone."""

from __future__ import annotations

import pytest

from loadgen.benchmark import BenchmarkConfig, build_result
from loadgen.record import RequestRecord
from loadgen.workload import WorkloadConfig


def result(**config: object) -> dict:
    return build_result(BenchmarkConfig("127.0.0.1:50051", WorkloadConfig(), **config), 2.0, [], 1.0)  # type: ignore[arg-type]


def test_the_concurrency_bound_in_force_is_recorded_never_null():
    """null reads as unbounded in vLLM's files; without --max-concurrency loadgen's own bound holds requests."""
    assert result()["max_concurrency"] == 256
    assert result(max_concurrency=8)["max_concurrency"] == 8
    assert result()["concurrency_wait_in_latency"] is False


def test_a_run_the_client_fell_behind_in_says_so_in_its_result():
    late = [RequestRecord(f"r{i}", 4, 4, 0.5 * (i + 1), start_s=0.5 * (i + 1) + 0.1 * i) for i in range(4)]
    run = build_result(BenchmarkConfig("127.0.0.1:50051", WorkloadConfig()), 2.0, late, 3.0)
    assert run["request_rate"] == 2.0 and run["achieved_request_rate"] == pytest.approx(4 / 2.3)
    assert "loadgen fell behind" in run["warnings"][0]
