"""What only a running cluster shows the planner's simulator, measured on a local `pdserve up`: the serving
latency, each role's RPC-loop CPU beyond its engine steps, the serving stack's CPU per request, the idle
cluster's CPU and the host's cores (scripts/validate_planner.py --calibrate)."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from planner_load import cluster_args, measure, random_load, shape_of, warm_up
from rich.table import Table

from pdserve.cluster.local_process import ClusterProcess, descendants
from pdserve.planner.hardware import HardwareProfile
from pdserve.planner.serving_latency import describe, spread
from pdserve.planner.shape import Shape
from pdserve.planner.simulator import Simulator
from pdserve.planner.workload import SimRequest
from pdserve.rpc.server import channel
from pdserve.v1 import admin_pb2, admin_pb2_grpc

CALIBRATION_REQUESTS = 24  # a few seconds: enough CPU clock ticks to count
CALIBRATION_WINDOWS = 5
CALIBRATION_RATE = 2.0  # requests a second, one at a time: each finds the cluster idle, its threads asleep
QUIET_S = 3.0  # the idle cluster's own CPU use is measured over this long


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
    neighbour's burst spoils one window, not the calibration), and the spread of every window's serving latency
    residuals. The cores: this host's, which all share."""
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
        serving_latency_quantiles_s=spread([r for _, residuals in windows for r in residuals]),
        **{name: statistics.median(w[name] for w, _ in windows) for name in windows[0][0]},
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
) -> tuple[dict[str, float], list[float]]:
    """One window of requests sent one at a time, and its serving latency residuals: each one's TTFT less what
    the simulator predicts for it alone without one (the time spent outside every engine thread). Serving
    latency: their median. Each worker's CPU beyond the engine steps the simulator predicts for it: its RPC
    loop's, per prompt on a prefill worker, per token streamed on a decode or colocated one. Serving CPU: what
    every other process (the router, Ray, loadgen: this one) used per request. Each beyond its own idle use
    (`idle_workers`: cores by worker pid)."""
    pids = cluster_pids(cluster)
    roles = worker_roles(cluster.address)
    before, before_workers = cpu_clock(pids), {pid: cpu_clock({pid})[0] for pid in roles}
    load = random_load(args, vocab, CALIBRATION_REQUESTS, args.output_len)
    result = measure(cluster.address, load, args, seed, 1, rate=CALIBRATION_RATE)
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
    residuals = [r["ttft_ms"] / 1e3 - a.ttft_s[0] for r, a in zip(records, alone, strict=True)]
    loop = {role: max(0.0, cpu - steps["decode" if role == "colocated" else role]) for role, cpu in workers.items()}
    return {
        "serving_latency_s": max(0.0, statistics.median(residuals)),
        "serving_cpu_s": max(0.0, used - sum(workers.values()) - idle_cores * wall) / sent,
        "prefill_loop_s": loop.get("prefill", 0.0) / sent,
        "decode_loop_per_token_s": (loop.get("decode", 0.0) + loop.get("colocated", 0.0)) / tokens,
    }, residuals


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


def calibration_table(p: HardwareProfile, on: str) -> Table:
    t = Table(title=f"what --calibrate measured on this host ({on} cluster, median of {CALIBRATION_WINDOWS} windows)")
    for col in ("serving latency", "prefill loop per prompt", "decode loop per token", "CPU per request", "idle"):
        t.add_column(col, justify="right")
    t.add_row(
        describe(p),
        f"{p.prefill_loop_s * 1e3:.1f} ms",
        f"{p.decode_loop_per_token_s * 1e3:.2f} ms",
        f"{p.serving_cpu_s * 1e3:.0f} ms",
        f"{p.background_cores:.2f} cores of {p.shared_cores}",
    )
    return t
