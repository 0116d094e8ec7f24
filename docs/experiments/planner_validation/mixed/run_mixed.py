"""The simulator against a local cluster on a mixed workload (most prompts short, some long), per class: the TTFT p50
and p90 measured, and those simulated on the very same trace with the prefill workers first come, first served (the
simulator before it modelled short prompts first) and short prompts first (as the workers run them).

Usage (from the repository root):
    PYTHONPATH=src:.:scripts python docs/experiments/planner_validation/mixed/run_mixed.py \
        --profile docs/experiments/planner_validation/calibrated_profile-run10.json --rates 8,16 --repeat 2 \
        --json docs/experiments/planner_validation/mixed/rows.json

Each row adds what the host's other programs used while it ran to the profile's background, as
scripts/validate_planner.py does. The router's default SLOs are raised so admission sheds nothing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
from planner_calibration import cluster_pids, cpu_clock, other_cores
from planner_load import cluster_args, measure, shape_of, warm_up, write_trace

from loadgen.record import OK
from loadgen.workload import WorkloadConfig
from pdserve.cluster.local_process import ClusterProcess
from pdserve.planner import workload
from pdserve.planner.hardware import HardwareProfile
from pdserve.planner.simulator import Simulator

CLASSES = ("short", "long")


def mixed(args: argparse.Namespace) -> workload.Workload:
    """Poisson arrivals at unit rate; a `--long-share` of the prompts `--long-len` ±15%, the others `--short-len`
    ±50%; every output `--output-len` tokens."""
    rng = np.random.default_rng(args.seed)
    base = workload.synthetic(1.0, args.short_len, args.output_len, args.num_requests, 0.5, 1.0, args.seed)
    long = rng.random(args.num_requests) < args.long_share
    long_lens = rng.integers(int(args.long_len * 0.85), int(args.long_len * 1.15) + 1, size=args.num_requests)
    picks = zip(long_lens, long, base.input_lens, strict=True)
    inputs = tuple(int(n) if is_long else short for n, is_long, short in picks)
    return replace(base, input_lens=inputs, output_lens=(args.output_len,) * args.num_requests)


def percentiles(ttfts_ms: dict[str, list[float]]) -> dict[str, list[float]]:
    return {c: [float(np.percentile(v, q)) for q in (50, 90)] if v else [] for c, v in ttfts_ms.items()}


def by_class(lengths: list[int], ttfts_ms: list[float], short_tokens: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {c: [] for c in CLASSES}
    for n, t in zip(lengths, ttfts_ms, strict=True):
        out["short" if n <= short_tokens else "long"].append(t)
    return out


def simulated(profile: HardwareProfile, config: str, trace: Path, short_first: bool) -> dict[str, list[float]]:
    load = workload.from_trace(trace)
    requests = load.at_rate(load.rate)
    result = Simulator(replace(profile, short_prompts_first=short_first), shape_of(config)).run(requests)
    assert not result.rejected
    lengths = [r.input_len for r in requests]
    return percentiles(by_class(lengths, [t * 1e3 for t in result.ttft_s], profile.long_prefill_chunk))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", type=Path, required=True, help="a calibrated profile of this host")
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--config", default="1:1")
    p.add_argument("--rates", default="8,16")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--num-requests", type=int, default=150)
    p.add_argument("--short-len", type=int, default=128)
    p.add_argument("--long-len", type=int, default=3000)
    p.add_argument("--long-share", type=float, default=0.2)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--warmup", type=int, default=24)
    p.add_argument("--kv-cache-gb", type=float, default=0.25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    args.rates = [float(r) for r in args.rates.split(",")]
    # what planner_load's warm-up and loadgen's goodput read: the short prompts' size, SLOs nothing misses
    args.input_len, args.range_ratio, args.slo_ttft_ms, args.slo_tpot_ms = args.short_len, 0.5, 1e7, 1e7
    profile = HardwareProfile.load(args.profile)
    from pdserve.engine.model_files import read_model_config
    from pdserve.engine.models import resolve_model

    vocab = read_model_config(resolve_model(args.model)).vocab_size
    load, seeds, rows = mixed(args), itertools.count(args.seed), []
    with tempfile.TemporaryDirectory(prefix="mixed-validation-") as tmp:
        cluster = ClusterProcess(*cluster_args(shape_of(args.config), args), log_path=Path(tmp) / "cluster.log")
        try:
            warm_up(cluster.address, args, vocab, next(seeds))
            for rate in [r for r in args.rates for _ in range(args.repeat)]:
                trace = Path(tmp) / f"trace-{rate:g}.jsonl"
                write_trace(trace, load, rate)
                pids = cluster_pids(cluster)
                before = cpu_clock(pids)
                replay = WorkloadConfig("trace", args.num_requests, vocab, trace=trace)
                run = measure(cluster.address, replay, args, next(seeds))
                others = other_cores(cpu_clock(pids) - before)
                done = [r for r in run["requests"] if r["status"] == OK]
                measured = by_class([r["input_len"] for r in done], [r["ttft_ms"] for r in done], 512)
                busy = replace(profile, background_cores=profile.background_cores + others)
                row = {
                    "rate": rate,
                    "others": others,
                    "failed": args.num_requests - len(done),
                    "count": {c: len(v) for c, v in measured.items()},
                    "measured": percentiles(measured),
                    "fcfs": simulated(busy, args.config, trace, short_first=False),
                    "short_first": simulated(busy, args.config, trace, short_first=True),
                }
                print(json.dumps(row), flush=True)
                rows.append(row)
        finally:
            cluster.stop()
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
