"""One side of the stream-coalescing A/B: a 1P:1D tiny-random cluster of this checkout replays one trace per rate
(the same trace on both sides: same arrivals, same lengths) and prints, per rate, goodput, TTFT and TPOT, the
messages each request streamed, and the CPU each process spent per request. Appends its rows to --json.

    PYTHONPATH=src:scripts:. python docs/experiments/stream_coalescing/ab.py --side after --json rows.json
    python docs/experiments/stream_coalescing/ab.py --report rows.json   # the medians per side and rate
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from planner_calibration import cpu_clock, worker_roles
from planner_load import cluster_args, measure, warm_up, write_trace

from loadgen.workload import WorkloadConfig
from pdserve.cluster.local_process import ClusterProcess
from pdserve.engine.model_files import read_model_config
from pdserve.engine.models import resolve_model
from pdserve.planner import workload
from pdserve.planner.shape import Shape


def report(rows: list[dict]) -> None:
    """Per rate, each side's median over its replays (the range of p90 TTFT and p50 TPOT beside them)."""
    print(
        "| rate | side | replays | goodput | TTFT p50 / p90 ms | TPOT p50 / p90 ms | messages / tokens "
        "| CPU ms/req router / prefill / decode |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for rate in sorted({r["rate"] for r in rows}):
        for side in ("before", "after"):
            mine = [r for r in rows if r["rate"] == rate and r["side"] == side]
            if not mine:
                continue

            def med(key: str, rs: list[dict] = mine) -> float:
                return statistics.median(r[key] for r in rs)

            def cpu(role: str, rs: list[dict] = mine) -> float:
                return statistics.median(r["cpu_ms_per_request"][role] for r in rs)

            p90s = [round(r["ttft_p90_ms"]) for r in mine]
            tpots = [round(r["tpot_p50_ms"], 1) for r in mine]
            print(
                f"| {rate:g} | {side} | {len(mine)} | {med('goodput'):.1f} "
                f"| {med('ttft_p50_ms'):.0f} / {med('ttft_p90_ms'):.0f} ({min(p90s)}-{max(p90s)}) "
                f"| {med('tpot_p50_ms'):.1f} ({min(tpots)}-{max(tpots)}) / {med('tpot_p90_ms'):.1f} "
                f"| {med('messages_per_request'):.1f} / {med('tokens_per_request'):.1f} "
                f"| {cpu('router'):.1f} / {cpu('prefill'):.1f} / {cpu('decode'):.1f} |"
            )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--report", type=Path, help="print the table of a rows file and exit")
    p.add_argument("--side")
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[10.0, 16.0, 24.0])
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--json", type=Path)
    p.add_argument(
        "--router-nice",
        type=int,
        help="renice every thread of the router's process (Ray runs the workers at 15): above 15 the router is "
        "the one starved of CPU, as a router pod at its CPU limit is",
    )
    args = p.parse_args()
    if args.report:
        report(json.loads(args.report.read_text()))
        return
    args.model, args.kv_cache_gb, args.range_ratio, args.warmup = "tiny-random", 0.25, 0.5, 48
    args.slo_ttft_ms, args.slo_tpot_ms = 500.0, 50.0
    vocab = read_model_config(resolve_model(args.model)).vocab_size
    load = workload.synthetic(1.0, args.input_len, args.output_len, args.num_requests, args.range_ratio, 1.0, 0)
    rows = json.loads(args.json.read_text()) if args.json.exists() else []
    with tempfile.TemporaryDirectory() as tmp:
        cluster = ClusterProcess(*cluster_args(Shape(prefill=1, decode=1), args), log_path=Path(tmp) / "cluster.log")
        try:
            warm_up(cluster.address, args, vocab, seed=1)
            roles = {**worker_roles(cluster.address), cluster.proc.pid: "router"}
            if args.router_nice is not None:
                for task in Path(f"/proc/{cluster.proc.pid}/task").iterdir():
                    os.setpriority(os.PRIO_PROCESS, int(task.name), args.router_nice)
            for i, rate in enumerate(args.rates):
                trace = Path(tmp) / f"trace-{rate:g}.jsonl"
                write_trace(trace, load, rate)
                before = {pid: cpu_clock({pid})[0] for pid in roles}
                host = cpu_clock(set())
                replay = WorkloadConfig("trace", args.num_requests, vocab, trace=trace)
                result = measure(cluster.address, replay, args, 10 + i)
                wall = cpu_clock(set())[2] - host[2]
                cpu_ms = {roles[pid]: 1e3 * (cpu_clock({pid})[0] - before[pid]) / args.num_requests for pid in roles}
                done = [r for r in result["requests"] if r["status"] == "OK"]
                row = {
                    "side": args.side,
                    "router_nice": args.router_nice,
                    "rate": rate,
                    "completed": len(done),
                    "goodput": result["request_goodput"],
                    "ttft_p50_ms": result["median_ttft_ms"],
                    "ttft_p90_ms": result["p90_ttft_ms"],
                    "tpot_p50_ms": result["median_tpot_ms"],
                    "tpot_p90_ms": result["p90_tpot_ms"],
                    "messages_per_request": statistics.mean(len(r["message_tokens"]) for r in done),
                    "tokens_per_request": statistics.mean(r["output_tokens"] for r in done),
                    "cpu_ms_per_request": cpu_ms,
                    "wall_s": wall,
                    "load_average": os.getloadavg()[0],
                }
                print(json.dumps(row), flush=True)
                rows.append(row)
                args.json.write_text(json.dumps(rows, indent=1))
        finally:
            cluster.stop()


if __name__ == "__main__":
    main()
