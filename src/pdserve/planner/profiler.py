"""`pdserve profile`: one worker's speed and limits on this machine, measured on the engine's model runner.

Prefill is timed against prompt length and the number of prompts in a step, and a later chunk of a long
prompt against the context it reads back from the cache (chunked prefill's extra cost); a decode step
against batch size and the context each sequence reads; whole engine steps on real requests for what a step
costs beside the model runner (scheduling, sampling, outputs); the KV transfer between two processes with
the transfer bench's own code (gloo on CPU, NCCL on CUDA); and the KV capacity is what the engine's cache
holds. The device, dtype and backend are the engine's run-time choices, as a worker makes them.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pdserve.config import ClusterConfig, EngineConfig
from pdserve.engine.device import synchronize
from pdserve.planner.hardware import HardwareProfile
from pdserve.protocol.engine_request import EngineRequest
from pdserve.protocol.perf_profile import PerfProfile, nonneg_lstsq
from pdserve.transfer.torch_dist import Backend


@dataclass(frozen=True)
class Grid:
    prompt_lens: tuple[int, ...] = (64, 256, 1024, 2048)
    prefill_batches: tuple[int, ...] = (1, 4)
    decode_batches: tuple[int, ...] = (1, 8, 32, 64)
    contexts: tuple[int, ...] = (64, 512, 1024)
    chunk_contexts: tuple[int, ...] = (0, 512, 1536)  # cached tokens before a chunk of a long prompt
    engine_steps: int = 16  # real decode steps timed through the engine, per batch size
    repeats: int = 3
    transfer_tokens: int = 2048
    transfer_repeats: int = 5
    transfer_pool_mib: int = 256  # each side's cache; what the ids scatter over, not what is sent


QUICK = Grid((32, 128, 256), (1, 2), (1, 4, 16), (64, 256), (0, 128), 8, 3, 64, 3, 16)


class _Timer:
    """Times the runner on scratch blocks (nothing is cached, nothing is scheduled), as a worker's start-up
    profile does; the median of the repeats, so one preemption on a shared machine does not move a point."""

    def __init__(self, engine: Any, repeats: int) -> None:
        self.runner, self.blocks, self.repeats = engine.runner, engine.blocks, repeats
        self.vocab = engine.model_config.vocab_size
        self.max_len = engine.max_model_len
        self.gen = torch.Generator().manual_seed(0)

    def fits(self, seqs: int, tokens: int) -> bool:
        return tokens < self.max_len and seqs * self.blocks.blocks_for(tokens) <= self.blocks.num_blocks

    def chunks(self, seqs: int, new: int, context: int) -> list[Any]:
        from pdserve.engine.scheduler import ScheduledChunk

        per = self.blocks.blocks_for(context + new)
        return [
            ScheduledChunk(
                f"p{i}",
                torch.randint(0, self.vocab, (new,), generator=self.gen).tolist(),
                context,
                list(range(i * per, (i + 1) * per)),
                True,
            )
            for i in range(seqs)
        ]

    def seconds(self, chunks: list[Any]) -> float:
        self.runner.execute(chunks)  # warm-up: kernels set up for this shape
        times = []
        for _ in range(self.repeats):
            self._sync()
            start = time.perf_counter()
            self.runner.execute(chunks)
            self._sync()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def _sync(self) -> None:
        synchronize(self.runner.device)


def measure_steps(engine: Any, grid: Grid) -> dict[str, list[list[float]]]:
    """Raw points: prefill [tokens, prompts, s], a later chunk [tokens, prompts, context, s] and decode
    [batch, context, s]."""
    timer = _Timer(engine, grid.repeats)
    prefill = [
        [n, b, timer.seconds(timer.chunks(b, n, 0))]
        for n in grid.prompt_lens
        for b in grid.prefill_batches
        if timer.fits(b, n)
    ]
    chunk = engine.config.scheduler.long_prefill_chunk
    chunked = [
        [chunk, b, c, timer.seconds(timer.chunks(b, chunk, c))]
        for c in grid.chunk_contexts
        for b in grid.prefill_batches
        if timer.fits(b, c + chunk)
    ]
    decode = [
        [b, c, timer.seconds(timer.chunks(b, 1, c))]
        for b in grid.decode_batches
        for c in grid.contexts
        if b <= engine.config.scheduler.max_num_seqs and timer.fits(b, c + 1)
    ]
    return {"prefill": prefill, "prefill_chunk": chunked, "decode": decode}


def measure_engine_steps(engine: Any, grid: Grid) -> list[list[float]]:
    """Real decode steps through `engine.step()`, as a worker's engine thread runs them: [batch, context, s]
    per step, the median of `engine_steps` after the batch's prefill (a step's scheduling, sampling and
    outputs are in it, which the runner's timing leaves out)."""
    from pdserve.protocol.sampling import SamplingParams

    timer = _Timer(engine, grid.repeats)
    context = min(grid.contexts)
    points = []
    for batch in grid.decode_batches[:2]:
        if batch > engine.config.scheduler.max_num_seqs or not timer.fits(batch, context + grid.engine_steps + 1):
            continue
        sampling = SamplingParams(max_tokens=grid.engine_steps + 1, ignore_eos=True)
        for i in range(batch):
            prompt = torch.randint(0, timer.vocab, (context,), generator=timer.gen).tolist()
            engine.add_request(EngineRequest(f"profile-{batch}-{i}", prompt, sampling))
        times = []
        while engine.has_unfinished():
            start = time.perf_counter()
            engine.step()
            if engine.last_step_tokens == batch:  # a decode step of the whole batch (not a prefill's)
                times.append(time.perf_counter() - start)
        points.append([batch, context + grid.engine_steps / 2, statistics.median(times)])
    return points


class NoisyMeasurement(RuntimeError):
    """The grid was measured, but its times do not show what the fit needs (a host too busy to time it)."""


def fit(points: dict[str, list[list[float]]]) -> tuple[PerfProfile, float, float, float]:
    """The router's form from single prompts; beside it the decode line's context term, a later chunk's
    cost per (new token x cached token) it reads back, and what an engine step costs beside the runner:
    (perf, decode per context token s, prefill per context token s, step overhead s)."""
    single = [(int(n), 0, s) for n, b, s in points["prefill"] if b == 1]
    d = np.array(points["decode"], dtype=float)
    if not single or not len(d):
        raise ValueError("the engine's cache holds none of the profile's shapes; raise --kv-cache-gb")
    perf = PerfProfile.fit(single, [(int(b), int(c), s) for b, c, s in d])
    if not perf.prefill_per_token_s + perf.prefill_per_token2_s > 0:  # no profile: a prompt must cost its tokens
        times = ", ".join(f"{n} tokens {s * 1e3:.2f} ms" for n, _, s in single)
        raise NoisyMeasurement(
            f"longer prompts prefilled no slower ({times}): this host's noise hid their cost; profile again on a "
            "quieter host, or without --quick (longer prompts)"
        )
    fixed, per_seq, per_context = perf.decode_fixed_s, perf.decode_per_seq_s, perf.decode_per_context_token_s
    # A later chunk costs what the same chunks at context 0 cost, plus its reads of the context.
    first = {(n, b): s for n, b, c, s in points.get("prefill_chunk", []) if c == 0}
    later = [(b * n * c, s - first[n, b]) for n, b, c, s in points.get("prefill_chunk", []) if c and (n, b) in first]
    reads, extra = np.array(later, dtype=float).reshape(-1, 2).T
    per_cached = float(nonneg_lstsq(reads[:, None], extra)[0]) if len(later) else 0.0
    engine = points.get("engine_decode", [])
    beside = [s - (fixed + per_seq * b + per_context * b * c) for b, c, s in engine]
    return perf, float(per_context), per_cached, max(0.0, statistics.median(beside)) if beside else 0.0


def transfer_endpoints(device: str) -> tuple[Backend, str]:
    """NCCL between two GPUs (one rank per GPU), as workers on a GPU node send; gloo otherwise (the CPU, or a
    single GPU, where NCCL cannot pair a device with itself)."""
    if device.startswith("cuda") and torch.cuda.device_count() >= 2:
        first = torch.device(device).index or 0
        return "nccl", f"cuda:{(first + 1) % torch.cuda.device_count()}"
    return "gloo", device


def measure_transfer(engine: Any, device: str, grid: Grid) -> tuple[float, float, list[list[float]]]:
    """Our KV transfer of a `transfer_tokens` prompt and of one 8x longer between two processes, fitted as a
    fixed latency plus bytes at a bandwidth: (GB/s, latency s, [[bytes, s], ...])."""
    from pdserve.bench.transfer_bench import TransferCase, run_transfer_bench

    mc, block_size = engine.model_config, engine.config.block_size
    cases = [
        TransferCase(
            name=f"{tokens} tokens",
            dtype=str(engine.runner.dtype).removeprefix("torch."),
            num_blocks=math.ceil(tokens / block_size),
            num_layers=mc.num_layers,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            block_size=block_size,
            pool_bytes=grid.transfer_pool_mib << 20,
        )
        for tokens in (grid.transfer_tokens, 8 * grid.transfer_tokens)
    ]
    backend, peer = transfer_endpoints(device)
    result = run_transfer_bench(
        cases, host=ClusterConfig.host, device=device, backend=backend, repeats=grid.transfer_repeats, peer_device=peer
    )
    points = [[c.nbytes, c.nbytes / (row["ours_gb_s"] * 1e9)] for c, row in zip(cases, result["rows"], strict=True)]
    return *fit_transfer(points), points


def fit_transfer(points: list[list[float]]) -> tuple[float, float]:
    """[[bytes, s], ...] as a latency plus bytes at a bandwidth: (GB/s, latency s). Where the larger transfers were
    no slower, the bytes cost less than the noise shows: 0 GB/s, which the profile reads as no cost per byte
    (HardwareProfile.transfer_s), and the latency is every transfer's mean. Any bandwidth there would add its bytes'
    time on top of a latency fitted without them."""
    x = np.array(points, dtype=float)
    latency, per_byte = nonneg_lstsq(np.stack([np.ones(len(x)), x[:, 0]], axis=1), x[:, 1])
    return (1e-9 / per_byte if per_byte > 0 else 0.0), float(latency)


def run_profile(config: EngineConfig, grid: Grid, transfer_gbps: float | None = None) -> HardwareProfile:
    """`transfer_gbps`: use it instead of measuring the transfer."""
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.model_runner import kv_block_bytes

    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    engine = LLMEngine(config)
    points = measure_steps(engine, grid)
    points["engine_decode"] = measure_engine_steps(engine, grid)
    perf, per_context, prefill_per_context, step_overhead = fit(points)
    device = engine.runner.device
    latency, backend = 0.0, "given"
    if transfer_gbps is None:
        backend = transfer_endpoints(str(device))[0]
        transfer_gbps, latency, points["transfer"] = measure_transfer(engine, str(device), grid)
    block_size = config.block_size
    s = config.scheduler
    return HardwareProfile(
        perf=perf,
        decode_per_context_token_s=per_context,
        prefill_per_context_token_s=prefill_per_context,
        step_overhead_s=step_overhead,
        kv_bytes_per_token=kv_block_bytes(engine.model_config, block_size, engine.runner.dtype) // block_size,
        kv_capacity_tokens=engine.blocks.num_blocks * block_size,
        transfer_gbps=transfer_gbps,
        transfer_latency_s=latency,
        max_num_seqs=s.max_num_seqs,
        max_num_batched_tokens=s.max_num_batched_tokens,
        long_prefill_chunk=s.long_prefill_chunk,
        meta={
            "model": config.model,
            "device": str(device),
            "dtype": str(engine.runner.dtype).removeprefix("torch."),
            "backend": backend,  # of the transfer measured ("given": --transfer-gbps)
            "threads": torch.get_num_threads(),
            "context_tokens": engine.model_config.max_position_embeddings,  # what the router lets a request use
        },
        points=points,
    )
