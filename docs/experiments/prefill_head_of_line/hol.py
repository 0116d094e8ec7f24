"""Head-of-line blocking in the prefill worker: short chat prompts behind long RAG prompts, under Poisson load.

Starts a real 1P:1D cluster (`pdserve up`), sends a few requests of each class one at a time (their TTFT alone: the
capacity is one over the mix's mean), then Poisson arrivals at each `--loads` multiple of that capacity for
`--seconds`: a `--short-share` of short prompts (`--short-tokens`, TTFT SLO `--short-slo-ms`), the rest long
(`--long-tokens`, `--long-slo-ms`), each request carrying its class's SLO, so the router sheds
(`RESOURCE_EXHAUSTED`) what it predicts would miss it. The arrivals and prompts come from a fixed seed per load:
every run sends the same requests at the same times. For every request: its class, status, measured TTFT and the
router's predicted TTFT (`x-pdserve-predicted-ttft-ms`).

    PYTHONPATH=src:. python docs/experiments/prefill_head_of_line/hol.py --model smollm2-135m --rows rows.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import grpc

from pdserve.cluster.local_process import ClusterProcess
from pdserve.rpc.metadata import PREDICTED_TTFT_KEY
from pdserve.rpc.server import channel
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc

TOKEN_IDS = range(3, 250)  # within every model's vocabulary (tiny-random has 259)
KINDS = ("short", "long")


async def send(stub: generate_pb2_grpc.GenerationStub, rid: str, kind: str, n: int, slo_ms: float, args, rng) -> dict:
    request = pb.GenerateRequest(
        request_id=rid,
        prompt_token_ids=[rng.choice(TOKEN_IDS) for _ in range(n)],
        sampling=pb.SamplingParams(max_tokens=args.output_tokens, ignore_eos=True),
        slo=pb.SLO(ttft_ms=slo_ms),
    )
    row: dict = {"id": rid, "kind": kind, "prompt_tokens": n, "slo_ms": slo_ms, "sent_s": time.monotonic()}
    sent = time.perf_counter()
    call = stub.Generate(request, timeout=180)
    try:
        async for msg in call:
            if msg.token_ids and "measured_ms" not in row:
                row["measured_ms"] = (time.perf_counter() - sent) * 1e3
                row["first_token_s"] = time.monotonic()
        predicted = dict(await call.initial_metadata() or ()).get(PREDICTED_TTFT_KEY)
        row.update(status="OK", predicted_ms=float(predicted) if predicted is not None else None)
    except grpc.aio.AioRpcError as e:
        row.update(status=e.code().name, details=e.details())
    return row


def draw(rng: random.Random, args: argparse.Namespace) -> tuple[str, int, float]:
    if rng.random() < args.short_share:
        return "short", rng.randint(*args.short_tokens), args.short_slo_ms
    return "long", rng.randint(*args.long_tokens), args.long_slo_ms


async def alone(address: str, args: argparse.Namespace) -> list[dict]:
    """`--alone` requests of each class one at a time, each after the last ended and a heartbeat (0.5 s) past it."""
    rng, rows = random.Random(2), []
    async with channel(address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        for i in range(2 * args.alone):
            kind = ("short", "long")[i % 2]
            tokens, slo = (args.short_tokens, args.short_slo_ms) if kind == "short" else (args.long_tokens, 0.0)
            n = rng.randint(*tokens)
            rows.append(await send(stub, f"alone-{i}", kind, n, slo or args.long_slo_ms, args, rng))
            await asyncio.sleep(0.6)
    return rows


async def poisson(address: str, label: str, rate: float, args: argparse.Namespace) -> list[dict]:
    rng = random.Random(zlib.crc32(label.encode()))  # the same arrivals and prompts on every run
    tasks = []
    async with channel(address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        start, due, i = time.monotonic(), 0.0, 0
        while due < args.seconds:
            await asyncio.sleep(max(0.0, start + due - time.monotonic()))
            kind, n, slo = draw(rng, args)
            tasks.append(asyncio.ensure_future(send(stub, f"{label}-{i}", kind, n, slo, args, rng)))
            due, i = due + rng.expovariate(rate), i + 1
        return list(await asyncio.gather(*tasks))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] if xs else float("nan")


def summary(label: str, rows: list[dict]) -> str:
    lines = [label]
    for kind in KINDS:
        mine = [r for r in rows if r["kind"] == kind]
        ok = [r for r in mine if r["status"] == "OK"]
        ttft = [r["measured_ms"] for r in ok]
        ratio = [r["measured_ms"] / r["predicted_ms"] for r in ok if r.get("predicted_ms")]
        good = sum(r["measured_ms"] <= r["slo_ms"] for r in ok)
        shed = sum(r["status"] == "RESOURCE_EXHAUSTED" for r in mine)
        lines.append(
            f"  {kind:5} sent {len(mine):3d} served {len(ok):3d} shed {shed:3d} met {good:3d}"
            f" ({good / max(1, len(mine)):.0%}) TTFT p50 {pct(ttft, 50):.0f} p90 {pct(ttft, 90):.0f} ms"
            f" measured/predicted p50 {pct(ratio, 50):.2f} p90 {pct(ratio, 90):.2f}"
        )
    return "\n".join(lines)


async def measure(address: str, args: argparse.Namespace) -> dict:
    await poisson(address, "warmup", 1.0, argparse.Namespace(**{**vars(args), "seconds": 3.0}))
    rows = await alone(address, args)
    print(summary("alone", rows), flush=True)
    mean = {k: statistics.mean(r["measured_ms"] for r in rows if r["kind"] == k and "measured_ms" in r) for k in KINDS}
    capacity = args.capacity or 1e3 / (args.short_share * mean["short"] + (1 - args.short_share) * mean["long"])
    print(f"capacity {capacity:.3f} req/s (alone: short {mean['short']:.0f} ms, long {mean['long']:.0f} ms)")
    result: dict = {"capacity_rps": capacity, "args": {k: v for k, v in vars(args).items() if k != "rows"}}
    result["loads"] = {"alone": rows}
    for load in args.loads:
        label = f"load{load:g}"
        rows = await poisson(address, label, load * capacity, args)
        print(summary(label, rows), flush=True)
        result["loads"][f"{load:g}"] = rows
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--loads", type=float, nargs="+", default=[0.5, 1.0])
    parser.add_argument("--seconds", type=float, default=180.0, help="of Poisson arrivals per load")
    parser.add_argument("--capacity", type=float, default=0.0, help="req/s; 0: from the requests sent alone")
    parser.add_argument("--alone", type=int, default=3, help="requests of each class sent one at a time first")
    parser.add_argument("--short-share", type=float, default=0.8)
    parser.add_argument("--short-tokens", type=int, nargs=2, default=[64, 200])
    parser.add_argument("--long-tokens", type=int, nargs=2, default=[2048, 4096])
    parser.add_argument("--short-slo-ms", type=float, default=3000.0)
    parser.add_argument("--long-slo-ms", type=float, default=40000.0)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--rows", type=Path, help="write every request here as JSON")
    args = parser.parse_args()
    flags = ["--model", args.model, "--prefill", "1", "--decode", "1", "--kv-cache-gb", "1"]
    with tempfile.TemporaryDirectory() as tmp:
        cluster = ClusterProcess(*flags, log_path=Path(tmp) / "cluster.log")
        try:
            result = asyncio.run(measure(cluster.address, args))
        finally:
            cluster.stop()
    if args.rows:
        args.rows.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
