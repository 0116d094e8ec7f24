"""The recommendation follows the workload's shape, and `pdserve plan --json` keeps its keys."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pdserve import cli
from pdserve.planner.hardware import HardwareProfile
from pdserve.planner.plan import SLO, plan, recommend
from pdserve.planner.workload import synthetic
from tests.unit.planner.synthetic import synthetic_profile

SLO_ = SLO(ttft_ms=1000, tpot_ms=60, attainment=0.9)


def recommended_prefill(input_len: int, output_len: int) -> int:
    workload = synthetic(1.0, input_len, output_len, 80, range_ratio=0.2, seed=3)
    return recommend(plan(synthetic_profile(), workload, SLO_, 3)).shape.prefill


def test_longer_prompts_move_the_recommendation_toward_prefill() -> None:
    """2048 tokens, not 4096: on this profile the longest of 4096 ± 20% take about the 1 s TTFT bound even idle, so
    attainment hangs at the 0.9 target and the split turns on the draw."""
    assert recommended_prefill(128, 64) < recommended_prefill(2048, 64)


def test_longer_outputs_move_the_recommendation_toward_decode() -> None:
    assert recommended_prefill(1024, 16) > recommended_prefill(1024, 512)


def test_plan_json_has_the_documented_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = tmp_path / "profile.json"
    synthetic_profile().save(profile)
    argv = ["plan", "--profile", str(profile), "--rate", "2", "--input-len", "512", "--output-len", "32"]
    argv += ["--num-requests", "60", "--slo-ttft-ms", "500", "--slo-tpot-ms", "50", "--workers", "3", "--json"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"recommended", "candidates"}
    assert set(out["recommended"]) == {"prefill", "decode"}
    assert sum(out["recommended"].values()) == 3
    keys = {"prefill", "decode", "colocated", "goodput", "attainment", "ttft_p90_ms", "tpot_p90_ms", "max_rate", "shed"}
    assert [set(c) for c in out["candidates"]] == [keys] * 3
    shapes = [(c["prefill"], c["decode"], c["colocated"]) for c in out["candidates"]]
    assert shapes == [(1, 2, 0), (2, 1, 0), (0, 0, 3)]
    assert all(c["max_rate"] > 0 for c in out["candidates"])


def test_plan_json_is_valid_json_when_no_request_finishes() -> None:
    """No 256-token prompt fits a 200-token cache (`pdserve plan` refuses such a workload; autoscale's may hold
    one): every request fails, there are no latencies, and the p90 fields are null (not Infinity, which JSON
    does not have)."""
    from pdserve.planner.plan import plan, plan_json

    candidates = plan(synthetic_profile(kv_capacity_tokens=200), synthetic(2.0, 256, 8, 20), SLO(1000, 100), 2)

    def no_constants(name: str) -> None:
        raise ValueError(f"not JSON: {name}")

    out = json.loads(json.dumps(plan_json(candidates), allow_nan=False), parse_constant=no_constants)
    assert [(c["ttft_p90_ms"], c["tpot_p90_ms"], c["attainment"]) for c in out["candidates"]] == [(None, None, 0)] * 2


def test_plan_without_a_workload_names_the_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = tmp_path / "profile.json"
    synthetic_profile().save(profile)
    argv = ["plan", "--profile", str(profile), "--slo-ttft-ms", "500", "--slo-tpot-ms", "50", "--workers", "3"]
    assert cli.main(argv) == 2
    assert "--rate" in capsys.readouterr().err


def test_a_trace_is_planned_at_its_own_rate(tmp_path: Path) -> None:
    from pdserve.planner.workload import from_trace

    trace = tmp_path / "trace.jsonl"
    lines = [{"timestamp": 500 * i, "input_length": 300, "output_length": 20} for i in range(11)]
    trace.write_text("\n".join(json.dumps(line) for line in lines))
    workload = from_trace(trace)
    assert workload.rate == pytest.approx(2.0)
    assert [r.arrival_s for r in workload.at_rate(workload.rate)][:3] == pytest.approx([0.0, 0.5, 1.0])


@pytest.mark.parametrize("flag", ["--rate", "--input-len", "--output-len"])
def test_a_synthetic_workloads_flag_beside_a_trace_is_a_usage_error_not_ignored(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    """`plan --trace T --rate 50` planned the trace at its own rate and said nothing of the 50."""
    profile, trace = tmp_path / "profile.json", tmp_path / "trace.jsonl"
    synthetic_profile().save(profile)
    lines = [{"timestamp": 500 * i, "input_length": 30, "output_length": 4} for i in range(11)]
    trace.write_text("\n".join(json.dumps(line) for line in lines))
    argv = ["plan", "--profile", str(profile), "--trace", str(trace), flag, "50"]
    assert cli.main([*argv, "--slo-ttft-ms", "500", "--slo-tpot-ms", "50", "--workers", "2"]) == 2
    assert f"{flag} applies without --trace" in capsys.readouterr().err


@pytest.mark.parametrize("stamps", [[1000, 1000, 1000], [1000]])
def test_a_trace_at_one_timestamp_is_a_usage_error_not_a_plan_at_1_req_s(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], stamps: list[int]
) -> None:
    """A burst scales to no other rate: there is no max rate to plan by, and it offered no 1 req/s."""
    profile, trace = tmp_path / "profile.json", tmp_path / "trace.jsonl"
    synthetic_profile().save(profile)
    trace.write_text(
        "".join(json.dumps({"timestamp": t, "input_length": 30, "output_length": 4}) + "\n" for t in stamps)
    )
    argv = ["plan", "--profile", str(profile), "--trace", str(trace)]
    assert cli.main([*argv, "--slo-ttft-ms", "500", "--slo-tpot-ms", "50", "--workers", "2"]) == 2
    assert "share one timestamp" in capsys.readouterr().err


@pytest.mark.parametrize("seed", range(6))
def test_a_synthetic_workload_arrives_at_the_rate_it_names_whatever_the_seed(seed: int) -> None:
    arrivals = synthetic(10.0, 256, 8, 400, seed=seed).at_rate(10.0)
    assert len(arrivals) / arrivals[-1].arrival_s == pytest.approx(10.0)  # unscaled, seed 0 came at 8.9 req/s


@pytest.mark.parametrize("burstiness", [0.02, 1e6])
def test_a_synthetic_workload_at_either_end_of_the_burstiness_range_arrives_at_its_rate(burstiness: float) -> None:
    """Below the range every gamma gap drew 0 and the arrivals were NaN; the library refuses it as the flag does."""
    arrivals = synthetic(10.0, 256, 8, 400, burstiness=burstiness, seed=1).at_rate(10.0)
    assert len(arrivals) / arrivals[-1].arrival_s == pytest.approx(10.0)
    with pytest.raises(ValueError, match=r"burstiness must lie in \[0.02, 1e\+06\], got 1e-10"):
        synthetic(10.0, 256, 8, 400, burstiness=1e-10)


def test_a_trace_line_without_a_key_is_a_usage_error_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile, trace = tmp_path / "profile.json", tmp_path / "trace.jsonl"
    synthetic_profile().save(profile)
    lines = [{"timestamp": 0, "input_length": 300, "output_length": 20}, {"timestamp": 500, "input_length": 300}]
    trace.write_text("\n".join(json.dumps(line) for line in lines))
    argv = ["plan", "--profile", str(profile), "--trace", str(trace)]
    assert cli.main([*argv, "--slo-ttft-ms", "500", "--slo-tpot-ms", "50", "--workers", "2"]) == 2
    assert "line 2: no 'output_length'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("row", "says"),
    [
        ({"timestamp": 500, "input_length": 0, "output_length": 20}, "line 2: input_length and output_length"),
        ({"timestamp": 500, "input_length": 300, "output_length": -3}, "line 2: input_length and output_length"),
        ({"timestamp": "nan", "input_length": 300, "output_length": 20}, "line 2: timestamp 'nan' is not a time"),
        ({"timestamp": 500, "input_length": 1e999, "output_length": 20}, "line 2: input_length and output_length"),
    ],
)
def test_a_trace_line_no_request_could_have_is_a_usage_error_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], row: dict[str, object], says: str
) -> None:
    profile, trace = tmp_path / "profile.json", tmp_path / "trace.jsonl"
    synthetic_profile().save(profile)
    trace.write_text("\n".join(json.dumps(r) for r in ({"timestamp": 0, "input_length": 3, "output_length": 2}, row)))
    argv = ["plan", "--profile", str(profile), "--trace", str(trace)]
    assert cli.main([*argv, "--slo-ttft-ms", "500", "--slo-tpot-ms", "50", "--workers", "2"]) == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--rate", "inf"),
        ("--rate", "nan"),
        ("--burstiness", "nan"),
        ("--burstiness", "1e-300"),
        ("--burstiness", "1e7"),
        ("--slo-ttft-ms", "nan"),
        ("--slo-tpot-ms", "0"),
        ("--input-len", "0"),
        ("--output-len", "-5"),
        ("--num-requests", "0"),
        ("--range-ratio", "1"),
        ("--seed", "-1"),
        ("--attainment", "1.5"),
    ],
)
def test_a_value_no_workload_or_slo_has_is_refused_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    """Not a traceback (--rate inf broke the JSON), nor a table of zeros (nan), nor lengths quietly made 1."""
    profile = tmp_path / "profile.json"
    synthetic_profile().save(profile)
    argv = {"--rate": "2", "--input-len": "64", "--output-len": "8", "--slo-ttft-ms": "500", "--slo-tpot-ms": "50"}
    argv[flag] = value
    with pytest.raises(SystemExit) as exit_:
        cli.main(["plan", "--profile", str(profile), "--workers", "2", *(x for kv in argv.items() for x in kv)])
    assert exit_.value.code == 2 and f"argument {flag}:" in capsys.readouterr().err


def test_a_request_no_workers_kv_cache_holds_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = tmp_path / "profile.json"
    synthetic_profile(kv_capacity_tokens=4096).save(profile)
    argv = ["plan", "--profile", str(profile), "--rate", "2", "--input-len", "4000", "--output-len", "200"]
    assert cli.main([*argv, "--slo-ttft-ms", "500", "--slo-tpot-ms", "50", "--workers", "2"]) == 2
    assert "a request of 4200 tokens (prompt and output) does not fit a worker's KV cache" in capsys.readouterr().err


def test_a_request_longer_than_the_models_context_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The router refuses prompt + max_tokens past the context (INVALID_ARGUMENT): a plan for them would size a
    cluster for requests it never serves. A profile without the field (an older one) is not checked."""
    profile = tmp_path / "profile.json"
    argv = ["plan", "--profile", str(profile), "--rate", "2", "--input-len", "2000", "--output-len", "100"]
    argv += ["--slo-ttft-ms", "5000", "--slo-tpot-ms", "500", "--workers", "2"]
    synthetic_profile(meta={"context_tokens": 2048}).save(profile)
    assert cli.main(argv) == 2
    assert "a request of 2100 tokens (prompt and output) exceeds the model's context of 2048" in capsys.readouterr().err
    synthetic_profile(meta={"context_tokens": 8192}).save(profile)
    assert cli.main(argv) in (0, 1) and "exceeds the model's context" not in capsys.readouterr().err
    synthetic_profile().save(profile)
    assert cli.main(argv) in (0, 1) and "exceeds the model's context" not in capsys.readouterr().err


def test_the_table_says_whether_the_workers_share_a_hosts_cores(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plan for GPU pods and one for workers sharing a host's cores read differently: the table says which."""
    own, shared = tmp_path / "own.json", tmp_path / "shared.json"
    synthetic_profile().save(own)
    synthetic_profile(shared_cores=2, serving_latency_s=0.015).save(shared)
    argv = ["--rate", "2", "--input-len", "512", "--output-len", "32", "--num-requests", "40"]
    argv += ["--slo-ttft-ms", "500", "--slo-tpot-ms", "50", "--workers", "2"]
    captions = []
    for profile in (own, shared):
        assert cli.main(["plan", "--profile", str(profile), *argv]) == 0
        captions.append(" ".join(capsys.readouterr().out.split()))
    assert "each worker on its own device and cores" in captions[0] and "no serving latency" in captions[0]
    assert "shares 2 cores with the serving stack" in captions[1] and "serving latency 15.0 ms" in captions[1]
    assert "host cores" not in captions[0] and "host cores" in captions[1]  # the demand on them, per split


def test_no_rate_asks_more_of_a_shared_host_than_its_cores() -> None:
    """One core; the serving stack costs 50 ms of CPU per request beside the engines' work. A finite trace
    still meets lax SLOs well past the rate at which that asks for more than the core (the host falls behind
    all along); the max rate stops where the demand reaches the core."""
    from pdserve.planner.plan import max_rate, simulate
    from pdserve.planner.shape import Shape

    profile = synthetic_profile(shared_cores=1, serving_cpu_s=0.05, meta={"threads": 1})
    shape, workload = Shape(prefill=1, decode=1), synthetic(1.0, 256, 4, 200, seed=4)
    lax = SLO(ttft_ms=5000, tpot_ms=1000, attainment=0.9)
    found = max_rate(profile, shape, workload, lax)
    assert found > 0 and simulate(profile, shape, workload, found, lax).demand_cores <= 1
    beyond = simulate(profile, shape, workload, 1.5 * found, lax)
    assert beyond.attainment >= lax.attainment and beyond.demand_cores > 1


def test_max_rate_is_a_rate_the_split_keeps_up_with_not_a_burst_it_clears() -> None:
    """A finite trace at a high enough rate is one burst, which a split may clear within its SLO though it could
    never keep up with that rate: the max rate stays under the rate its busiest phase keeps up with, and hardly
    moves with the trace's length (it fell from about 400 to 37 req/s between 200 and 1000 requests before)."""
    from pdserve.planner.plan import max_rate, sustainable_rate
    from pdserve.planner.shape import Shape

    profile, shape = synthetic_profile(), Shape(prefill=1, decode=3)
    slo = SLO(ttft_ms=5000, tpot_ms=1000, attainment=0.9)
    found = {n: max_rate(profile, shape, synthetic(1.0, 512, 512, n, seed=1), slo) for n in (100, 1000)}
    bound = sustainable_rate(profile, shape, synthetic(1.0, 512, 512, 1000, seed=1))
    assert all(0 < rate <= bound for rate in found.values()), (found, bound)
    assert found[100] / found[1000] < 1.2, found


def test_one_token_outputs_have_no_tpot_as_loadgen_counts_them() -> None:
    """loadgen leaves TPOT undefined below 2 tokens: out of the percentiles, and no bar to the TPOT SLO. Here every
    other request has one output token and the rest, each alone on the cluster, all the same TPOT."""
    from pdserve.planner.plan import simulate
    from pdserve.planner.shape import Shape
    from pdserve.planner.simulator import Simulator
    from pdserve.planner.workload import Workload

    profile, shape = synthetic_profile(), Shape(prefill=1, decode=1)
    workload = Workload((256,) * 20, (1, 20) * 10, tuple(float(i) for i in range(20)), 1.0)
    tpot_s = Simulator(profile, shape).run(workload.at_rate(1.0)).tpot_s
    assert tpot_s[::2] == [None] * 10
    got = simulate(profile, shape, workload, 1.0, SLO(ttft_ms=1000, tpot_ms=100))
    assert got.tpot_ms == pytest.approx((tpot_s[1] * 1e3,) * 3) and got.attainment == 1.0


def test_plan_sheds_as_the_router_would_unless_told_it_sheds_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """30 req/s of 512-token prompts: more than either split of three workers can prefill (1 or 2 prefill workers at
    ~9.3 prompts/s each), about what three colocated ones can."""
    profile = tmp_path / "profile.json"
    synthetic_profile().save(profile)
    argv = ["plan", "--profile", str(profile), "--rate", "30", "--input-len", "512", "--output-len", "8"]
    argv += ["--num-requests", "120", "--slo-ttft-ms", "500", "--slo-tpot-ms", "50", "--workers", "3", "--json"]

    def shed(*flags: str) -> list[float]:
        assert cli.main([*argv, *flags]) == 0
        return [c["shed"] for c in json.loads(capsys.readouterr().out)["candidates"]]

    one_to_two, two_to_one, _ = shed()
    assert one_to_two > two_to_one > 0.2
    assert all(s == 0 for s in shed("--no-admission"))
    assert sum(shed("--max-queued-prefill-tokens", "600")) > sum(shed())  # a second prompt no longer queues
    loose = ["--slo-ttft-ms", "60000"]  # 60 s: within the router's default bound, the queues sit far below it
    assert sum(shed(*loose, "--first-token-timeout-s", "0.2")) > sum(shed(*loose))  # held to 0.2 s instead
    for bad in (["--first-token-timeout-s", "0"], ["--max-queued-prefill-tokens", "0"], ["--slo-headroom", "1.5"]):
        with pytest.raises(SystemExit):  # argparse's usage error, exit 2, not a traceback from the router's config
            cli.main([*argv, *bad])


def test_the_rate_bound_counts_a_prefill_workers_prompts_a_step_each_and_a_colocated_workers_packed() -> None:
    """A GPU-like profile, 20 ms fixed per prefill step: a colocated worker (as its engine) packs several 128-token
    prompts into one step, so it keeps up with 60 req/s (the bound used to charge each prompt a step of its own, 47
    req/s, and capped the max rate, and autoscale asked for more workers); a prefill worker runs one prompt a step
    (cluster/worker_spec.py), so 1P:1D does not, and its bound is that one. One-token outputs never step the decode
    worker, so they are no bound there."""
    from pdserve.planner.plan import simulate, sustainable_rate
    from pdserve.planner.shape import Shape
    from pdserve.planner.step_costs import prefill_work_s
    from pdserve.protocol.perf_profile import PerfProfile

    perf = PerfProfile(
        prefill_fixed_s=0.02, prefill_per_token_s=1e-5, prefill_per_token2_s=0.0, decode_fixed_s=0.005,
        decode_per_seq_s=0.0001,
    )  # fmt: skip
    profile, slo = synthetic_profile(perf=perf), SLO(ttft_ms=200, tpot_ms=50, attainment=0.9)
    one_token = synthetic(60.0, 128, 1, 200, seed=0)
    for shape, packed in ((Shape(colocated=1), True), (Shape(prefill=1, decode=1), False)):
        prefill_s = sum(prefill_work_s(profile, n, packed=packed) for n in one_token.input_lens) / 200
        assert sustainable_rate(profile, shape, one_token) == pytest.approx(1 / prefill_s)  # the prefill's bound
        met = simulate(profile, shape, one_token, 60.0, slo)
        assert (met.attainment >= 0.9 and met.prefill_busy < 1.0) == packed, (shape, met)
    assert sustainable_rate(profile, Shape(prefill=1, decode=1), one_token) < 48.0


def test_a_trace_far_slower_than_the_cluster_finds_the_same_max_rate() -> None:
    """A few requests over hours: the search doubling from the trace's rate ran out of doublings at rate x 2^20,
    and every split tied at that cap; it starts near the rate bound instead."""
    from pdserve.planner.plan import max_rate
    from pdserve.planner.shape import Shape

    profile, shape, slo = synthetic_profile(), Shape(prefill=1, decode=1), SLO(ttft_ms=1000, tpot_ms=60)
    slow, usual = (max_rate(profile, shape, synthetic(rate, 100, 10, 50, seed=2), slo) for rate in (1e-5, 1.0))
    assert slow == pytest.approx(usual, rel=0.05)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("kv_capacity_tokens", "100000"),
        ("step_overhead_s", "0.001"),
        ("transfer_gbps", math.nan),
        ("short_prompts_first", "false"),  # a string is true
    ],
)
def test_a_profile_with_a_field_of_the_wrong_kind_is_refused_naming_it(tmp_path, capsys, field, value):
    """A string broke plan with a TypeError traceback; a NaN transfer speed planned 0 req/s for every split."""
    path = tmp_path / "profile.json"
    synthetic_profile().save(path)
    data = json.loads(path.read_text())
    path.write_text(json.dumps(data | {field: value}))
    argv = ["plan", "--profile", str(path), "--rate", "1", "--input-len", "8", "--output-len", "8", "--workers", "2"]
    assert cli.main([*argv, "--slo-ttft-ms", "500", "--slo-tpot-ms", "50"]) == 2
    err = capsys.readouterr().err
    assert f"{field} must be a finite" in err or f"{field} must be true or false" in err


def test_a_profile_without_its_perf_key_is_refused_naming_the_key(tmp_path, capsys):
    """It said only "is not a pdserve profile: 'perf'", a KeyError's text."""
    path = tmp_path / "v2partial.json"
    path.write_text(json.dumps({"version": 2}))
    argv = ["plan", "--profile", str(path), "--rate", "1", "--input-len", "8", "--output-len", "8", "--workers", "2"]
    assert cli.main([*argv, "--slo-ttft-ms", "500", "--slo-tpot-ms", "50"]) == 2
    assert capsys.readouterr().err == f"pdserve plan: {path} is not a pdserve profile: it has no 'perf' key\n"


@pytest.mark.parametrize("quantiles", [[-0.001, 0.01], [0.005, math.nan], [0.005, math.inf], [0.02, 0.01], "0.01"])
def test_a_profile_with_a_bad_serving_latency_spread_is_refused_naming_it(tmp_path, capsys, quantiles):
    """A negative or endless latency, or quantiles out of order, would skew every draw the simulator makes."""
    path = tmp_path / "profile.json"
    synthetic_profile().save(path)
    path.write_text(json.dumps(json.loads(path.read_text()) | {"serving_latency_quantiles_s": quantiles}))
    argv = ["plan", "--profile", str(path), "--rate", "1", "--input-len", "8", "--output-len", "8", "--workers", "2"]
    assert cli.main([*argv, "--slo-ttft-ms", "500", "--slo-tpot-ms", "50"]) == 2
    assert "serving_latency_quantiles_s must be finite seconds" in capsys.readouterr().err


def test_the_table_gives_the_serving_latencys_spread_and_an_older_profile_loads_without_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "profile.json"
    spread = [0.002 * j for j in range(1, 20)]
    synthetic_profile(serving_latency_s=0.0086, serving_latency_quantiles_s=spread).save(path)
    argv = ["plan", "--profile", str(path), "--rate", "2", "--input-len", "512", "--output-len", "32"]
    assert cli.main([*argv, "--slo-ttft-ms", "500", "--slo-tpot-ms", "50", "--workers", "2"]) == 0
    assert "serving latency 8.6 ms (p10-p90 4-36 ms)" in " ".join(capsys.readouterr().out.split())
    older = json.loads(path.read_text())
    del older["serving_latency_quantiles_s"]
    path.write_text(json.dumps(older))
    assert HardwareProfile.load(path).serving_latency_quantiles_s == []
