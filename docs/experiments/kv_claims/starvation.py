"""One side of the KV-claim A/B: can a large request get into a decode worker whose KV small streams keep full?

A 1P:1D tiny-random cluster of this checkout with 200 KV blocks a worker (16 tokens each). Twelve clients each send
small streams back to back (100-token prompt, 150 tokens out: 16 blocks a request, as admission counts it), their
decode steps slowed so each stream holds its blocks ~1.5 s, and retry a RESOURCE_EXHAUSTED after its hint. Once
they run, one large request (1200-token prompt, 16 out: 77 blocks) is sent, and retried after each hint, for up to
LARGE_WAIT_S. Per trial: the seconds until the large request's first token (or none within the wait), its
refusals, and the small streams' tokens per second meanwhile. Appends its rows to --json.

`--routers 2`: the cluster's registry is a redis-server of the script's own, and a second router (`pdserve router`)
serves beside `up`'s, as the chart's two replicas do. Small clients alternate between the routers; the large
request's client keeps to the first, as a gRPC client keeps its one connection.

    PYTHONPATH=src:. python docs/experiments/kv_claims/starvation.py --side after --trials 3 --json rows.json
    python docs/experiments/kv_claims/starvation.py --report rows.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from pdserve.cluster.local_process import ClusterProcess, PdserveProcess, free_port
from pdserve.rpc.errors import retry_after_ms
from pdserve.rpc.server import channel
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc
from tests.redis_server import RedisServer

BLOCKS = 200
CLIENTS = 20
SMALL_PROMPT, SMALL_OUT = 100, 250
LARGE_PROMPT, LARGE_OUT = 1200, 16
STEP_S = 0.01  # each decode step running a "bg-" stream
WARM_S = 5.0  # the small streams' start, before the large request
LARGE_WAIT_S = 60.0


def request(request_id: str, prompt_len: int, max_tokens: int, rng: random.Random) -> pb.GenerateRequest:
    prompt = [rng.randrange(3, 250) for _ in range(prompt_len)]  # fresh: no prefix cache hit
    return pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )


async def attempt(stub: generate_pb2_grpc.GenerationStub, req: pb.GenerateRequest) -> tuple[int, float | None]:
    """(tokens, None) once the stream ended, or (0, hint in seconds) when it was refused for load."""
    tokens = 0
    try:
        async for msg in stub.Generate(req, timeout=120):
            tokens += len(msg.token_ids)
        return tokens, None
    except grpc.aio.AioRpcError as e:
        if e.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED or tokens:
            raise
        return 0, (retry_after_ms(e.trailing_metadata()) or 100) / 1e3


async def small_client(stub: generate_pb2_grpc.GenerationStub, n: int, stop: asyncio.Event, tally: list[int]) -> None:
    rng, i = random.Random(n), 0
    while not stop.is_set():
        tokens, hint = await attempt(stub, request(f"bg-{n}-{i}", SMALL_PROMPT, SMALL_OUT, rng))
        tally.append(tokens)
        i += 1
        if hint is not None:
            await asyncio.sleep(hint)


async def trial(addresses: list[str], seed: int) -> dict:
    async with contextlib.AsyncExitStack() as stack:
        stubs = [generate_pb2_grpc.GenerationStub(await stack.enter_async_context(channel(a))) for a in addresses]
        stub, stop, tally = stubs[0], asyncio.Event(), []
        clients = [
            asyncio.create_task(small_client(stubs[n % len(stubs)], seed * 100 + n, stop, tally))
            for n in range(CLIENTS)
        ]
        await asyncio.sleep(WARM_S)
        rng, refusals, begun, admitted_s = random.Random(seed), 0, time.monotonic(), None
        large = request(f"large-{seed}", LARGE_PROMPT, LARGE_OUT, rng)
        small_before = sum(tally)
        while time.monotonic() - begun < LARGE_WAIT_S:
            tokens, hint = await attempt(stub, large)
            if hint is None:
                admitted_s = time.monotonic() - begun
                break
            refusals += 1
            await asyncio.sleep(hint)
        took = time.monotonic() - begun
        small_tokens_s = (sum(tally) - small_before) / took
        stop.set()
        await asyncio.gather(*clients)
    return {"admitted_s": admitted_s, "refusals": refusals, "small_tokens_s": small_tokens_s}


def report(rows: list[dict]) -> None:
    print("| side | trials | large request served | seconds to it, median (range) | refusals, median | small tok/s |")
    print("|---|---|---|---|---|---|")
    for side in dict.fromkeys(r["side"] for r in rows):
        mine = [r for r in rows if r["side"] == side]
        if not mine:
            continue
        served = [r["admitted_s"] for r in mine if r["admitted_s"] is not None]
        waits = f"{statistics.median(served):.1f} ({min(served):.1f}-{max(served):.1f})" if served else "-"
        refusals = statistics.median(r["refusals"] for r in mine)
        tok_s = statistics.median(r["small_tokens_s"] for r in mine)
        print(
            f"| {side} | {len(mine)} | {len(served)} within {LARGE_WAIT_S:g} s | {waits} | {refusals:g} | {tok_s:.0f} |"
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--report", type=Path, help="print the table of a rows file and exit")
    p.add_argument("--side")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--json", type=Path)
    p.add_argument("--routers", type=int, choices=(1, 2), default=1)
    args = p.parse_args()
    if args.report:
        report(json.loads(args.report.read_text()))
        return
    env = {"PDSERVE_FAULT_SLOW_STEP_S": str(STEP_S), "PDSERVE_FAULT_SLOW_STEP_REQUEST_ID_PREFIX": "bg-"}
    cluster_args = ["--model", "tiny-random", "--prefill", "1", "--decode", "1"]
    cluster_args += ["--kv-cache-gb", str(BLOCKS * 8192 / 2**30), "--no-access-log"]
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        if args.routers == 2:
            redis = RedisServer()
            redis.start()
            stack.callback(redis.stop)
            cluster_args += ["--redis", redis.url]
        cluster = ClusterProcess(*cluster_args, log_path=Path(tmp) / "cluster.log", env=env)
        stack.callback(cluster.stop)
        addresses = [cluster.address]
        if args.routers == 2:
            port = free_port()
            router_args = ["router", "--model", "tiny-random", "--redis", redis.url, "--port", str(port)]
            second = PdserveProcess(
                *router_args,
                "--no-access-log",
                log_path=Path(tmp) / "router.log",
                env={"PDSERVE_CLUSTER_SECRET": cluster.cluster_secret},
            )
            stack.callback(second.stop)
            second.wait_ready()
            addresses.append(f"127.0.0.1:{port}")
        side = args.side if args.routers == 1 else f"{args.side}, 2 routers"
        rows = [{"side": side, **asyncio.run(trial(addresses, seed))} for seed in range(args.trials)]
    for row in rows:
        print(json.dumps(row))
    if args.json:
        old = json.loads(args.json.read_text()) if args.json.exists() else []
        args.json.write_text(json.dumps(old + rows, indent=1))


if __name__ == "__main__":
    main()
