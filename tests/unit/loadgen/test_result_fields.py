"""What a result file records of its run, so that it can be read, identified and reproduced alone."""

from __future__ import annotations

from loadgen.benchmark import BenchmarkConfig, build_result
from loadgen.workload import WorkloadConfig


def result(**config: object) -> dict:
    return build_result(BenchmarkConfig("127.0.0.1:50051", WorkloadConfig(), **config), 2.0, [], 1.0)  # type: ignore[arg-type]


def test_the_concurrency_bound_in_force_is_recorded_never_null():
    """null reads as unbounded in vLLM's files; without --max-concurrency loadgen's own bound holds requests."""
    assert result()["max_concurrency"] == 256
    assert result(max_concurrency=8)["max_concurrency"] == 8
    assert result()["concurrency_wait_in_latency"] is False
