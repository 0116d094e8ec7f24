"""loadgen against a real `tiny-random` cluster: what was sent is what is counted, the statistics are those of
the per-request records, and requests leave at the asked rate."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from loadgen.__main__ import main
from loadgen.arrivals import arrival_offsets
from loadgen.benchmark import ARRIVALS_STREAM, PROMPTS_STREAM
from loadgen.report import load_runs
from loadgen.workload import WorkloadConfig, build_workload
from pdserve.cluster.local_process import ClusterProcess

pytestmark = pytest.mark.timeout(180)
VOCAB = 259  # tiny-random


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    log = tmp_path_factory.mktemp("loadgen") / "cluster.log"
    args = ["--model", "tiny-random", "--kv-cache-gb", "0.05", "--mode", "disaggregated", "--prefill", "1"]
    proc = ClusterProcess(*args, "--decode", "1", log_path=log)
    yield proc
    proc.stop()


def loadgen(cluster, tmp_path, *flags: str) -> list[dict]:
    path = tmp_path / "result.json"
    assert main(["--addr", cluster.address, "--model", "tiny-random", "--result-json", str(path), *flags]) == 0
    return load_runs(path)


def first_token_ms(r: dict) -> float:
    return next(t for t, n in zip(r["message_times_ms"], r["message_tokens"], strict=True) if n)


def itls_ms(r: dict) -> list[float]:
    """vLLM's: one gap per streamed message that carries tokens, after the first."""
    times = [t for t, n in zip(r["message_times_ms"], r["message_tokens"], strict=True) if n]
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def test_poisson_run_counts_statistics_and_arrivals(cluster, tmp_path):
    n, rate, seed = 120, 40.0, 11
    flags = ["--num-prompts", str(n), "--random-input-len", "48", "--random-output-len", "12"]
    flags += ["--random-range-ratio", "0.5", "--request-rate", str(rate), "--seed", str(seed)]
    (run,) = loadgen(cluster, tmp_path, *flags, "--goodput", "ttft:1000", "tpot:200", "e2el:3000")
    records = run["requests"]

    # What was sent: the workload that (seed, run 0) draws, then its arrivals from the seed's own generator for them.
    config = WorkloadConfig(
        num_prompts=n, vocab_size=VOCAB, random_input_len=48, random_output_len=12, random_range_ratio=0.5
    )
    sent = build_workload(config, np.random.default_rng([seed, PROMPTS_STREAM, 0]))
    planned = arrival_offsets(n, rate, 1.0, np.random.default_rng([seed, ARRIVALS_STREAM]))
    assert [r["input_len"] for r in records] == [s.input_len for s in sent]
    assert [r["output_len"] for r in records] == [s.output_len for s in sent]
    assert [r["scheduled_ms"] / 1e3 for r in records] == pytest.approx(planned.tolist())

    # Counts: every request completed with exactly the tokens asked (ignore_eos).
    assert (run["completed"], run["rejected"], run["failed"]) == (n, 0, 0)
    assert all(r["status"] == "OK" and r["output_tokens"] == r["output_len"] for r in records)
    assert run["total_input_tokens"] == sum(s.input_len for s in sent)
    assert run["total_output_tokens"] == sum(s.output_len for s in sent)

    # The summary is the statistics of the per-request records, recomputed here from the raw message times.
    ttft = np.array([first_token_ms(r) for r in records])
    e2el = np.array([r["message_times_ms"][-1] for r in records])
    tpot = np.array([(e - t) / (r["output_tokens"] - 1) for r, t, e in zip(records, ttft, e2el, strict=True)])
    itl = np.array([gap for r in records for gap in itls_ms(r)])
    assert len(itl) == sum(sum(1 for n in r["message_tokens"] if n) - 1 for r in records)
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        assert run[f"mean_{name}_ms"] == pytest.approx(values.mean())
        assert run[f"median_{name}_ms"] == pytest.approx(np.median(values))
        assert run[f"std_{name}_ms"] == pytest.approx(values.std())
        for p in (90, 99):
            assert run[f"p{p}_{name}_ms"] == pytest.approx(np.percentile(values, p))
    good = (ttft <= 1000) & (tpot <= 200) & (e2el <= 3000)
    assert [r["good"] for r in records] == good.tolist()
    assert run["request_goodput"] == pytest.approx(good.sum() / run["duration"])
    assert run["slo_attainment"] == pytest.approx(good.mean())
    assert run["request_throughput"] == pytest.approx(n / run["duration"])
    assert run["output_throughput"] == pytest.approx(run["total_output_tokens"] / run["duration"])

    # Arrivals: Poisson at the asked rate as scheduled, and sent on schedule. The distribution is judged on the
    # schedule: on a loaded host the client's send jitter reshapes the shortest gaps (a CI run's KS test failed on
    # the measured starts of a schedule whose own statistic was a quarter of the bound).
    starts = np.array([r["start_ms"] for r in records]) / 1e3
    assert np.median(np.abs(starts - planned)) < 0.01
    gaps = np.sort(np.diff(np.sort(np.array([r["scheduled_ms"] for r in records]) / 1e3)))
    assert abs(gaps.mean() * rate - 1) < 3.5 / math.sqrt(len(gaps))
    ks = np.max(np.abs(np.arange(1, len(gaps) + 1) / len(gaps) - (1 - np.exp(-rate * gaps))))
    assert ks < 1.63 / math.sqrt(len(gaps))  # Kolmogorov-Smirnov against the exponential, 1% level


def test_sweep_writes_each_rate_plots_and_compares(cluster, tmp_path, capsys):
    flags = ["--num-prompts", "24", "--random-input-len", "16", "--random-output-len", "4", "--goodput", "tpot:500"]
    runs = loadgen(cluster, tmp_path, *flags, "--request-rate", "20,inf", "--plot-dir", str(tmp_path / "plots"))
    assert [r["request_rate"] for r in runs] == [20.0, "inf"]
    assert [r["completed"] for r in runs] == [24, 24]
    assert max(r["start_ms"] for r in runs[1]["requests"]) < 500  # all at once
    names = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert names == ["goodput.png", "slo_attainment.png", "tpot_cdf.png", "ttft_cdf.png"]
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "result.json"), str(tmp_path / "result.json")]) == 0
    assert "1.00x" in capsys.readouterr().out


def test_max_concurrency_bounds_requests_in_flight(cluster, tmp_path):
    flags = ["--num-prompts", "12", "--random-input-len", "16", "--random-output-len", "16", "--max-concurrency", "2"]
    (run,) = loadgen(cluster, tmp_path, *flags)
    spans = [(r["start_ms"], r["start_ms"] + r["message_times_ms"][-1]) for r in run["requests"]]
    assert run["completed"] == 12
    assert max(sum(s <= t < e for s, e in spans) for t, _ in spans) <= 2


@pytest.mark.parametrize("dataset", ["sharegpt-synthetic", "prefix-repetition"])
def test_other_datasets_send_what_they_draw(cluster, tmp_path, dataset):
    flags = ["--dataset-name", dataset, "--num-prompts", "6", "--prefix-repetition-num-prefixes", "2"]
    flags += ["--prefix-repetition-prefix-len", "64", "--prefix-repetition-suffix-len", "8"]
    (run,) = loadgen(cluster, tmp_path, *flags, "--prefix-repetition-output-len", "8", "--seed", "3")
    config = WorkloadConfig(
        dataset, num_prompts=6, vocab_size=VOCAB, prefix_len=64, suffix_len=8, num_prefixes=2, prefix_output_len=8
    )
    sent = build_workload(config, np.random.default_rng([3, 0]))
    assert run["completed"] == 6
    assert run["total_input_tokens"] == sum(s.input_len for s in sent)
    assert run["total_output_tokens"] == sum(s.output_len for s in sent)


def test_trace_replays_its_timestamps(cluster, tmp_path):
    trace = tmp_path / "trace.jsonl"
    stamps = [5000, 5100, 5150, 5600, 6000, 6020]
    lines = [
        {"timestamp": t, "input_length": 40 + i, "output_length": 3 + i, "hash_ids": [0, i % 2]}
        for i, t in enumerate(stamps)
    ]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    (run,) = loadgen(cluster, tmp_path, "--dataset-name", "trace", "--trace", str(trace))
    starts = [r["start_ms"] for r in run["requests"]]
    assert starts == pytest.approx([t - 5000 for t in stamps], abs=60)
    assert run["completed"] == 6
    assert (run["request_rate"], run["burstiness"]) == (pytest.approx(5 / 1.02), None)  # its gaps per second
    assert run["total_input_tokens"] == sum(line["input_length"] for line in lines)
    assert run["total_output_tokens"] == sum(line["output_length"] for line in lines)


def test_requests_shed_by_admission_are_counted_as_rejected(tmp_path):
    """A prefill queue bound below two prompts: of ten sent at once, the first fits alone in the empty queue and
    the ones arriving behind it are shed."""
    args = ["--model", "tiny-random", "--kv-cache-gb", "0.05", "--prefill", "1", "--decode", "1"]
    proc = ClusterProcess(*args, "--max-queued-prefill-tokens", "40", log_path=tmp_path / "cluster.log")
    try:
        (run,) = loadgen(proc, tmp_path, "--num-prompts", "10", "--random-input-len", "32", "--random-output-len", "4")
    finally:
        proc.stop()
    assert run["failed"] == run["rejected"] >= 1 and run["completed"] >= 1
    assert run["completed"] + run["rejected"] == 10
    statuses = {r["status"] for r in run["requests"]}
    assert "RESOURCE_EXHAUSTED" in statuses and statuses <= {"OK", "RESOURCE_EXHAUSTED"}


def test_an_slo_no_worker_can_meet_stops_the_run_with_the_reason(cluster, tmp_path, capsys):
    # A 1 µs TTFT bound sent with each request: no retry can meet it, so the check request is INVALID_ARGUMENT (exit 2).
    flags = ["--num-prompts", "2", "--random-input-len", "32", "--random-output-len", "4", "--send-slo"]
    path = tmp_path / "result.json"
    code = main(
        [
            "--addr",
            cluster.address,
            "--model",
            "tiny-random",
            "--result-json",
            str(path),
            *flags,
            "--goodput",
            "ttft:0.001",
        ]
    )
    assert code == 2 and not path.exists()
    err = capsys.readouterr().err
    assert "INVALID_ARGUMENT" in err and "slo.ttft_ms" in err and "smallest" in err
