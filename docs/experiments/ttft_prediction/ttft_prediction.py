"""How far the router's predicted TTFT is from the measured one under Poisson load, and where the gap comes from.

Starts a real 1P:1D cluster whose traces go to a small OTLP receiver in this process, measures its capacity (what
it serves with `--concurrency` requests always in flight), then sends Poisson arrivals at each `--loads` multiple of
it for `--seconds`. For every served request: the router's predicted TTFT (`x-pdserve-predicted-ttft-ms`) and its
parts (the placement span's `predicted_*` attributes), the TTFT measured here, and the measured TTFT split by the
workers' spans into the router before its decode call, the decode worker before it calls its prefill worker (its
reserve), the prefill worker's queue wait and compute, the KV transfer and the commit to the first token.

    PYTHONPATH=src:. python docs/experiments/ttft_prediction/ttft_prediction.py --model tiny-random --rows rows.json
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
from tests.integration.cluster_view import Collector, serving_collector

TOKEN_IDS = range(3, 250)  # within every model's vocabulary (tiny-random has 259)
SPAN_WAIT_S = 8.0  # the batch span processors export every 5 s


def prompt_len(rng: random.Random, median: int, most: int) -> int:
    """Log-normal lengths (sigma 0.7: a quarter under half the median, a tenth over 2.5x), as chat prompts spread."""
    return max(16, min(most, round(rng.lognormvariate(0.0, 0.7) * median)))


async def send(stub: generate_pb2_grpc.GenerationStub, rid: str, n: int, out: int, slo_ms: float, rng) -> dict:
    request = pb.GenerateRequest(
        request_id=rid,
        prompt_token_ids=[rng.choice(TOKEN_IDS) for _ in range(n)],
        sampling=pb.SamplingParams(max_tokens=out, ignore_eos=True),
        slo=pb.SLO(ttft_ms=slo_ms),
    )
    row: dict = {"id": rid, "prompt_tokens": n, "sent_ns": time.time_ns()}
    sent = time.perf_counter()
    call = stub.Generate(request, timeout=120)
    try:
        async for msg in call:
            if msg.token_ids and "measured_ms" not in row:
                row["measured_ms"] = (time.perf_counter() - sent) * 1e3
        predicted = dict(await call.initial_metadata() or ()).get(PREDICTED_TTFT_KEY)
        row.update(status="OK", predicted_ms=float(predicted) if predicted is not None else None)
    except grpc.aio.AioRpcError as e:
        row.update(status=e.code().name, error_ms=(time.perf_counter() - sent) * 1e3, details=e.details())
    return row


async def capacity(address: str, concurrency: int, seconds: float, args: argparse.Namespace) -> float:
    """Requests served per second with `concurrency` always in flight (no SLO: only the queue bound sheds)."""
    rng, done, until = random.Random(1), 0, time.monotonic() + seconds
    async with channel(address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)

        async def loop(k: int) -> None:
            nonlocal done
            i = 0
            while time.monotonic() < until:
                n = prompt_len(rng, args.prompt_median, args.prompt_max)
                row = await send(stub, f"cap-{k}-{i}", n, args.output_tokens, 0, rng)
                done += row["status"] == "OK"
                i += 1

        start = time.monotonic()
        await asyncio.gather(*(loop(k) for k in range(concurrency)))
        return done / (time.monotonic() - start)


async def poisson(address: str, label: str, rate: float, seconds: float, args: argparse.Namespace) -> list[dict]:
    rng = random.Random(zlib.crc32(label.encode()))  # the same arrivals and prompts on every run
    tasks = []
    async with channel(address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        start, due, i = time.monotonic(), 0.0, 0
        while due < seconds:
            await asyncio.sleep(max(0.0, start + due - time.monotonic()))
            n = prompt_len(rng, args.prompt_median, args.prompt_max)
            rid = f"{label}-{i}"
            tasks.append(asyncio.ensure_future(send(stub, rid, n, args.output_tokens, args.ttft_slo_ms, rng)))
            due, i = due + rng.expovariate(rate), i + 1
        return list(await asyncio.gather(*tasks))


async def isolated(address: str, args: argparse.Namespace) -> list[dict]:
    """`--isolated` requests one at a time, each after the last ended and a heartbeat (0.5 s) past it."""
    rng, rows = random.Random(2), []
    async with channel(address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        for i in range(args.isolated):
            n = prompt_len(rng, args.prompt_median, args.prompt_max)
            rows.append(await send(stub, f"isolated-{i}", n, args.output_tokens, args.ttft_slo_ms, rng))
            await asyncio.sleep(0.6)
    return rows


def _attrs(span) -> dict:
    out = {}
    for a in span.attributes:
        v = a.value
        out[a.key] = v.string_value or v.double_value or v.int_value
    return out


def split(collector: Collector, rows: list[dict]) -> None:
    """Adds to each served row the predicted parts and the measured parts (ms), from its trace."""
    by_trace: dict[bytes, list] = {}
    trace_of: dict[str, bytes] = {}
    with collector.lock:
        for svc, s in collector.spans:
            by_trace.setdefault(s.trace_id, []).append((svc, s))
            if svc == "pdserve-router":
                client_id = _attrs(s).get("request.client_id")
                if client_id:
                    trace_of[client_id] = s.trace_id
    for row in rows:
        spans = by_trace.get(trace_of.get(row["id"], b""), [])
        if row["status"] != "OK" or not spans:
            continue
        named = {}
        for svc, s in spans:
            named.setdefault((svc, s.name), s)
        place = named.get(("pdserve-router", "placement"))
        decode = next((s for (svc, _), s in named.items() if svc == "pdserve-decode" and s.kind == 2), None)
        prefill = next((s for (svc, _), s in named.items() if svc == "pdserve-prefill" and s.kind == 2), None)
        wait, compute = (
            named.get(("pdserve-prefill", "prefill.queue_wait")),
            named.get(("pdserve-prefill", "prefill.compute")),
        )
        recv = named.get(("pdserve-decode", "kv_transfer.recv"))
        if None in (place, decode, prefill, wait, compute, recv):
            continue
        a = _attrs(place)
        first_ns = row["sent_ns"] + row["measured_ms"] * 1e6
        ms = lambda a_ns, b_ns: (b_ns - a_ns) / 1e6  # noqa: E731
        queue_s, prefill_queue_s = a.get("predicted_queue_s", 0), a.get("predicted_prefill_queue_s", 0)
        profiled_s = a.get("predicted_profiled_queue_s", queue_s)  # before the load's factor (none before it)
        row["predicted"] = {
            "own": a.get("predicted_own_ttft_s", 0) * 1e3,
            "fixed": a.get("predicted_fixed_s", 0) * 1e3,  # of own: the fixed cost (none before fixed_cost.py)
            "prefill_queue": prefill_queue_s * 1e3,
            "decode_wait": (profiled_s - prefill_queue_s) * 1e3,
            "load_factor": (queue_s - profiled_s) * 1e3,  # what the load's factor added
        }
        row["compute_ns"] = [compute.start_time_unix_nano, compute.end_time_unix_nano]
        row["measured"] = {
            "router": ms(row["sent_ns"], decode.start_time_unix_nano),
            "reserve": ms(decode.start_time_unix_nano, prefill.start_time_unix_nano),
            "prefill_queue": ms(wait.start_time_unix_nano, wait.end_time_unix_nano),
            "compute": ms(compute.start_time_unix_nano, compute.end_time_unix_nano),
            "transfer": ms(compute.end_time_unix_nano, recv.end_time_unix_nano),
            "commit": ms(recv.end_time_unix_nano, first_ns),
        }


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] if xs else float("nan")


def summary(label: str, rows: list[dict]) -> str:
    ok = [r for r in rows if r["status"] == "OK" and r.get("predicted_ms")]
    ratio = [r["measured_ms"] / r["predicted_ms"] for r in ok]
    line = f"{label:>10} sent {len(rows):4d} served {len(ok):4d}"
    line += f" measured/predicted p50 {pct(ratio, 50):.2f} p90 {pct(ratio, 90):.2f}"
    parts = [r for r in ok if "measured" in r]
    if parts:
        med = {k: statistics.median(r["measured"][k] for r in parts) for k in parts[0]["measured"]}
        pmed = {k: statistics.median(r["predicted"][k] for r in parts) for k in parts[0]["predicted"]}
        line += "\n" + " " * 11 + "measured p50 ms: " + ", ".join(f"{k} {v:.1f}" for k, v in med.items())
        line += "\n" + " " * 11 + "predicted p50 ms: " + ", ".join(f"{k} {v:.1f}" for k, v in pmed.items())
        line += f"; TTFT p50 measured {statistics.median(r['measured_ms'] for r in parts):.1f}"
        line += f" predicted {statistics.median(r['predicted_ms'] for r in parts):.1f}"
    return line


async def measure(address: str, collector: Collector, args: argparse.Namespace) -> dict:
    await poisson(address, "warmup", 2.0, 3.0, args)
    cap = args.capacity or await capacity(address, args.concurrency, args.capacity_seconds, args)
    print(f"capacity {cap:.2f} req/s", flush=True)
    result: dict = {"capacity_rps": cap, "default_ttft_ms": args.default_ttft_ms, "loads": {}}
    for load in [0.0, *args.loads]:
        label = f"load{load:g}"
        if load:
            rows = await poisson(address, label, load * cap, args.seconds, args)
        else:
            rows = await isolated(address, args)
        await asyncio.sleep(SPAN_WAIT_S)
        split(collector, rows)
        print(summary(label, rows), flush=True)
        result["loads"][f"{load:g}"] = rows
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--loads", type=float, nargs="+", default=[0.2, 0.5, 0.8, 1.0])
    parser.add_argument("--isolated", type=int, default=30, help="requests sent one at a time first (load 0)")
    parser.add_argument("--seconds", type=float, default=30.0, help="of Poisson arrivals per load")
    parser.add_argument("--capacity", type=float, default=0.0, help="req/s; 0: measure it first")
    parser.add_argument("--concurrency", type=int, default=8, help="in flight while measuring capacity")
    parser.add_argument("--capacity-seconds", type=float, default=20.0)
    parser.add_argument("--prompt-median", type=int, default=256)
    parser.add_argument("--prompt-max", type=int, default=2048)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--ttft-slo-ms", type=float, default=0.0, help="each request's; 0: the router's default")
    parser.add_argument("--default-ttft-ms", type=float, default=5000.0, help="the router's --default-ttft-ms")
    parser.add_argument("--rows", type=Path, help="write every request here as JSON")
    args = parser.parse_args()
    flags = ["--model", args.model, "--prefill", "1", "--decode", "1", "--kv-cache-gb", "0.5"]
    flags += ["--default-ttft-ms", f"{args.default_ttft_ms:g}"]
    with serving_collector() as collector, tempfile.TemporaryDirectory() as tmp:
        env = {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.port}",
        }
        cluster = ClusterProcess(*flags, log_path=Path(tmp) / "cluster.log", env=env)
        try:
            result = asyncio.run(measure(cluster.address, collector, args))
        finally:
            cluster.stop()
    if args.rows:
        args.rows.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
