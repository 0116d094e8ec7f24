"""The planner's simulator against a real local cluster: predicted vs measured goodput and p90 TTFT.

Usage (from the repository root, PYTHONPATH=src:.):
    python scripts/validate_planner.py --model tiny-random --configs 1:1,2:1,1:2 --rates 4,10 \
        --num-requests 40 --input-len 1024 --output-len 32 --slo-ttft-ms 500 --slo-tpot-ms 50

It profiles one worker (`pdserve profile`'s code, with the torch threads each worker of the cluster gets: on
2 cores with 2-3 workers, 1) unless given --profile, then for each configuration starts
`pdserve up` (P:D disaggregated, or cN for N colocated workers), warms it up with requests of the workload's
size (discarded), and for each rate (--repeat times) writes one Mooncake trace, replays it with loadgen and
simulates the same trace: the same requests at the same times on both sides. Every replay draws its own
prompt ids (the seed moves on): the same prompts again would hit the workers' prefix caches, which the
simulator does not model. The router's default SLOs are raised so admission sheds nothing (the simulator
models no shedding). Each row carries the machine's 1-minute load average when it ended.

--calibrate measures what the profile cannot see once per host, on its own 1P:1D cluster (`--calibrate-on`)
before the configurations, and predicts every configuration with it: the serving latency and each role's RPC
loop belong to the serving stack on this host, not to a split, and one cluster's few windows measure them
more steadily than each cluster's own would (per cluster they came out 8-33 ms of latency on identical code).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from planner_calibration import (
    calibrate_host,
    calibration_table,
    cluster_pids,
    cpu_clock,
    other_cores,
)
from planner_load import cluster_args, measure, shape_of, warm_up, write_trace
from rich.console import Console
from rich.table import Table

from loadgen.record import OK
from loadgen.workload import WorkloadConfig
from pdserve.cluster.local_process import ClusterProcess
from pdserve.config import EngineConfig
from pdserve.planner import workload
from pdserve.planner.hardware import HardwareProfile
from pdserve.planner.plan import SLO, simulate
from pdserve.planner.profiler import Grid, run_profile


@dataclass(frozen=True)
class Row:
    config: str
    rate: float
    load_average: float  # the machine's, over the minute before the row ended
    other_cores: float  # what the host's other programs kept busy while the row ran
    predicted_goodput: float
    measured_goodput: float
    predicted_ttft_p90_ms: float
    measured_ttft_p90_ms: float
    measured_failed: int
    measured_cores: float  # what our processes (cluster, loadgen) kept busy while the row ran
    calibrated_goodput: float | None  # --calibrate: with what the host's calibration measured
    calibrated_ttft_p90_ms: float | None
    calibrated_cores: float | None  # the simulated demand on the shared cores, less the other programs'


def run_config(
    config: str,
    profile: HardwareProfile,
    calibrated: HardwareProfile | None,
    args: argparse.Namespace,
    tmp: Path,
    vocab: int,
    seeds: itertools.count,
) -> list[Row]:
    shape = shape_of(config)
    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms)
    load = workload.synthetic(1.0, args.input_len, args.output_len, args.num_requests, args.range_ratio, 1, args.seed)
    cluster = ClusterProcess(*cluster_args(shape, args), log_path=tmp / f"cluster-{config.replace(':', '-')}.log")
    rows = []
    try:
        if args.warmup:
            warm_up(cluster.address, args, vocab, next(seeds))
        for rate in [r for r in args.rates for _ in range(args.repeat)]:
            trace = tmp / f"trace-{config.replace(':', '-')}-{rate:g}.jsonl"
            write_trace(trace, load, rate)
            replayed = workload.from_trace(trace)  # what loadgen replays, timestamps rounded as written
            predicted = simulate(profile, shape, replayed, replayed.rate, slo)
            trace_load = WorkloadConfig("trace", args.num_requests, vocab, trace=trace)
            pids = cluster_pids(cluster)
            before = cpu_clock(pids)
            measured = measure(cluster.address, trace_load, args, next(seeds))
            used = cpu_clock(pids) - before
            others = other_cores(used)
            cal = None
            if calibrated:  # with the other programs' demand as it was during this row
                busy_host = replace(calibrated, background_cores=calibrated.background_cores + others)
                cal = simulate(busy_host, shape, replayed, replayed.rate, slo)
            rows.append(
                Row(
                    config,
                    rate,
                    os.getloadavg()[0],
                    others,
                    predicted.goodput,
                    measured["request_goodput"],
                    predicted.ttft_ms[1],
                    measured["p90_ttft_ms"],
                    sum(r["status"] != OK for r in measured["requests"]),
                    used[0] / used[2],
                    cal.goodput if cal else None,
                    cal.ttft_ms[1] if cal else None,
                    cal.demand_cores - others if cal else None,
                )
            )
    finally:
        cluster.stop()
    return rows


def resimulated(rows: list[Row], calibration: HardwareProfile, args: argparse.Namespace) -> list[Row]:
    """`rows` with their calibrated predictions made again by this checkout's simulator, on the same traces (the
    workload flags and seed must be the run's) and the same host load per row: what a simulator change does to
    the agreement with what was measured, without measuring again."""
    load = workload.synthetic(1.0, args.input_len, args.output_len, args.num_requests, args.range_ratio, 1, args.seed)
    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms)
    again = []
    with tempfile.TemporaryDirectory(prefix="validate-planner-") as tmp:
        trace = Path(tmp) / "trace.jsonl"
        for row in rows:
            write_trace(trace, load, row.rate)
            replayed = workload.from_trace(trace)
            busy = replace(calibration, background_cores=calibration.background_cores + row.other_cores)
            cal = simulate(busy, shape_of(row.config), replayed, replayed.rate, slo)
            cores = cal.demand_cores - row.other_cores
            again.append(
                replace(
                    row, calibrated_goodput=cal.goodput, calibrated_ttft_p90_ms=cal.ttft_ms[1], calibrated_cores=cores
                )
            )
    return again


def error(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured:+.0%}" if measured else "n/a"


def table(rows: list[Row], args: argparse.Namespace) -> Table:
    """Every replay: the prediction (profile only, and calibrated) against what it measured."""
    t = Table(
        title=f"planner: predicted vs measured ({args.model}, {args.num_requests} requests of {args.input_len} in / "
        f"{args.output_len} out; SLO TTFT {args.slo_ttft_ms:g} ms, TPOT {args.slo_tpot_ms:g} ms)"
    )
    columns = ("config", "rate", "load", "others", "goodput pred", "goodput meas", "err", "p90 TTFT pred ms")
    for col in (*columns, "meas ms", "err"):
        t.add_column(col, justify="right")
    if args.calibrate:
        for col in ("goodput cal", "err", "p90 TTFT cal ms", "err", "cores cal/meas"):
            t.add_column(col, justify="right")
    for r in rows:
        cells = [
            r.config,
            f"{r.rate:g}",
            f"{r.load_average:.1f}",
            f"{r.other_cores:.2f}",
            f"{r.predicted_goodput:.2f}",
            f"{r.measured_goodput:.2f}",
            error(r.predicted_goodput, r.measured_goodput),
            f"{r.predicted_ttft_p90_ms:.0f}",
            f"{r.measured_ttft_p90_ms:.0f}",
            error(r.predicted_ttft_p90_ms, r.measured_ttft_p90_ms),
        ]
        if r.calibrated_goodput is not None and r.calibrated_ttft_p90_ms is not None:
            cells += [
                f"{r.calibrated_goodput:.2f}",
                error(r.calibrated_goodput, r.measured_goodput),
                f"{r.calibrated_ttft_p90_ms:.0f}",
                error(r.calibrated_ttft_p90_ms, r.measured_ttft_p90_ms),
                f"{r.calibrated_cores:.2f}/{r.measured_cores:.2f}",
            ]
        t.add_row(*cells)
    return t


def summary(rows: list[Row]) -> Table:
    """Per configuration and rate, the mean of its replays: one replay's p90 is a sample (replays of the same
    trace on the same cluster differ by up to a third), the mean is what a prediction can be held to."""
    t = Table(title="per configuration and rate: the mean of the replays")
    for col in (
        "config",
        "rate",
        "replays",
        "goodput pred",
        "meas",
        "err",
        "p90 TTFT pred ms",
        "meas ms",
        "range",
        "err",
    ):
        t.add_column(col, justify="right")
    for (config, rate), group in itertools.groupby(rows, key=lambda r: (r.config, r.rate)):
        replays = list(group)
        goodput = [r.calibrated_goodput if r.calibrated_goodput is not None else r.predicted_goodput for r in replays]
        ttft = [_predicted_ttft(r) for r in replays]
        measured_goodput = statistics.mean(r.measured_goodput for r in replays)
        measured_ttft = [r.measured_ttft_p90_ms for r in replays]
        t.add_row(
            config,
            f"{rate:g}",
            str(len(replays)),
            f"{statistics.mean(goodput):.2f}",
            f"{measured_goodput:.2f}",
            error(statistics.mean(goodput), measured_goodput),
            f"{statistics.mean(ttft):.0f}",
            f"{statistics.mean(measured_ttft):.0f}",
            f"{min(measured_ttft):.0f}-{max(measured_ttft):.0f}",
            error(statistics.mean(ttft), statistics.mean(measured_ttft)),
        )
    return t


def ranking(rows: list[Row]) -> Table:
    """Per rate, the splits ordered by p90 TTFT (the mean of their replays), predicted and measured: what a
    planner chooses by is the order, which can be right where the level is not."""
    t = Table(title="per rate: the splits from lowest to highest p90 TTFT")
    for col in ("rate", "predicted", "measured", "same best", "same order"):
        t.add_column(col, justify="right")
    for rate in sorted({r.rate for r in rows}):
        by_config: dict[str, list[Row]] = {}
        for r in rows:
            if r.rate == rate:
                by_config.setdefault(r.config, []).append(r)
        predicted = sorted(by_config, key=lambda c: statistics.mean(_predicted_ttft(r) for r in by_config[c]))
        measured = sorted(by_config, key=lambda c: statistics.mean(r.measured_ttft_p90_ms for r in by_config[c]))
        same_best, same_order = predicted[0] == measured[0], predicted == measured
        t.add_row(f"{rate:g}", " < ".join(predicted), " < ".join(measured), _yes(same_best), _yes(same_order))
    return t


def _predicted_ttft(r: Row) -> float:
    return r.calibrated_ttft_p90_ms if r.calibrated_ttft_p90_ms is not None else r.predicted_ttft_p90_ms


def _yes(b: bool) -> str:
    return "yes" if b else "no"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--profile", type=Path, help="an existing profile (default: measure one first)")
    p.add_argument("--configs", default="1:1,2:1,1:2", help="P:D splits, or cN for N colocated workers")
    p.add_argument("--rates", default="2,6", help="requests per second, each run on every config")
    p.add_argument("--num-requests", type=int, default=150)
    p.add_argument("--repeat", type=int, default=1, help="runs of each rate on the same cluster (the spread)")
    p.add_argument("--warmup", type=int, default=48, help="requests sent and discarded before measuring")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--range-ratio", type=float, default=0.5)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=200.0)
    p.add_argument("--kv-cache-gb", type=float, default=0.25)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the profile: what each worker gets")
    p.add_argument(
        "--save-profile", type=Path, help="write the profile the predictions used here (calibrated with --calibrate)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the calibration and the rows here")
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="also predict with what a running cluster shows: serving latency, RPC loops, the host's cores",
    )
    p.add_argument("--calibrate-on", default="1:1", help="the configuration --calibrate measures on")
    p.add_argument("--report", type=Path, help="run nothing: the summaries of an earlier run's --json file")
    p.add_argument(
        "--resimulate",
        action="store_true",
        help="with --report: predict its rows again with this checkout's simulator (give the run's workload flags)",
    )
    args = p.parse_args()
    args.rates = [float(r) for r in args.rates.split(",")]
    console = Console(width=200)  # the whole table, also in a pipe
    if args.report:
        no_cores = {"measured_cores": math.nan, "calibrated_cores": None}  # files from before the CPU columns
        saved_run = json.loads(args.report.read_text())
        saved = [Row(**(no_cores | r)) for r in saved_run["rows"]]
        if args.resimulate:
            saved = resimulated(saved, HardwareProfile.from_dict(saved_run["calibration"]), args)
        console.print(summary(saved))
        console.print(ranking(saved))
        return
    if args.profile:
        profile = HardwareProfile.load(args.profile)
    else:
        engine = EngineConfig(model=args.model, kv_cache_memory_gb=args.kv_cache_gb, num_threads=args.threads)
        profile = run_profile(engine, Grid())
    from pdserve.engine.model_files import read_model_config
    from pdserve.engine.models import resolve_model

    vocab = read_model_config(resolve_model(args.model)).vocab_size
    rows: list[Row] = []
    seeds = itertools.count(args.seed)  # one per loadgen run: no prompt is sent twice
    with tempfile.TemporaryDirectory(prefix="validate-planner-") as tmp:
        calibrated = calibrate_host(profile, args, Path(tmp), vocab, seeds) if args.calibrate else None
        if calibrated:
            console.print(calibration_table(calibrated, args.calibrate_on))
        if args.save_profile:
            (calibrated or profile).save(args.save_profile)
        for config in args.configs.split(","):
            rows += run_config(config, profile, calibrated, args, Path(tmp), vocab, seeds)
            console.print(table(rows, args))
    console.print(summary(rows))
    console.print(ranking(rows))
    if args.json:
        calibration = calibrated.to_dict() if calibrated else None
        args.json.write_text(json.dumps({"calibration": calibration, "rows": [r.__dict__ for r in rows]}, indent=1))


if __name__ == "__main__":
    main()
