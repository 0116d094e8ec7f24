"""`pdserve plan` refuses a workload it cannot simulate faithfully, naming the flag, instead of planning it: never a
numpy message, hours of simulation, or latencies the simulator's clock rounded away."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve import cli
from pdserve.cli import _parser
from pdserve.planner.plan import SLO, simulate
from pdserve.planner.shape import Shape
from pdserve.planner.workload import synthetic
from pdserve.request_rate import MAX_SPAN_S
from tests.unit.planner.synthetic import synthetic_profile

SLO_FLAGS = ["--slo-ttft-ms", "500", "--slo-tpot-ms", "50", "--workers", "2"]


def plan(tmp_path: Path, *flags: str) -> int:
    profile = tmp_path / "profile.json"
    synthetic_profile().save(profile)
    return cli.main(["plan", "--profile", str(profile), *flags, *SLO_FLAGS, "--json"])


def test_a_rate_whose_arrivals_outlast_the_simulations_clock_is_a_usage_error(tmp_path: Path, capsys) -> None:
    """At 1e-15 req/s every TTFT read 0 ms (float64 seconds near 4e17 s step by 64 s): a plan that met any SLO."""
    assert plan(tmp_path, "--rate", "1e-15", "--input-len", "100", "--output-len", "8") == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve plan: --rate 1e-15 spreads 400 requests over 4e+17 s, past the 1e+09 s"), err


def test_a_trace_that_outlasts_the_simulations_clock_is_a_usage_error(tmp_path: Path, capsys) -> None:
    trace = tmp_path / "trace.jsonl"
    lines = ({"timestamp": t, "input_length": 100, "output_length": 8} for t in (0, 1e300))
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert plan(tmp_path, "--trace", str(trace)) == 2
    assert f"pdserve plan: trace {trace} spans 1e+297 s, past the 1e+09 s" in capsys.readouterr().err


def test_the_slowest_workload_taken_keeps_its_latencies_well_within_a_millisecond() -> None:
    """At its rate to the nanosecond; at its max-rate search's idle probe, 1024 times slower, to 23 us."""
    profile, shape, slo = synthetic_profile(), Shape(prefill=1, decode=1), SLO(500, 50)
    slowest = synthetic(400 / MAX_SPAN_S, 100, 8, 400)
    idle = simulate(profile, shape, slowest, 1.0 / 1e6, slo)  # 1e6 s between requests: none waits for another
    for rate in (slowest.rate, slowest.rate / 1024):
        o = simulate(profile, shape, slowest, rate, slo)
        assert o.ttft_ms == pytest.approx(idle.ttft_ms, abs=0.05) and o.tpot_ms == pytest.approx(idle.tpot_ms, abs=0.05)


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [  # each was numpy's message (exit 2, no flag named), or a run of hours and tens of GiB (1e8 requests)
        ("--num-requests", str(2**63), "argument --num-requests: must lie in [1, 100000]"),
        ("--num-requests", "100000000", "argument --num-requests: must lie in [1, 100000]"),
        ("--input-len", str(2**63), "argument --input-len: must lie in [1, 1e+09]"),
        ("--output-len", str(2**63), "argument --output-len: must lie in [1, 1e+09]"),
    ],
)
def test_a_workload_too_large_to_draw_or_simulate_is_a_usage_error_naming_the_flag(capsys, flag, value, says):
    """Refused as the flags parse, before anything is drawn or simulated."""
    flags = {"--rate": "5", "--input-len": "100", "--output-len": "8", flag: value}
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args(["plan", "--profile", "p.json", *(x for kv in flags.items() for x in kv), *SLO_FLAGS])
    assert exit_.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "says"),
    [  # each was read until memory ran out
        ("--trace", "pdserve plan: --trace /dev/zero is over 268,435,456 bytes, the most it may be"),
        ("--profile", "pdserve plan: --profile /dev/zero is over 1,048,576 bytes, the most it may be"),
    ],
)
def test_a_file_past_its_cap_is_a_usage_error_naming_the_flag(tmp_path: Path, capsys, flag: str, says: str) -> None:
    profile = tmp_path / "profile.json"
    synthetic_profile().save(profile)
    given = {"--profile": str(profile), "--trace": "/dev/zero"} if flag == "--trace" else {"--profile": "/dev/zero"}
    rate = [] if flag == "--trace" else ["--rate", "5", "--input-len", "100", "--output-len", "8"]
    assert cli.main(["plan", *(x for kv in given.items() for x in kv), *rate, *SLO_FLAGS]) == 2
    assert capsys.readouterr().err.startswith(says)
