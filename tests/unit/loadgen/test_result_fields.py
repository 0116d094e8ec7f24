"""What a result file records of its run, so that it can be read, identified and reproduced alone."""

from __future__ import annotations

import datetime
import re

import pytest

import pdserve
from loadgen import provenance
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


def test_a_run_cut_short_on_schedule_does_not_say_the_client_fell_behind():
    """Ctrl-C after 3 sends at 2 req/s that were due, and went, at 1 req/s: its schedule's, not the client's."""
    on_time = [RequestRecord(f"r{i}", 4, 4, 1.0 * (i + 1), start_s=1.0 * (i + 1)) for i in range(3)]
    run = build_result(BenchmarkConfig("127.0.0.1:50051", WorkloadConfig()), 2.0, on_time, 3.0, interrupted=True)
    assert run["interrupted"] is True and run["warnings"] == []


def test_a_result_records_every_workload_setting_and_when_and_with_what_it_ran(tmp_path, monkeypatch):
    monkeypatch.setattr(pdserve, "__version__", "9.8.7")  # the code's version, whatever metadata pip has of it
    workload = WorkloadConfig("prefix-repetition", 7, random_input_len=33, random_range_ratio=0.5, prefix_len=12)
    config = BenchmarkConfig(
        "http://h:1", workload, backend="openai", endpoint="/v2", served_model_name="m", seed=9, burstiness=0.5
    )
    run = build_result(config, 2.0, [], 1.5)
    expected = {
        "dataset_name": "prefix-repetition",
        "random_input_len": 33,
        "random_output_len": 128,
        "random_range_ratio": 0.5,
        "prefix_repetition_prefix_len": 12,
        "prefix_repetition_suffix_len": 256,
        "prefix_repetition_num_prefixes": 10,
        "prefix_repetition_output_len": 128,
        "trace": None,
        "backend": "openai",
        "endpoint": "/v2",
        "served_model_name": "m",
        "seed": 9,
        "burstiness": 0.5,
        "max_concurrency": 256,
        "loadgen_version": "9.8.7",
    }
    assert {key: run[key] for key in expected} == expected
    start, end = (datetime.datetime.fromisoformat(run[key]) for key in ("start_time", "end_time"))
    assert start.utcoffset() == end.utcoffset() == datetime.timedelta(0)
    assert end - start == datetime.timedelta(seconds=1.5)
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", run["git_commit"])  # these tests run in a checkout
    assert provenance.git_commit(tmp_path) is None  # outside one: no commit, no error
