"""Holds admission to account on a real cluster: predicted vs measured TTFT, and a burst far above capacity.

The router sends its predicted TTFT in the initial metadata of every admitted stream (`PREDICTED_TTFT_KEY`).
Phase 1 sends prompts of several lengths one at a time to an idle cluster and compares prediction and
measurement. Phase 2 sends `burst` requests at once with an explicit TTFT SLO: how many were admitted, how
many of those met the SLO, how fast rejections came back, and how many were rejected while no admitted
request was waiting for its first token (the prefill side idle: capacity admission left unused).
"""

from __future__ import annotations

import asyncio
import gc
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
from rich.table import Table

from pdserve.bench.report_console import report_console
from pdserve.cluster.local_process import ClusterProcess
from pdserve.rpc.metadata import PREDICTED_TTFT_KEY
from pdserve.rpc.server import channel
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc


@dataclass(frozen=True)
class AdmissionBench:
    prompt_lens: tuple[int, ...] = (64, 128, 256, 512, 1024)
    repeats: int = 3  # sequential requests per prompt length
    burst: int = 120
    burst_prompt_len: int = 128
    ttft_slo_ms: float = 3000.0
    max_tokens: int = 4
    vocab: int = 49000  # token ids are drawn below this (SmolLM2's vocabulary is 49152)
    seed: int = 0


@dataclass
class Outcome:
    status: str  # "OK" or a gRPC status name
    sent_at: float  # perf_counter seconds
    ended_at: float  # first token, or the error
    predicted_ms: float | None = None
    details: str = ""  # the error's text

    @property
    def seconds(self) -> float:
        return self.ended_at - self.sent_at


async def _send(stub: generate_pb2_grpc.GenerationStub, request: pb.GenerateRequest) -> Outcome:
    """One request until its first token (the rest of the stream is read but not timed)."""
    sent = time.perf_counter()
    call = stub.Generate(request, timeout=600)
    first = None
    try:
        async for msg in call:
            if msg.token_ids and first is None:
                first = time.perf_counter()
    except grpc.aio.AioRpcError as e:
        return Outcome(e.code().name, sent, time.perf_counter(), details=e.details() or "")
    metadata = dict(await call.initial_metadata() or ())
    predicted = metadata.get(PREDICTED_TTFT_KEY)
    return Outcome("OK", sent, first or time.perf_counter(), float(predicted) if predicted is not None else None)


def _request(rng: random.Random, bench: AdmissionBench, tokens: int, ttft_slo_ms: float) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_token_ids=[rng.randrange(100, bench.vocab) for _ in range(tokens)],
        sampling=pb.SamplingParams(max_tokens=bench.max_tokens, ignore_eos=True),
        slo=pb.SLO(ttft_ms=ttft_slo_ms),
    )


class RouterNotServing(RuntimeError):
    """The warm-up request failed: every figure after it would measure the failure, not admission."""


async def _sequential(stub: generate_pb2_grpc.GenerationStub, bench: AdmissionBench) -> list[tuple[int, Outcome]]:
    rng = random.Random(bench.seed)
    warm_up = await _send(stub, _request(rng, bench, 16, 0))  # channels, the first step of each worker
    if warm_up.status != "OK":
        raise RouterNotServing(f"the warm-up request failed with {warm_up.status}: {warm_up.details}")
    return [(n, await _send(stub, _request(rng, bench, n, 0))) for n in bench.prompt_lens for _ in range(bench.repeats)]


async def _burst(stub: generate_pb2_grpc.GenerationStub, bench: AdmissionBench) -> list[Outcome]:
    rng = random.Random(bench.seed + 1)
    requests = [_request(rng, bench, bench.burst_prompt_len, bench.ttft_slo_ms) for _ in range(bench.burst)]
    gc.collect()
    gc.disable()  # a collection mid-burst would add its pause to every latency measured
    try:
        return await asyncio.gather(*(_send(stub, r) for r in requests))
    finally:
        gc.enable()


async def _measure(address: str, bench: AdmissionBench) -> tuple[list[tuple[int, Outcome]], list[Outcome]]:
    async with channel(address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        sequential = await _sequential(stub, bench)
        await asyncio.sleep(2.0)  # heartbeats catch up: the burst starts on a cluster the router knows idle
        return sequential, await _burst(stub, bench)


def _error_pct(outcomes: list[Outcome]) -> float | None:
    """Median |predicted - measured| / measured over admitted requests, in percent."""
    errors = [abs(o.predicted_ms - o.seconds * 1e3) / (o.seconds * 1e3) for o in outcomes if o.predicted_ms]
    return float(np.median(errors) * 100) if errors else None


def _rejected_while_idle(burst: list[Outcome]) -> int:
    """Rejections at a moment when no admitted request was waiting for its first token."""
    busy = [(o.sent_at, o.ended_at) for o in burst if o.status == "OK"]
    return sum(not any(start <= o.ended_at < end for start, end in busy) for o in burst if o.status != "OK")


def summarize(bench: AdmissionBench, sequential: list[tuple[int, Outcome]], burst: list[Outcome]) -> dict:
    admitted = [o for o in burst if o.status == "OK"]
    rejected = [o for o in burst if o.status != "OK"]
    rejection_ms = [o.seconds * 1e3 for o in rejected]
    return {
        "sequential": [
            {"prompt_tokens": n, "predicted_ms": o.predicted_ms, "measured_ms": o.seconds * 1e3, "status": o.status}
            for n, o in sequential
        ],
        "sequential_median_abs_error_pct": _error_pct([o for _, o in sequential if o.status == "OK"]),
        "burst_median_abs_error_pct": _error_pct(admitted),
        "burst": bench.burst,
        "admitted": len(admitted),
        "rejected": {s: sum(o.status == s for o in rejected) for s in sorted({o.status for o in rejected})},
        "admitted_meeting_slo": sum(o.seconds * 1e3 <= bench.ttft_slo_ms for o in admitted),
        "admitted_ttft_ms": sorted(round(o.seconds * 1e3) for o in admitted),
        "rejection_p50_ms": float(np.percentile(rejection_ms, 50)) if rejection_ms else None,
        "rejection_p99_ms": float(np.percentile(rejection_ms, 99)) if rejection_ms else None,
        "rejected_while_idle": _rejected_while_idle(burst),
    }


def _print(bench: AdmissionBench, f: dict) -> None:
    console = report_console()
    table = Table(title="Sequential requests on an idle cluster (no SLO): predicted vs measured TTFT")
    for col in ("prompt tokens", "predicted ms", "measured ms", "error"):
        table.add_column(col, justify="right")
    for row in f["sequential"]:
        pred, meas = row["predicted_ms"], row["measured_ms"]
        err = f"{(pred - meas) / meas:+.1%}" if pred is not None else row["status"]
        table.add_row(str(row["prompt_tokens"]), f"{pred:.0f}" if pred is not None else "-", f"{meas:.0f}", err)
    console.print(table)
    met = f["admitted_meeting_slo"] / f["admitted"] if f["admitted"] else float("nan")
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    lines = [
        f"median |predicted - measured| TTFT: {fmt(f['sequential_median_abs_error_pct'])}% sequential, "
        f"{fmt(f['burst_median_abs_error_pct'])}% in the burst (goal <= 15%)",
        f"burst of {bench.burst} x {bench.burst_prompt_len}-token prompts, TTFT SLO {bench.ttft_slo_ms:g} ms: "
        f"admitted {f['admitted']}, rejected {f['rejected']}",
        f"admitted meeting the SLO: {f['admitted_meeting_slo']}/{f['admitted']} ({met:.0%}; goal >= 95%), "
        f"TTFTs ms {f['admitted_ttft_ms']}",
        f"time to a rejection: p50 {fmt(f['rejection_p50_ms'])} ms, p99 {fmt(f['rejection_p99_ms'])} ms "
        f"(goal p99 < 200 ms); rejected while no admitted request awaited its first token: "
        f"{f['rejected_while_idle']}",
    ]
    for line in lines:
        console.print(line)


def run_admission_bench(bench: AdmissionBench, address: str | None, cluster_args: tuple[str, ...]) -> dict:
    """Against `address`, or a fresh disaggregated `pdserve up` with `cluster_args`, stopped afterwards."""
    with tempfile.TemporaryDirectory() as tmp:
        cluster = None if address else ClusterProcess(*cluster_args, log_path=Path(tmp) / "cluster.log")
        try:
            sequential, burst = asyncio.run(_measure(address or cluster.address, bench))  # type: ignore[union-attr]
        finally:
            if cluster is not None:
                cluster.stop()
    figures = summarize(bench, sequential, burst)
    _print(bench, figures)
    return figures
