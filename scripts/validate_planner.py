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
import asyncio
import itertools
import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from loadgen.benchmark import BenchmarkConfig, run_benchmark
from loadgen.metrics import GoodputSLO
from loadgen.record import OK
from loadgen.workload import WorkloadConfig
from pdserve.cluster.local_process import ClusterProcess, descendants
from pdserve.config import EngineConfig
from pdserve.planner import workload
from pdserve.planner.hardware import HardwareProfile
from pdserve.planner.plan import SLO, simulate
from pdserve.planner.profiler import Grid, run_profile
from pdserve.planner.simulator import Shape, Simulator
from pdserve.planner.workload import SimRequest
from pdserve.rpc.server import channel
from pdserve.v1 import admin_pb2, admin_pb2_grpc

CALIBRATION_REQUESTS = 24  # a few seconds: enough CPU clock ticks to count
CALIBRATION_WINDOWS = 5
QUIET_S = 3.0  # the idle cluster's own CPU use is measured over this long


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
    calibrated_goodput: float | None  # --calibrate: with what the host's calibration measured
    calibrated_ttft_p90_ms: float | None


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


def measure(
    address: str,
    load: WorkloadConfig,
    args: argparse.Namespace,
    seed: int,
    concurrency: int | None = None,
    rate: float = math.inf,  # a trace brings its own arrival times
) -> dict:
    slo = GoodputSLO(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms)
    config = BenchmarkConfig(
        address, load, args.model, request_rates=(rate,), slo=slo, seed=seed, max_concurrency=concurrency
    )
    return run_benchmark(config, Console(stderr=True))[0]


def random_load(args: argparse.Namespace, vocab: int, num_prompts: int, output_len: int) -> WorkloadConfig:
    return WorkloadConfig(
        num_prompts=num_prompts,
        vocab_size=vocab,
        random_input_len=args.input_len,
        random_output_len=output_len,
        random_range_ratio=args.range_ratio,
    )


def warm_up(address: str, args: argparse.Namespace, vocab: int, seed: int) -> None:
    """Requests of the workload's size at the highest rate (Poisson), discarded: the first requests after a
    cluster starts pay for its warm-up (allocations, the first run of each batch shape, connections), which
    no later one does; batches as large as the rows' only come at their rates."""
    measure(address, random_load(args, vocab, args.warmup, args.output_len), args, seed, rate=max(args.rates))


def cpu_clock(pids: set[int]) -> np.ndarray:
    """[CPU seconds our processes used, CPU seconds the whole host was busy, wall seconds] so far: the
    difference of two readings is a window's. Processes that exited meanwhile count nothing."""
    tick = os.sysconf("SC_CLK_TCK")
    ours = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ours += int(fields[11]) + int(fields[12])  # utime, stime
    user, nice, system, idle, iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    busy = user + nice + system + irq + softirq + steal
    return np.array([ours / tick, busy / tick, time.monotonic()])


def other_cores(use: np.ndarray) -> float:
    """The cores the host's other programs kept busy over a window of `cpu_clock`."""
    ours, host, wall = use
    return max(0.0, (host - ours) / wall)


def calibrate_host(
    profile: HardwareProfile, args: argparse.Namespace, tmp: Path, vocab: int, seeds: itertools.count
) -> HardwareProfile:
    """The profile with what only a running cluster shows, measured on a cluster of `--calibrate-on`."""
    shape = shape_of(args.calibrate_on)
    cluster = ClusterProcess(*cluster_args(shape, args), log_path=tmp / "cluster-calibration.log")
    try:
        if args.warmup:
            warm_up(cluster.address, args, vocab, next(seeds))
        return calibrate(cluster, profile, shape, args, vocab, seeds)
    finally:
        cluster.stop()


def calibrate(
    cluster: ClusterProcess,
    profile: HardwareProfile,
    shape: Shape,
    args: argparse.Namespace,
    vocab: int,
    seeds: itertools.count,
) -> HardwareProfile:
    """The profile with what only the running cluster shows. Idle for a few seconds: the CPU our processes
    use without requests (Ray, heartbeats), a background demand on the shared cores (each row adds what the
    host's other programs used while it ran). Then `CALIBRATION_WINDOWS` windows of requests of the
    workload's size one at a time to the idle cluster, each quantity the median of the windows' (a
    neighbour's burst spoils one window, not the calibration). The cores: this host's, which all share."""
    pids, roles = cluster_pids(cluster), worker_roles(cluster.address)
    before, before_workers = cpu_clock(pids), {pid: cpu_clock({pid})[0] for pid in roles}
    time.sleep(QUIET_S)
    quiet = cpu_clock(pids) - before
    idle = {pid: (cpu_clock({pid})[0] - before_workers[pid]) / quiet[2] for pid in roles}  # cores, per worker
    idle_cores = quiet[0] / quiet[2]
    windows = [
        calibration_window(cluster, profile, shape, args, vocab, next(seeds), idle_cores, idle)
        for _ in range(CALIBRATION_WINDOWS)
    ]
    return replace(
        profile,
        shared_cores=os.cpu_count() or 1,
        background_cores=idle_cores,
        **{name: statistics.median(w[name] for w in windows) for name in windows[0]},
    )


def calibration_window(
    cluster: ClusterProcess,
    profile: HardwareProfile,
    shape: Shape,
    args: argparse.Namespace,
    vocab: int,
    seed: int,
    idle_cores: float,
    idle_workers: dict[int, float],
) -> dict[str, float]:
    """One window of requests sent one at a time. Serving latency: their median TTFT less what the simulator
    predicts for each alone without one (the time spent outside every engine thread). Each worker's CPU
    beyond the engine steps the simulator predicts for it: its RPC loop's, per prompt on a prefill worker,
    per token streamed on a decode or colocated one. Serving CPU: what every other process (the router, Ray,
    loadgen: this one) used per request. Each beyond its own idle use (`idle_workers`: cores by worker pid)."""
    pids = cluster_pids(cluster)
    roles = worker_roles(cluster.address)
    before, before_workers = cpu_clock(pids), {pid: cpu_clock({pid})[0] for pid in roles}
    result = measure(cluster.address, random_load(args, vocab, CALIBRATION_REQUESTS, args.output_len), args, seed, 1)
    used, _, wall = cpu_clock(pids) - before
    workers = {role: 0.0 for role in roles.values()}
    for pid, role in roles.items():
        workers[role] += cpu_clock({pid})[0] - before_workers[pid] - idle_workers.get(pid, 0.0) * wall
    records = [r for r in result["requests"] if r["ttft_ms"]]
    alone = [Simulator(profile, shape).run([SimRequest(0.0, r["input_len"], r["output_len"])]) for r in records]
    sent = len(result["requests"]) + 1  # loadgen's check request first
    per_sent = sent / len(records)
    # Engine seconds per role, every worker of the role summed (a busy share is per worker), scaled to every
    # request sent.
    prefillers, decoders = shape.prefill or shape.colocated, shape.decode or shape.colocated
    steps = {
        "prefill": per_sent * prefillers * sum(a.prefill_busy * a.span_s for a in alone),
        "decode": per_sent * decoders * sum(a.decode_busy * a.span_s for a in alone),
    }
    tokens = per_sent * sum(r["output_len"] for r in records)
    pairs = zip(records, alone, strict=True)
    loop = {role: max(0.0, cpu - steps["decode" if role == "colocated" else role]) for role, cpu in workers.items()}
    return {
        "serving_latency_s": max(0.0, statistics.median(r["ttft_ms"] / 1e3 - a.ttft_s[0] for r, a in pairs)),
        "serving_cpu_s": max(0.0, used - sum(workers.values()) - idle_cores * wall) / sent,
        "prefill_loop_s": loop.get("prefill", 0.0) / sent,
        "decode_loop_per_token_s": (loop.get("decode", 0.0) + loop.get("colocated", 0.0)) / tokens,
    }


def worker_roles(address: str) -> dict[int, str]:
    """pid -> role of every worker, as the router's Admin view reports them."""

    async def ask() -> list[admin_pb2.WorkerStatus]:
        async with channel(address) as ch:
            reply = await admin_pb2_grpc.AdminStub(ch).ClusterStatus(admin_pb2.ClusterStatusRequest(), timeout=10)
        return list(reply.workers)

    return {w.pid: w.role for w in asyncio.run(ask()) if w.pid}


def cluster_pids(cluster: ClusterProcess) -> set[int]:
    """The launcher, Ray and the workers below it, and this process (loadgen): what serves the requests."""
    return descendants(cluster.proc.pid) | {cluster.proc.pid, os.getpid()}


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
            others = other_cores(cpu_clock(pids) - before)
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
                    cal.goodput if cal else None,
                    cal.ttft_ms[1] if cal else None,
                )
            )
    finally:
        cluster.stop()
    return rows


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
        for col in ("goodput cal", "err", "p90 TTFT cal ms", "err"):
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
        ttft = [
            r.calibrated_ttft_p90_ms if r.calibrated_ttft_p90_ms is not None else r.predicted_ttft_p90_ms
            for r in replays
        ]
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


def calibration_table(p: HardwareProfile, on: str) -> Table:
    t = Table(title=f"what --calibrate measured on this host ({on} cluster, median of {CALIBRATION_WINDOWS} windows)")
    for col in ("serving latency", "prefill loop per prompt", "decode loop per token", "CPU per request", "idle"):
        t.add_column(col, justify="right")
    t.add_row(
        f"{p.serving_latency_s * 1e3:.1f} ms",
        f"{p.prefill_loop_s * 1e3:.1f} ms",
        f"{p.decode_loop_per_token_s * 1e3:.2f} ms",
        f"{p.serving_cpu_s * 1e3:.0f} ms",
        f"{p.background_cores:.2f} cores of {p.shared_cores}",
    )
    return t


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
    args = p.parse_args()
    args.rates = [float(r) for r in args.rates.split(",")]
    console = Console(width=200)  # the whole table, also in a pipe
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
    if args.json:
        calibration = calibrated.to_dict() if calibrated else None
        args.json.write_text(json.dumps({"calibration": calibration, "rows": [r.__dict__ for r in rows]}, indent=1))


if __name__ == "__main__":
    main()
