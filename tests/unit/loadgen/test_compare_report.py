"""Result files, `loadgen compare` and the plots, from hand-made runs."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from loadgen import benchmark
from loadgen.__main__ import main
from loadgen.benchmark import BenchmarkConfig, build_result
from loadgen.metrics import DEFAULT_ATTAINMENT_TARGET, GoodputSLO
from loadgen.record import RequestRecord
from loadgen.report import load_runs, write_results
from loadgen.workload import WorkloadConfig

TARGET = DEFAULT_ATTAINMENT_TARGET
CONFIG = BenchmarkConfig(address="x:1", workload=WorkloadConfig(), slo=GoodputSLO(ttft_ms=300, tpot_ms=100))


def run(rate: float, ttfts: list[float], duration_s: float) -> dict:
    records = []
    for i, ttft in enumerate(ttfts):
        r = RequestRecord(f"r{i}", input_len=8, output_len=3, scheduled_s=i / rate)
        r.message_times_s, r.message_tokens = [ttft, ttft + 0.05, ttft + 0.1], [1, 1, 1]
        records.append(r)
    return build_result(CONFIG, rate, records, duration_s)


def test_single_run_file_has_vllm_fields_at_top_level(tmp_path):
    path = tmp_path / "one.json"
    write_results(path, [run(1.0, [0.1, 0.2], 2.0)], TARGET)
    data = json.loads(path.read_text())
    for key in ("completed", "total_input_tokens", "request_goodput", "mean_ttft_ms", "p99_e2el_ms", "duration"):
        assert key in data
    assert data["request_rate"] == 1.0 and data["goodput"] == {"ttft_ms": 300, "tpot_ms": 100}
    assert [r["ttft_ms"] for r in data["requests"]] == [100.0, 200.0]
    assert load_runs(path) == [data]


def test_a_sweeps_file_names_its_distserve_goodput_with_the_target_and_slos_it_used(tmp_path):
    path = tmp_path / "sweep.json"
    runs = [run(1.0, [0.1, 0.2], 2.0), run(2.0, [0.1, 0.5], 2.0), run(4.0, [0.5, 0.5], 2.0)]  # attain 1, 0.5, 0
    write_results(path, runs, 0.5)
    assert json.loads(path.read_text())["distserve_goodput"] == {
        "request_rate": 2.0,
        "slo_attainment_target": 0.5,
        "slo": {"ttft_ms": 300, "tpot_ms": 100},
    }
    write_results(path, runs[1:], 0.9)
    assert json.loads(path.read_text())["distserve_goodput"]["request_rate"] is None  # none met
    write_results(path, runs[:1], 0.9)
    assert "distserve_goodput" not in json.loads(path.read_text())  # one rate is no sweep
    unbounded = [build_result(replace(CONFIG, slo=GoodputSLO()), rate, [], 1.0) for rate in (1.0, 2.0)]
    write_results(path, unbounded, 0.9)
    assert "distserve_goodput" not in json.loads(path.read_text())  # no SLO to attain


def test_compare_prints_ratios_and_plots_both_sweeps(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # no cell wrapped
    a, b = tmp_path / "colocated.json", tmp_path / "disaggregated.json"
    write_results(a, [run(1.0, [0.1, 0.5], 2.0), run(2.0, [0.5, 0.5], 2.0)], TARGET)  # goodput 0.5, then 0
    write_results(b, [run(1.0, [0.1, 0.2], 2.0), run(2.0, [0.1, 0.5], 2.0)], TARGET)  # goodput 1.0, then 0.5
    assert len(load_runs(a)) == 2
    assert main(["compare", str(a), str(b), "--plot-dir", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out
    assert "Goodput, vLLM's (good req/s)" in out and "2.00x" in out
    assert "across the sweep" in out and "vLLM goodput A" in out
    # attainment A: 0.5 then 0; B: 1.0 then 0.5
    assert "DistServe goodput (highest rate with SLO attainment >= 0.9): A none met, B 1 req/s" in out
    names = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert names == ["goodput.png", "slo_attainment.png", "tpot_cdf.png", "ttft_cdf.png"]
    assert all((tmp_path / "plots" / n).stat().st_size > 10_000 for n in names)


def test_sweeps_of_different_rates_are_compared_rate_by_rate(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    same = {rate: run(rate, [0.1, 0.5], 2.0) for rate in (2.0, 4.0)}
    write_results(a, [run(1.0, [0.1, 0.2], 2.0), same[2.0], same[4.0]], TARGET)
    write_results(b, [same[2.0], same[4.0], run(8.0, [0.1, 0.2], 2.0)], TARGET)
    assert main(["compare", str(a), str(b)]) == 0
    sweep = capsys.readouterr().out.split("across the sweep")[1].splitlines()
    rows = {line.split("│")[1].strip(): line for line in sweep if line.count("│") > 3}
    assert set(rows) >= {"1 req/s", "2 req/s", "4 req/s", "8 req/s"}
    assert "1.00x" in rows["2 req/s"] and "1.00x" in rows["4 req/s"]
    assert "x" not in rows["1 req/s"].split("│")[4] and "x" not in rows["8 req/s"].split("│")[4]


def test_compare_names_a_file_that_is_not_a_result_and_exits_2(tmp_path, capsys):
    good = tmp_path / "good.json"
    write_results(good, [run(1.0, [0.1], 2.0)], TARGET)
    (tmp_path / "garbage.json").write_text("nope")
    (tmp_path / "other.json").write_text('{"x": 1}')
    for bad, says in (("garbage.json", "not a readable JSON file"), ("other.json", "not a loadgen result")):
        assert main(["compare", str(good), str(tmp_path / bad)]) == 2
        assert f"{bad}: {says}" in capsys.readouterr().err
    assert main(["compare", str(tmp_path / "absent.json"), str(good)]) == 2
    assert "absent.json: not a readable JSON file" in capsys.readouterr().err


def test_compare_reads_a_vllm_result_without_pdserve_fields(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a short name: a long temporary path wraps the table's header mid-phrase
    vllm = Path("vllm.json")
    vllm.write_text(json.dumps({"request_rate": "inf", "completed": 10, "request_goodput": 2.0}))
    assert main(["compare", str(vllm), str(vllm)]) == 0
    assert "all at once" in capsys.readouterr().out
    assert main(["compare", str(vllm), str(vllm), "--plot-dir", str(tmp_path / "plots")]) == 2
    assert "vllm.json has no per-request records" in capsys.readouterr().err


@pytest.mark.parametrize("error", [TimeoutError(), ConnectionRefusedError("nothing listens at 127.0.0.1:1")])
def test_a_sweep_cut_short_plots_the_rates_it_ran(tmp_path, capsys, monkeypatch, error):
    """The cluster gone after the first rate: the JSON kept that rate, and --plot-dir was never made."""

    def first_rate_then_gone(config, console, on_result):
        on_result([run(1.0, [0.1, 0.2], 2.0)])
        raise error

    monkeypatch.setattr(benchmark, "run_benchmark", first_rate_then_gone)
    out, plots = tmp_path / "sweep.json", tmp_path / "plots"
    argv = ["--addr", "127.0.0.1:1", "--model", "tiny-random", "--request-rate", "1,2"]
    assert main([*argv, "--result-json", str(out), "--plot-dir", str(plots)]) == 1
    assert len(load_runs(out)) == 1 and "loadgen: " in capsys.readouterr().err
    assert sorted(p.name for p in plots.iterdir()) == [
        "goodput.png",
        "slo_attainment.png",
        "tpot_cdf.png",
        "ttft_cdf.png",
    ]


def test_compare_lists_a_sweeps_rates_in_ascending_order(tmp_path, capsys, monkeypatch):
    """A sweep run as --request-rate 0.5,2,1 was listed 0.5, 2, 1."""
    monkeypatch.setenv("COLUMNS", "200")  # no cell wrapped
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    runs = [run(rate, [0.1, 0.2], 2.0) for rate in (0.5, 2.0, 1.0)]
    write_results(a, runs, TARGET)
    write_results(b, [runs[1], runs[0], runs[2], run(0.25, [0.1, 0.2], 2.0)], TARGET)
    assert main(["compare", str(a), str(b)]) == 0
    captured = capsys.readouterr()
    sweep = captured.out.split("across the sweep")[1].splitlines()
    cells = [line.split("│")[1].strip() for line in sweep if line.count("│") > 3]
    rates = [c for c in cells if c.endswith(" req/s") and c[0].isdigit()]
    assert rates == ["0.25 req/s", "0.5 req/s", "1 req/s", "2 req/s"]
    titles = [line.split("(")[1].split(")")[0] for line in captured.out.splitlines() if ") vs " in line]
    assert titles == ["0.5 req/s", "1 req/s", "2 req/s"]  # the side-by-side tables too
    assert captured.err == ""  # the same workload: no warning


def test_compare_warns_on_stderr_naming_how_the_workloads_differ(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    write_results(a, [run(1.0, [0.1, 0.2], 2.0)], TARGET)
    other = run(1.0, [0.1, 0.2], 2.0)
    other.update(backend="openai", goodput={"ttft_ms": 500, "tpot_ms": 100}, priority=5)
    for r in other["requests"]:
        r["input_len"], r["output_len"] = 16, 3
    write_results(b, [other], TARGET)
    assert main(["compare", str(a), str(b)]) == 0
    out, err = capsys.readouterr()
    assert "Goodput, vLLM's" in out
    assert err.splitlines() == [
        'loadgen compare: warning: the workloads differ, backend: A "grpc", B "openai"',
        'loadgen compare: warning: the workloads differ, goodput: A {"tpot_ms": 100, "ttft_ms": 300}, '
        'B {"tpot_ms": 100, "ttft_ms": 500}',
        "loadgen compare: warning: the workloads differ, priority: A 0, B 5",
        "loadgen compare: warning: the workloads differ, mean input length: A 8, B 16",
    ]
