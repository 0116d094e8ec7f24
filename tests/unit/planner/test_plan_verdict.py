"""What `pdserve plan` says when no split meets the SLO at any rate, or none sustains the workload's rate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve import cli
from tests.unit.planner.synthetic import synthetic_profile


def plan_argv(profile: Path, rate: str, ttft_ms: str, *extra: str) -> list[str]:
    argv = ["plan", "--profile", str(profile), "--rate", rate, "--input-len", "512", "--output-len", "32"]
    return [*argv, "--num-requests", "60", "--slo-ttft-ms", ttft_ms, "--slo-tpot-ms", "50", "--workers", "3", *extra]


def test_an_slo_no_shape_meets_even_idle_recommends_nothing_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A user review: every split at 0 req/s, and still `recommended: --prefill 1 --decode 2`, exit 0, which a
    script would apply. The JSON keeps its documented keys; the exit status and stderr say it."""
    profile = tmp_path / "profile.json"
    synthetic_profile().save(profile)
    assert cli.main(plan_argv(profile, "1", "0.001")) == 1
    out, err = capsys.readouterr()
    assert "recommended: none" in out and "recommended: --prefill" not in out, out
    assert " *" not in out, out  # no row marked as the recommended split either
    assert "no split (nor the colocated shape) meets the SLO at any rate" in err, err
    assert cli.main(plan_argv(profile, "1", "0.001", "--json")) == 1
    out, err = capsys.readouterr()
    assert set(json.loads(out)) == {"recommended", "candidates"} and "meets the SLO" in err


def test_a_rate_past_every_shapes_capacity_is_said(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = tmp_path / "profile.json"
    synthetic_profile().save(profile)
    assert cli.main(plan_argv(profile, "2", "500")) == 0
    assert "sustains the" not in capsys.readouterr().out
    assert cli.main(plan_argv(profile, "400", "500")) == 0
    out = capsys.readouterr().out
    assert "recommended: --prefill" in out and "sustains the workload's 400.00 req/s" in out, out


def test_a_rate_far_past_every_shapes_capacity_finds_the_max_rates_a_rate_within_it_finds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plan asked for a bigger fleet's rate: its search began at the rate / 1024, itself past what these workers
    keep up with, so every shape read as failing even idle ("loosen the SLO", exit 1), and at a lesser multiple
    the bisection's bracket, as wide as the rate, left each max rate short (here at 2000 req/s, 1P:2D's 8.4 req/s
    came out 2.0)."""
    profile = tmp_path / "profile.json"
    synthetic_profile().save(profile)

    def max_rates(rate: str) -> list[float]:
        assert cli.main(plan_argv(profile, rate, "500", "--json")) == 0
        return [c["max_rate"] for c in json.loads(capsys.readouterr().out)["candidates"]]

    within = max_rates("2")
    for rate in ("2000", "100000"):
        assert max_rates(rate) == pytest.approx(within, rel=0.02), rate
    assert cli.main(plan_argv(profile, "100000", "500")) == 0
    out, err = capsys.readouterr()
    assert "recommended: --prefill" in out and "sustains the workload's 100000.00 req/s" in out and not err, out


def test_only_the_colocated_shape_meeting_the_slo_is_no_recommended_split() -> None:
    """`pdserve scale` applies splits: a colocated shape that alone meets the SLO is said, no split recommended."""
    from types import SimpleNamespace

    from pdserve.planner.report import unmet, verdict
    from pdserve.planner.shape import Shape

    def candidate(shape: Shape, max_rate: float) -> SimpleNamespace:
        return SimpleNamespace(shape=shape, max_rate=max_rate)

    splits = [candidate(Shape(1, 2), 0.0), candidate(Shape(2, 1), 0.0)]
    why = unmet([*splits, candidate(Shape(colocated=3), 4.5)])  # type: ignore[list-item]
    assert why is not None and "3 colocated workers sustain 4.50 req/s" in why
    assert verdict([*splits, candidate(Shape(colocated=3), 4.5)], 1.0) == "recommended: none"  # type: ignore[list-item]
    assert unmet([candidate(Shape(1, 2), 0.1), candidate(Shape(colocated=3), 4.5)]) is None  # type: ignore[list-item]


def test_a_rate_only_the_colocated_shape_sustains_says_no_split_does() -> None:
    """An SRE review: `recommended: --prefill 1 --decode 1 (sustains 3.31 req/s)` at --rate 6, the colocated shape
    named as sustaining more, and nothing saying the split falls short of the rate asked for."""
    from types import SimpleNamespace

    from pdserve.planner.report import verdict
    from pdserve.planner.shape import Shape

    at_rate = SimpleNamespace(attainment=0.8, goodput=4.81)
    candidates = [
        SimpleNamespace(shape=Shape(1, 1), max_rate=3.31, at_rate=at_rate),
        SimpleNamespace(shape=Shape(colocated=2), max_rate=11.86, at_rate=at_rate),
    ]
    said = verdict(candidates, 6.0)  # type: ignore[arg-type]
    assert said.startswith("recommended: --prefill 1 --decode 1 (sustains 3.31 req/s)"), said
    assert "no split of these workers sustains the workload's 6.00 req/s within the SLO: add workers" in said, said
    assert "no split" not in verdict(candidates, 3.0)  # type: ignore[arg-type]


def test_the_caption_names_the_profiles_threads() -> None:
    """A CPU profile's speed is its thread count's: a review's --threads 2 profile taken in a busy spell said no
    split met the SLO, and nothing in the plan showed what it was measured with."""
    from pdserve.planner.report import profile_caption

    profile = synthetic_profile()
    profile.meta.update(model="tiny-random", device="cpu", dtype="float32", threads=2)
    assert profile_caption(profile).startswith("profile: tiny-random on cpu (float32, 2 threads)")
    profile.meta.update(threads=1)
    assert profile_caption(profile).startswith("profile: tiny-random on cpu (float32, 1 thread)")
