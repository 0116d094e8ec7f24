"""Does a busy decode worker show in the TTFT the router predicts?

A decode worker's engine takes the hand-off's commands (reserve the KV blocks, commit the first token) only
between its steps, so behind a running batch a first token waits about one step more than on an idle worker.
This starts a real 1P:1D cluster, sends probes one at a time to it idle, then again while `--streams` long
streams keep its decode worker busy, and prints each phase's median predicted (the router's
`x-pdserve-predicted-ttft-ms`) and measured TTFT: the busy minus idle difference of each is what the load added,
as predicted and as measured.

    .venv/bin/python docs/experiments/decode_wait/decode_wait.py --model smollm2-135m --streams 4 16
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import tempfile
from pathlib import Path

from pdserve.bench.admission_bench import _send
from pdserve.cluster.local_process import ClusterProcess
from pdserve.rpc.server import channel
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc

VOCAB = 49000
BACKGROUND_TOKENS = 1000  # longer than a phase lasts; 16 of them fit the decode worker's KV cache


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, VOCAB) for _ in range(n)]


async def _probes(stub: generate_pb2_grpc.GenerationStub, rng: random.Random, n: int, prompt_len: int) -> list[dict]:
    rows = []
    for _ in range(n):
        sampling = pb.SamplingParams(max_tokens=2, ignore_eos=True)
        o = await _send(stub, pb.GenerateRequest(prompt_token_ids=_prompt(rng, prompt_len), sampling=sampling))
        rows.append({"predicted_ms": o.predicted_ms, "measured_ms": o.seconds * 1e3, "status": o.status})
        await asyncio.sleep(0.5)  # the next probe is placed by a heartbeat taken after this one
    return rows


async def _stream(stub: generate_pb2_grpc.GenerationStub, prompt: list[int]) -> None:
    sampling = pb.SamplingParams(max_tokens=BACKGROUND_TOKENS, ignore_eos=True)
    async for _ in stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling), timeout=3600):
        pass


def _medians(rows: list[dict]) -> tuple[float, float]:
    ok = [r for r in rows if r["status"] == "OK"]
    return statistics.median(r["predicted_ms"] for r in ok), statistics.median(r["measured_ms"] for r in ok)


async def _measure(address: str, streams: list[int], probes: int, prompt_len: int) -> dict:
    rng = random.Random(0)
    async with channel(address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        await _probes(stub, rng, 2, prompt_len)  # warm-up
        phases = {0: await _probes(stub, rng, probes, prompt_len)}
        for n in streams:
            background = [asyncio.ensure_future(_stream(stub, _prompt(rng, 16))) for _ in range(n)]
            await asyncio.sleep(5.0)  # all decoding, reported in a heartbeat
            phases[n] = await _probes(stub, rng, probes, prompt_len)
            if ended := [t for t in background if t.done()]:
                raise RuntimeError(f"{len(ended)} background streams ended early: {ended[0].exception()!r}")
            for task in background:
                task.cancel()
            for task in background:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            await asyncio.sleep(3.0)  # cancelled streams freed, the worker idle again
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--streams", type=int, nargs="+", default=[4, 16], help="background streams per phase")
    parser.add_argument("--probes", type=int, default=10)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--rows", type=Path, help="write every probe here as JSON")
    args = parser.parse_args()
    flags = ["--model", args.model, "--prefill", "1", "--decode", "1", "--kv-cache-gb", "1.0", "--threads", "1"]
    with tempfile.TemporaryDirectory() as tmp:
        cluster = ClusterProcess(*flags, log_path=Path(tmp) / "cluster.log")
        try:
            phases = asyncio.run(_measure(cluster.address, args.streams, args.probes, args.prompt_len))
        finally:
            cluster.stop()
    idle_predicted, idle_measured = _medians(phases[0])
    print("streams | TTFT predicted p50 ms | measured p50 ms | added by the load: predicted / measured ms")
    for n, rows in phases.items():
        predicted, measured = _medians(rows)
        added = f"{predicted - idle_predicted:.1f} / {measured - idle_measured:.1f}" if n else "-"
        print(f"{n:7d} | {predicted:21.1f} | {measured:15.1f} | {added}")
    if args.rows:
        args.rows.write_text(json.dumps({str(n): rows for n, rows in phases.items()}, indent=1))


if __name__ == "__main__":
    main()
