"""Overload with clients that retry as the router's hint says, and what the cluster serves through it and after.

Poisson arrivals of logical requests in phases (`--phases 1:20,3:30,1:40`: 1x the rate for 20 s, 3x for 30 s, 1x
for 40 s). Each logical request is tried until it is served, refused without a hint, or its caller's time
(`--give-up-s`, from its arrival) runs out; each attempt carries the time left as its gRPC deadline, and a
RESOURCE_EXHAUSTED is retried after exactly its `grpc-retry-pushback-ms` (`--client-jitter none`, as OpenAI's SDK
and gRPC's own retry policy honour a pushback) or a uniform draw in [0.5, 1.5] of it (`half`); `never`: no retries
(the cluster's capacity, at a rate past it). Prints, per window of `--window-s`, what was offered and served, and
over the run the workers' prefills against the first tokens that reached a caller (prefill work done for nobody) and
each process's CPU seconds. `--json` writes every attempt for report.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass

import grpc

from pdserve.rpc.errors import retry_after_ms
from pdserve.rpc.metadata import PREDICTED_TTFT_KEY
from pdserve.rpc.server import channel
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc


@dataclass
class Attempt:
    logical: int
    number: int
    sent_s: float  # from the run's start
    outcome: str  # ok, a gRPC code's name
    ended_s: float
    ttft_s: float | None = None  # this attempt's, from its send
    hint_ms: int | None = None
    predicted_ttft_s: float | None = None  # the router's, when it admitted it (x-pdserve-predicted-ttft-ms)


@dataclass
class Logical:
    index: int
    phase: int
    arrived_s: float
    outcome: str = ""  # ok, gave_up (its time ran out while retrying), or the last attempt's code
    latency_s: float | None = None  # arrival -> first token of the attempt that served it
    attempts: int = 0


def phases(text: str) -> list[tuple[float, float]]:
    """`1:20,3:30` -> [(1.0, 20.0), (3.0, 30.0)]: (multiple of the rate, seconds)."""
    return [(float(m), float(s)) for m, s in (p.split(":") for p in text.split(","))]


def arrivals(rate: float, plan: list[tuple[float, float]], rng: random.Random) -> list[tuple[float, int]]:
    """(offset s, phase index) of each arrival: Poisson at rate x the phase's multiple."""
    out, start = [], 0.0
    for i, (mult, seconds) in enumerate(plan):
        t = start
        while True:
            t += rng.expovariate(rate * mult)
            if t >= start + seconds:
                break
            out.append((t, i))
        start += seconds
    return out


COUNTED = ("pdserve_request_prefill_time_seconds_count", "pdserve_engine_step_tokens_sum", "process_cpu_seconds_total")


def work_counts(addr: str, router_metrics: str | None) -> dict[str, float]:
    """Per process role: prefills that ran (pdserve_request_prefill_time_seconds_count), steps' tokens, CPU seconds."""
    for _ in range(5):  # a router busy with a storm may let one status call time out
        status = [sys.executable, "-m", "pdserve.cli", "status", "--addr", addr, "--json"]
        out = subprocess.run(status, capture_output=True, text=True)
        if out.returncode == 0:
            break
        time.sleep(2)
    out.check_returncode()
    sources = [(w["role"], w["metrics_address"]) for w in json.loads(out.stdout)["workers"]]
    totals: dict[str, float] = {}
    for role, address in sources + ([("router", router_metrics)] if router_metrics else []):
        for line in urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode().splitlines():
            for name in COUNTED:
                if line.startswith(name):
                    key = f"{role}:{name.removeprefix('pdserve_')}"
                    totals[key] = totals.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


async def run(args: argparse.Namespace) -> tuple[list[Logical], list[Attempt], float]:
    rng = random.Random(args.seed)
    plan = phases(args.phases)
    logicals = [Logical(i, p, t) for i, (t, p) in enumerate(arrivals(args.rate, plan, rng))]
    # Each its own prompt (no prefix-cache hits), within every model's vocabulary (tiny-random's is 259).
    prompts = [[rng.randrange(3, 259) for _ in range(args.prompt_len)] for _ in logicals]
    attempts: list[Attempt] = []
    async with channel(args.addr) as ch:
        await ch.channel_ready()
        stub = generate_pb2_grpc.GenerationStub(ch)
        start = time.perf_counter()

        def now() -> float:
            return time.perf_counter() - start

        async def one(req: Logical) -> None:
            await asyncio.sleep(max(0.0, req.arrived_s - now()))
            msg = pb.GenerateRequest(
                prompt_token_ids=prompts[req.index],
                sampling=pb.SamplingParams(max_tokens=args.max_tokens, ignore_eos=True),
            )
            while True:
                left = req.arrived_s + args.give_up_s - now()
                if left <= 0.05:
                    req.outcome = "gave_up"
                    return
                req.attempts += 1
                a = Attempt(req.index, req.attempts, now(), "ok", 0.0)
                attempts.append(a)
                try:
                    call = stub.Generate(msg, timeout=left)
                    predicted = dict(await call.initial_metadata() or ()).get(PREDICTED_TTFT_KEY)  # sent once admitted
                    a.predicted_ttft_s = None if predicted is None else int(predicted) / 1e3
                    async for m in call:
                        if m.token_ids and a.ttft_s is None:
                            a.ttft_s = now() - a.sent_s
                            req.latency_s = now() - req.arrived_s
                    a.ended_s = now()
                    req.outcome = "ok"
                    return
                except grpc.aio.AioRpcError as e:
                    a.ended_s, a.outcome = now(), e.code().name
                    a.hint_ms = retry_after_ms(e.trailing_metadata())
                    hinted = e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and a.hint_ms is not None
                    if not hinted or args.client_jitter == "never":
                        req.outcome = "gave_up" if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else e.code().name
                        return
                    wait = a.hint_ms / 1e3
                    if args.client_jitter == "half":
                        wait *= rng.uniform(0.5, 1.5)
                    await asyncio.sleep(wait)

        await asyncio.gather(*(one(r) for r in logicals))
        return logicals, attempts, sum(s for _, s in plan)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


def dispersion(times: list[float], lo: float, hi: float, bin_s: float) -> float:
    """Variance over mean of attempt counts per bin (1 for Poisson arrivals; waves push it up)."""
    bins = [0] * max(1, int((hi - lo) / bin_s))
    for t in times:
        if lo <= t < hi:
            bins[min(len(bins) - 1, int((t - lo) / bin_s))] += 1
    mean = statistics.fmean(bins)
    return statistics.pvariance(bins) / mean if mean else float("nan")


def report(args: argparse.Namespace, logicals: list[Logical], attempts: list[Attempt], span_s: float) -> dict:
    plan = phases(args.phases)
    rows = []
    print(
        f"{'window':>9} {'x':>3} {'arrive/s':>8} {'tries/s':>8} {'served/s':>8} {'shed/s':>7} "
        f"{'gaveup/s':>8} {'lat p50':>8} {'lat p99':>8} {'ttft p50':>8} {'hint p50':>8}"
    )
    edges, acc = [], 0.0
    for mult, seconds in plan:
        edges.append((acc, acc + seconds, mult))
        acc += seconds
    w = args.window_s
    for k in range(int(span_s / w)):
        lo, hi = k * w, (k + 1) * w
        mult = next(m for a, b, m in edges if a <= lo < b)
        arrived = [r for r in logicals if lo <= r.arrived_s < hi]
        tries = [a for a in attempts if lo <= a.sent_s < hi]
        served = [a for a in attempts if a.outcome == "ok" and lo <= a.ended_s < hi]
        shed = [a for a in tries if a.outcome == "RESOURCE_EXHAUSTED"]
        gave_up = [r for r in logicals if r.outcome == "gave_up" and lo <= r.arrived_s + args.give_up_s < hi]
        lat = [
            r.latency_s
            for r in logicals
            if r.outcome == "ok" and r.latency_s is not None and lo <= r.arrived_s + r.latency_s < hi
        ]
        ttft = [a.ttft_s for a in tries if a.ttft_s is not None]
        hints = [float(a.hint_ms) for a in shed if a.hint_ms is not None]
        row = {
            "from_s": lo,
            "mult": mult,
            "arrive": len(arrived) / w,
            "tries": len(tries) / w,
            "served": len(served) / w,
            "shed": len(shed) / w,
            "gave_up": len(gave_up) / w,
            "lat_p50": pct(lat, 50),
            "lat_p99": pct(lat, 99),
            "ttft_p50": pct(ttft, 50),
            "hint_p50": pct(hints, 50),
        }
        rows.append(row)
        print(
            f"{lo:>4.0f}-{hi:<4.0f} {mult:>3g} {row['arrive']:>8.1f} {row['tries']:>8.1f} {row['served']:>8.1f} "
            f"{row['shed']:>7.1f} {row['gave_up']:>8.1f} {row['lat_p50']:>8.2f} {row['lat_p99']:>8.2f} "
            f"{row['ttft_p50']:>8.2f} {row['hint_p50']:>8.0f}"
        )
    summary: dict[str, object] = {"rows": rows}
    for i, (lo, hi, mult) in enumerate(edges):
        mine = [r for r in logicals if r.phase == i]
        ok = [r for r in mine if r.outcome == "ok"]
        tries = [a for a in attempts if lo <= a.sent_s < hi]
        served = [a for a in attempts if a.outcome == "ok" and lo <= a.ended_s < hi]
        hints = [a.hint_ms for a in tries if a.hint_ms is not None]
        admitted = [a for a in tries if a.predicted_ttft_s is not None]
        phase = {
            "mult": mult,
            "seconds": hi - lo,
            "arrived": len(mine),
            "served_share": len(ok) / max(1, len(mine)),
            "served_per_s": len(served) / (hi - lo),
            "tries_per_s": len(tries) / (hi - lo),
            "tries_per_logical": statistics.fmean([r.attempts for r in mine]) if mine else 0.0,
            "outcomes": {o: sum(r.outcome == o for r in mine) for o in sorted({r.outcome for r in mine})},
            "lat_p50": pct([r.latency_s for r in ok if r.latency_s], 50),
            "lat_p99": pct([r.latency_s for r in ok if r.latency_s], 99),
            "hint_ms_p10_p50_p90": [pct(hints, 10), pct(hints, 50), pct(hints, 90)],
            "distinct_hints": len(set(hints)),
            "dispersion_100ms": dispersion([a.sent_s for a in tries], lo, hi, 0.1),
            # Admitted attempts: the router's predicted TTFT against the one measured, and those that never got one.
            "admitted_ttft_p50_predicted_measured": [
                pct([a.predicted_ttft_s for a in admitted if a.ttft_s is not None], 50),
                pct([a.ttft_s for a in admitted if a.ttft_s is not None], 50),
            ],
            "admitted_no_first_token": sum(a.ttft_s is None for a in admitted),
        }
        summary[f"phase{i}"] = phase
        print(f"phase {i} ({mult:g}x, {hi - lo:g} s): " + json.dumps(phase))
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--addr", required=True)
    ap.add_argument("--rate", type=float, required=True, help="1x, in logical requests per second")
    ap.add_argument("--phases", default="1:20,3:30,1:40")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--give-up-s", type=float, default=10.0)
    ap.add_argument("--client-jitter", choices=("none", "half", "never"), default="none", help="never: no retries")
    ap.add_argument("--window-s", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--router-metrics", help="HOST:PORT of the router's /metrics (its CPU seconds)")
    ap.add_argument("--json", help="write the summary, attempts and requests here")
    args = ap.parse_args()
    before = work_counts(args.addr, args.router_metrics)
    logicals, attempts, span_s = asyncio.run(run(args))
    after = work_counts(args.addr, args.router_metrics)
    summary = report(args, logicals, attempts, span_s)
    first_tokens = sum(a.ttft_s is not None for a in attempts)
    work = {k: after[k] - before.get(k, 0.0) for k in after}
    prefills = work.get("prefill:request_prefill_time_seconds_count", 0.0)
    client_cpu_s = resource.getrusage(resource.RUSAGE_SELF).ru_utime + resource.getrusage(resource.RUSAGE_SELF).ru_stime
    summary["work"] = work | {
        "first_tokens_to_callers": first_tokens,
        "prefills_for_nobody": prefills - first_tokens,
        "client:cpu_seconds": client_cpu_s,
    }
    print("work: " + json.dumps(summary["work"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "summary": summary,
                    "attempts": [asdict(a) for a in attempts],
                    "requests": [asdict(r) for r in logicals],
                },
                f,
            )


if __name__ == "__main__":
    main()
