"""The planner's simulator against a real local cluster: predicted vs measured goodput and p90 TTFT.

Usage (from the repository root, PYTHONPATH=src:.):
    python scripts/validate_planner.py --model tiny-random --configs 1:1,2:1,1:2 --rates 4,10 \
        --num-requests 40 --input-len 1024 --output-len 32 --slo-ttft-ms 500 --slo-tpot-ms 50

It profiles one worker (`pdserve profile`'s code, with the torch threads each worker of the cluster gets: on
2 cores with 2-3 workers, 1) unless given --profile, then for each configuration starts
`pdserve up` (P:D disaggregated, or cN for N colocated workers) and, for each rate, writes one Mooncake trace,
replays it with loadgen and simulates the same trace: the same requests at the same times on both sides.
The router's default SLOs are raised so admission sheds nothing (the simulator models no shedding).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from loadgen.benchmark import BenchmarkConfig, run_benchmark
from loadgen.metrics import GoodputSLO
from loadgen.record import OK
from loadgen.workload import WorkloadConfig
from pdserve.cluster.local_process import ClusterProcess
from pdserve.config import EngineConfig
from pdserve.planner import workload
from pdserve.planner.hardware import HardwareProfile
from pdserve.planner.plan import SLO, simulate
from pdserve.planner.profiler import Grid, run_profile
from pdserve.planner.simulator import Shape

CALIBRATION_REQUESTS = 6


@dataclass(frozen=True)
class Row:
    config: str
    rate: float
    predicted_goodput: float
    measured_goodput: float
    predicted_ttft_p90_ms: float
    measured_ttft_p90_ms: float
    measured_failed: int
    calibrated_goodput: float | None  # --calibrate: with the per-request overhead measured on this cluster
    calibrated_ttft_p90_ms: float | None
    overhead_ms: float | None


def shape_of(config: str) -> Shape:
    if config.startswith("c"):
        return Shape(colocated=int(config[1:]))
    p, d = config.split(":")
    return Shape(prefill=int(p), decode=int(d))


def cluster_args(shape: Shape, args: argparse.Namespace) -> list[str]:
    roles = (
        ["--mode", "colocated", "--workers", str(shape.colocated)]
        if shape.colocated
        else ["--prefill", str(shape.prefill), "--decode", str(shape.decode)]
    )
    no_shedding = ["--default-ttft-ms", "1e7", "--default-tpot-ms", "1e7"]
    return ["--model", args.model, "--kv-cache-gb", str(args.kv_cache_gb), *roles, *no_shedding]


def write_trace(path: Path, load: workload.Workload, rate: float) -> None:
    lines = [
        {"timestamp": r.arrival_s * 1e3, "input_length": r.input_len, "output_length": r.output_len}
        for r in load.at_rate(rate)
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines))


def measure(address: str, load: WorkloadConfig, args: argparse.Namespace, concurrency: int | None = None) -> dict:
    slo = GoodputSLO(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms)
    config = BenchmarkConfig(address, load, args.model, slo=slo, seed=args.seed, max_concurrency=concurrency)
    return run_benchmark(config, Console(stderr=True))[0]


def overhead_s(address: str, profile: HardwareProfile, args: argparse.Namespace, vocab: int) -> float:
    """A request's TTFT on the idle cluster (one at a time) less its profiled prefill: the serving cost."""
    load = WorkloadConfig(
        num_prompts=CALIBRATION_REQUESTS,
        vocab_size=vocab,
        random_input_len=args.input_len,
        random_output_len=2,
        random_range_ratio=args.range_ratio,
    )
    records = measure(address, load, args, concurrency=1)["requests"]
    gaps = [r["ttft_ms"] / 1e3 - profile.perf.prefill_s(r["input_len"]) for r in records if r["ttft_ms"]]
    return max(0.0, statistics.median(gaps))


def run_config(config: str, profile: HardwareProfile, args: argparse.Namespace, tmp: Path, vocab: int) -> list[Row]:
    shape = shape_of(config)
    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms)
    load = workload.synthetic(1.0, args.input_len, args.output_len, args.num_requests, args.range_ratio, 1, args.seed)
    cluster = ClusterProcess(*cluster_args(shape, args), log_path=tmp / f"cluster-{config.replace(':', '-')}.log")
    rows = []
    try:
        overhead = overhead_s(cluster.address, profile, args, vocab) if args.calibrate else None
        calibrated = replace(profile, request_overhead_s=overhead or 0.0)
        for rate in args.rates:
            trace = tmp / f"trace-{config.replace(':', '-')}-{rate:g}.jsonl"
            write_trace(trace, load, rate)
            replayed = workload.from_trace(trace)  # what loadgen replays, timestamps rounded as written
            predicted = simulate(profile, shape, replayed, replayed.rate, slo)
            cal = simulate(calibrated, shape, replayed, replayed.rate, slo) if args.calibrate else None
            trace_load = WorkloadConfig("trace", args.num_requests, vocab, trace=trace)
            measured = measure(cluster.address, trace_load, args)
            rows.append(
                Row(
                    config,
                    rate,
                    predicted.goodput,
                    measured["request_goodput"],
                    predicted.ttft_ms[1],
                    measured["p90_ttft_ms"],
                    sum(r["status"] != OK for r in measured["requests"]),
                    cal.goodput if cal else None,
                    cal.ttft_ms[1] if cal else None,
                    overhead * 1e3 if overhead is not None else None,
                )
            )
    finally:
        cluster.stop()
    return rows


def error(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured:+.0%}" if measured else "n/a"


def table(rows: list[Row], args: argparse.Namespace) -> Table:
    t = Table(
        title=f"planner: predicted vs measured ({args.model}, {args.num_requests} requests of {args.input_len} in / "
        f"{args.output_len} out; SLO TTFT {args.slo_ttft_ms:g} ms, TPOT {args.slo_tpot_ms:g} ms)"
    )
    for col in ("config", "rate", "goodput pred", "goodput meas", "err", "p90 TTFT pred ms", "meas ms", "err"):
        t.add_column(col, justify="right")
    if args.calibrate:
        for col in ("overhead ms", "goodput cal", "err", "p90 TTFT cal ms", "err"):
            t.add_column(col, justify="right")
    for r in rows:
        cells = [
            r.config,
            f"{r.rate:g}",
            f"{r.predicted_goodput:.2f}",
            f"{r.measured_goodput:.2f}",
            error(r.predicted_goodput, r.measured_goodput),
            f"{r.predicted_ttft_p90_ms:.0f}",
            f"{r.measured_ttft_p90_ms:.0f}",
            error(r.predicted_ttft_p90_ms, r.measured_ttft_p90_ms),
        ]
        if r.calibrated_goodput is not None and r.calibrated_ttft_p90_ms is not None:
            cells += [
                f"{r.overhead_ms:.0f}",
                f"{r.calibrated_goodput:.2f}",
                error(r.calibrated_goodput, r.measured_goodput),
                f"{r.calibrated_ttft_p90_ms:.0f}",
                error(r.calibrated_ttft_p90_ms, r.measured_ttft_p90_ms),
            ]
        t.add_row(*cells)
    return t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--profile", type=Path, help="an existing profile (default: measure one first)")
    p.add_argument("--configs", default="1:1,2:1,1:2", help="P:D splits, or cN for N colocated workers")
    p.add_argument("--rates", default="2,6", help="requests per second, each run on every config")
    p.add_argument("--num-requests", type=int, default=40)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--range-ratio", type=float, default=0.5)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=200.0)
    p.add_argument("--kv-cache-gb", type=float, default=0.25)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the profile: what each worker gets")
    p.add_argument("--save-profile", type=Path, help="write the measured profile here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the rows here")
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="also predict with a per-request serving overhead measured on each cluster (requests one at a time)",
    )
    args = p.parse_args()
    args.rates = [float(r) for r in args.rates.split(",")]
    console = Console(width=200)  # the whole table, also in a pipe
    if args.profile:
        profile = HardwareProfile.load(args.profile)
    else:
        engine = EngineConfig(model=args.model, kv_cache_memory_gb=args.kv_cache_gb, num_threads=args.threads)
        profile = run_profile(engine, Grid())
        if args.save_profile:
            profile.save(args.save_profile)
    from pdserve.engine.model_files import read_model_config
    from pdserve.engine.models import resolve_model

    vocab = read_model_config(resolve_model(args.model)).vocab_size
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="validate-planner-") as tmp:
        for config in args.configs.split(","):
            rows += run_config(config, profile, args, Path(tmp), vocab)
            console.print(table(rows, args))
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in rows], indent=1))


if __name__ == "__main__":
    main()
