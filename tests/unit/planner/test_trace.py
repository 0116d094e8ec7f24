"""`pdserve plan --trace` simulates the requests loadgen replays from the same trace: the same lines refused, the
same earliest N kept (plan's --num-requests as loadgen's --num-prompts), the same lengths and arrival times."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from loadgen.workload import WorkloadConfig, build_workload
from pdserve import cli
from pdserve.planner.workload import from_trace
from tests.unit.planner.synthetic import synthetic_profile

LINES = [
    {"timestamp": 2000, "input_length": 30, "output_length": 4, "hash_ids": [1]},
    {"timestamp": 500, "input_length": 20, "output_length": 3},
    {"timestamp": 1250, "input_length": 40, "output_length": 5, "hash_ids": [1, 2]},
    {"timestamp": 3500, "input_length": 10, "output_length": 6},
]


def write(tmp_path: Path, lines: list[dict[str, object]]) -> Path:
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return trace


def replayed(trace: Path, n: int) -> list[tuple[float, int, int]]:
    config = WorkloadConfig("trace", n, 1000, trace=trace)
    return [(r.arrival_s, r.input_len, r.output_len) for r in build_workload(config, np.random.default_rng(0))]


@pytest.mark.parametrize("n", [3, 4, 1000])
def test_plan_simulates_the_earliest_requests_loadgen_replays(tmp_path: Path, n: int) -> None:
    trace = write(tmp_path, LINES)
    load = from_trace(trace, n)
    simulated = [(r.arrival_s, r.input_len, r.output_len) for r in load.at_rate(load.rate)]
    sent = replayed(trace, n)
    assert [s[1:] for s in simulated] == [s[1:] for s in sent] and len(sent) == min(n, len(LINES))
    assert [s[0] for s in simulated] == pytest.approx([s[0] for s in sent])


@pytest.mark.parametrize(
    "bad",
    [{"input_length": 12.7}, {"output_length": "5"}, {"input_length": True}, {"hash_ids": "12"}, {"timestamp": "9"}],
)
def test_plan_refuses_the_lines_loadgen_refuses(tmp_path: Path, bad: dict[str, object]) -> None:
    """The planner truncated 12.7 and read "5" as 5, where loadgen refused both."""
    trace = write(tmp_path, [LINES[0], LINES[1] | bad])
    for read in (lambda: replayed(trace, 10), lambda: from_trace(trace)):
        with pytest.raises(ValueError, match="line 2"):
            read()


def test_plan_num_requests_keeps_the_earliest_lines_of_a_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It was ignored with --trace: the line past the first two, too long for any worker's KV cache, was planned."""
    profile = tmp_path / "profile.json"
    synthetic_profile().save(profile)
    too_long = {"timestamp": 9000, "input_length": synthetic_profile().kv_capacity_tokens, "output_length": 4}
    trace = write(tmp_path, [*LINES[:2], too_long])
    argv = ["plan", "--profile", str(profile), "--trace", str(trace), "--slo-ttft-ms", "500", "--slo-tpot-ms", "50"]
    argv += ["--workers", "2", "--json"]
    assert cli.main(argv) == 2
    assert "does not fit a worker's KV cache" in capsys.readouterr().err
    assert cli.main([*argv, "--num-requests", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["recommended"]


def test_a_trace_that_is_not_text_is_refused_naming_the_trace(tmp_path: Path, capsys) -> None:
    """It was the codec's words alone ("pdserve plan: 'utf-8' codec can't decode byte 0xff ..."), naming no file."""
    profile, trace = tmp_path / "profile.json", tmp_path / "trace.jsonl"
    synthetic_profile().save(profile)
    trace.write_bytes(b'{"timestamp": 0, "input_length": 3, "output_length": 2}\n\xff\xfe\n')
    argv = ["plan", "--profile", str(profile), "--trace", str(trace), "--workers", "2"]
    assert cli.main([*argv, "--slo-ttft-ms", "500", "--slo-tpot-ms", "50"]) == 2
    assert capsys.readouterr().err.startswith(f"pdserve plan: trace {trace} is not UTF-8 text ('utf-8' codec")
