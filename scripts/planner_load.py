"""Running a workload against a local `pdserve up` for the planner's validation: the cluster's arguments,
Mooncake traces, loadgen runs and the warm-up."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from rich.console import Console

from loadgen.benchmark import BenchmarkConfig, run_benchmark
from loadgen.metrics import GoodputSLO
from loadgen.workload import WorkloadConfig
from pdserve.planner import workload
from pdserve.planner.shape import Shape


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
