"""Prefix-aware placement against round-robin on a shared-prefix workload, each on a fresh local cluster."""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.table import Table

from pdserve.bench.report_console import report_console
from pdserve.cluster.local_process import ClusterProcess
from pdserve.rpc.client import generate
from pdserve.v1 import generate_pb2 as pb


def shared_prefix_workload(
    vocab: int, num_prefixes: int, requests_per_prefix: int, prefix_len: int, suffix_len: int, seed: int
) -> list[list[int]]:
    """Many requests whose prompts share one of a few long system prompts, in shuffled order."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, vocab) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    prompts = [
        p + [rng.randrange(100, vocab) for _ in range(suffix_len)] for p in prefixes for _ in range(requests_per_prefix)
    ]
    rng.shuffle(prompts)
    return prompts


async def _run_load(address: str, prompts: list[list[int]], rate: float, seed: int) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=len(prompts))

    async def one(prompt: list[int], delay: float) -> tuple[float, int, int]:
        await asyncio.sleep(delay)
        request = pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(max_tokens=4, ignore_eos=True))
        request.slo.ttft_ms = 600_000  # measure placement, not shedding
        result = None
        async for _, running in generate(address, request, timeout_s=600):
            result = running
        assert result is not None and result.usage is not None
        return result.ttft_s, result.usage.cached_prompt_tokens, len(prompt)

    results = await asyncio.gather(*(one(p, d) for p, d in zip(prompts, np.cumsum(gaps), strict=True)))
    ttfts = np.array([r[0] for r in results]) * 1e3
    return {
        "ttft_p50_ms": float(np.percentile(ttfts, 50)),
        "ttft_p99_ms": float(np.percentile(ttfts, 99)),
        "prefix_hit_rate": sum(r[1] for r in results) / sum(r[2] for r in results),
    }


def run_placement_bench(
    model: str,
    prefill: int,
    decode: int,
    num_prefixes: int,
    requests_per_prefix: int,
    prefix_len: int,
    suffix_len: int,
    rate: float,
    seed: int = 0,
) -> dict[str, dict[str, float]]:
    from pdserve.engine.model_files import read_model_config
    from pdserve.engine.models import resolve_model

    vocab = read_model_config(resolve_model(model)).vocab_size
    prompts = shared_prefix_workload(vocab, num_prefixes, requests_per_prefix, prefix_len, suffix_len, seed)
    figures: dict[str, dict[str, float]] = {}
    for policy in ("slo", "round-robin"):
        with tempfile.TemporaryDirectory() as tmp:
            args = ["--model", model, "--prefill", str(prefill), "--decode", str(decode), "--policy", policy]
            cluster = ClusterProcess(*args, log_path=Path(tmp) / "cluster.log")
            try:
                start = time.perf_counter()
                figures[policy] = asyncio.run(_run_load(cluster.address, prompts, rate, seed))
                figures[policy]["duration_s"] = time.perf_counter() - start
            finally:
                cluster.stop()
    table = Table(title=f"{len(prompts)} requests: {num_prefixes} shared {prefix_len}-token prefixes + {suffix_len}")
    for col in ("policy", "TTFT p50 ms", "TTFT p99 ms", "prefix-cache hit rate"):
        table.add_column(col)
    for policy, f in figures.items():
        table.add_row(policy, f"{f['ttft_p50_ms']:.0f}", f"{f['ttft_p99_ms']:.0f}", f"{f['prefix_hit_rate']:.1%}")
    base, ours = figures["round-robin"], figures["slo"]
    table.add_row(
        "round-robin / slo",
        f"{base['ttft_p50_ms'] / ours['ttft_p50_ms']:.2f}x",
        f"{base['ttft_p99_ms'] / ours['ttft_p99_ms']:.2f}x",
        "",
    )
    report_console().print(table)
    return figures
