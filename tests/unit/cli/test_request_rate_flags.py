"""Every command that takes a request rate bounds it as loadgen's --request-rate does (pdserve.request_rate): 1e303
req/s was planned, benched and chaos-run, a rate no sender offers (past 1e6 req/s loadgen sends all at once)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.cli import _parser, main
from tests.unit.planner.synthetic import synthetic_profile

PLAN = ["plan", "--profile", "p.json", "--input-len", "64", "--output-len", "8", "--workers", "2"]
SLO = ["--slo-ttft-ms", "500", "--slo-tpot-ms", "50"]
RATE_FLAGS = [([*PLAN, *SLO], "--rate"), (["bench", "placement"], "--request-rate"), (["chaos"], "--rate")]


@pytest.mark.parametrize(("argv", "flag"), RATE_FLAGS, ids=["plan", "bench placement", "chaos"])
def test_a_rate_past_loadgens_bound_is_a_usage_error_saying_the_bound_and_why(capsys, argv, flag):
    """Refused as the flags parse: past that, bench placement and chaos start a cluster."""
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args([*argv, flag, "1e303"])
    err = " ".join(capsys.readouterr().err.split())
    assert exit_.value.code == 2
    assert f"argument {flag}: request rate must be at most 1e+06 req/s, got 1e+303: past it, loadgen sends" in err


@pytest.mark.parametrize(("argv", "flag"), RATE_FLAGS, ids=["plan", "bench placement", "chaos"])
def test_the_bound_itself_is_a_rate(argv, flag):
    assert getattr(_parser().parse_args([*argv, flag, "1e6"]), flag[2:].replace("-", "_")) == 1e6


def test_a_trace_whose_gaps_per_second_pass_the_bound_is_a_usage_error(tmp_path: Path, capsys) -> None:
    """Two requests 1e-300 ms apart were planned at 1e303 req/s."""
    profile, trace = tmp_path / "profile.json", tmp_path / "trace.jsonl"
    synthetic_profile().save(profile)
    lines = ({"timestamp": t, "input_length": 30, "output_length": 4} for t in (0, 1e-300))
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["plan", "--profile", str(profile), "--trace", str(trace), "--workers", "2", *SLO]) == 2
    err = capsys.readouterr().err
    assert f"pdserve plan: trace {trace}: its gaps per second, 1 over 1e-303 s: request rate must be at most" in err
