"""A worker's start-up profile with and without a chunk after a cached prefix, against real engine steps.

One engine (smollm2-135m, one thread, the prefill worker's scheduling: one prompt a step, chunks of 512) times the
profile's points as a worker does (`_prefill_points`, `_decode_points`: whole prompts and one chunk of 256 new
tokens after 1024 cached) and fits them twice: whole prompts alone (the profile before) and with the cached point.
Then it runs a conversation (a 2048-token first turn, then turns of 256 new tokens, each after all before it,
cached), fresh 256- and 1024-token prompts, and 3000-token prompts chunk by chunk, and prints each class's median
measured / predicted step time (a long prompt's whole also summed over its chunks) under either fit. Run it a few
times: the point is how far one run's profile moves the price.

    .venv/bin/python docs/experiments/long_prompt_pricing/cached_point.py --runs 3
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch

from pdserve.config import EngineConfig, SchedulerConfig
from pdserve.engine.device import synchronize
from pdserve.engine.engine import LLMEngine
from pdserve.engine.profiling import _decode_points, _prefill_points
from pdserve.protocol.engine_request import EngineRequest
from pdserve.protocol.perf_profile import PerfProfile, QueuedPrefill
from pdserve.protocol.sampling import SamplingParams

Step = tuple[int, int, float]  # a prefill step's new tokens, attention squares, seconds


def steps(engine: LLMEngine, request_id: str, prompt: list[int]) -> list[Step]:
    engine.add_request(EngineRequest(request_id, prompt, SamplingParams(max_tokens=1)))
    out = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - start
        if engine.last_step_tokens > 1:
            out.append((engine.last_step_tokens, engine.last_step_prefill_squares, seconds))
    return out


def one_run(name: str) -> None:
    scheduler = SchedulerConfig(max_num_batched_tokens=512, long_prefill_chunk=512, max_prefills_per_step=1)
    engine = LLMEngine(EngineConfig(model="smollm2-135m", num_threads=1, num_kv_blocks=2048, scheduler=scheduler))

    def timed(chunks: list) -> float:  # as measure_profile times a shape: a warm-up, then the mean of two
        engine.runner.execute(chunks)
        synchronize(engine.runner.device)
        start = time.perf_counter()
        for _ in range(2):
            engine.runner.execute(chunks)
        synchronize(engine.runner.device)
        return (time.perf_counter() - start) / 2

    prefill = _prefill_points(engine, timed, torch.Generator().manual_seed(0))
    decode = _decode_points(engine, timed)
    fits = {"whole prompts": PerfProfile.fit([p for p in prefill if not p[1]], decode)}
    fits["and the cached point"] = PerfProfile.fit(prefill, decode)
    vocab = engine.model_config.vocab_size
    classes: dict[str, list[Step]] = {"chat turn": [], "fresh 256": [], "fresh 1024": [], "3000 chunks": []}
    whole: list[list[Step]] = []
    conversation = [(i * 7919) % vocab for i in range(2048)]
    steps(engine, "c0", conversation)
    for turn in range(1, 5):
        conversation = conversation + [(turn * 131 + i * 31) % vocab for i in range(256)]
        classes["chat turn"] += steps(engine, f"c{turn}", conversation)
        classes["fresh 256"] += steps(engine, f"f{turn}", [(turn * 977 + i * 17) % vocab for i in range(256)])
    for k in range(2):
        classes["fresh 1024"] += steps(engine, f"g{k}", [(k * 577 + i * 13) % vocab for i in range(1024)])
        whole.append(steps(engine, f"l{k}", [(k * 373 + i * 11) % vocab for i in range(3000)]))
        classes["3000 chunks"] += whole[-1]
    for fit, profile in fits.items():
        ratios = {
            c: statistics.median(s / profile.queued_prefill_s(QueuedPrefill(1, n, q)) for n, q, s in rows)
            for c, rows in classes.items()
        }
        ratios["3000 whole"] = statistics.median(
            sum(s for *_, s in chunks) / sum(profile.queued_prefill_s(QueuedPrefill(1, n, q)) for n, q, _ in chunks)
            for chunks in whole
        )
        shown = " | ".join(f"{r:.2f}" for r in ratios.values())
        print(f"{name} | {fit} | {profile.prefill_per_token2_s:.2e} | {shown}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--run", help="one run in this process (what --runs spawns)")
    args = parser.parse_args()
    if args.run:
        one_run(args.run)
        return
    print("run | fit | attention s/square | chat turn | fresh 256 | fresh 1024 | 3000 chunks | 3000 whole")
    for run in range(1, args.runs + 1):
        subprocess.run([sys.executable, __file__, "--run", str(run)], check=True)


if __name__ == "__main__":
    main()
