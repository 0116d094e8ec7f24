"""How a worker's start-up profile prices long prompts, against how long they take: the profile as workers measure
it (a quadratic through whole prompts of 64, 256 and 1024 tokens) and as it was tried (steps of 64, 256 and one
chunk at context 0, and a chunk after 3 and 7 chunks of context, least squares), each measured in the same round,
with and without another process loading the cores while the profile is measured; the prompts then run quiet,
chunk by chunk as the engine runs them. Prints JSON lines; report.py tabulates them."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from pdserve.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.scheduler import ScheduledChunk
from pdserve.protocol.perf_profile import PerfProfile

HOG = "import torch\ntorch.set_num_threads(2)\na = torch.randn(768, 768)\nwhile True:\n    a @ a\n"


def whole_prompt_profile(engine: LLMEngine, repeats: int = 2) -> PerfProfile:
    """Whole prompts of 64, 256 and 1024 tokens, each warmed up and timed as the mean of `repeats`, a quadratic
    through them (engine/profiling.py's prefill part)."""
    points = [(n, 0, run_chunks(engine, [(n, 0)], repeats, warm_up=True)) for n in (64, 256, 1024)]
    return PerfProfile.fit(points, [(1, 64, 0.0)])


def chunks_at_depth_profile(engine: LLMEngine, repeats: int = 2) -> PerfProfile:
    """The alternative tried: steps of 64, 256 and one chunk at context 0 (warmed up), and a chunk after 3 and 7
    chunks of context (its shapes warm already), least squares over the five."""
    chunk = engine.config.scheduler.long_prefill_chunk
    steps = [(64, 0), (256, 0), (chunk, 0), (chunk, 3 * chunk), (chunk, 7 * chunk)]
    points = [(n, c, run_chunks(engine, [(n, c)], repeats, warm_up=not c)) for n, c in steps]
    return PerfProfile.fit(points, [(1, 64, 0.0)])


def run_chunks(engine: LLMEngine, steps: list[tuple[int, int]], repeats: int = 1, warm_up: bool = False) -> float:
    """Seconds to run these (new tokens, context) steps one after another on scratch blocks, the mean of
    `repeats`."""
    gen = torch.Generator().manual_seed(1)
    chunks = [
        ScheduledChunk(
            "bench",
            torch.randint(0, engine.model_config.vocab_size, (n,), generator=gen).tolist(),
            context,
            list(range(engine.blocks.blocks_for(context + n))),
            True,
        )
        for n, context in steps
    ]
    if warm_up:
        for chunk in chunks:
            engine.runner.execute([chunk])
    start = time.perf_counter()
    for _ in range(repeats):
        for chunk in chunks:
            engine.runner.execute([chunk])
    return (time.perf_counter() - start) / repeats


def prompt_steps(tokens: int, chunk: int) -> list[tuple[int, int]]:
    return [(min(chunk, tokens - done), done) for done in range(0, tokens, chunk)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, nargs="+", default=[1024, 2048, 3873, 6000])
    args = ap.parse_args()
    torch.set_num_threads(2)
    engine = LLMEngine(EngineConfig(model=args.model))
    chunk = engine.config.scheduler.long_prefill_chunk
    for round_ in range(args.rounds):
        for loaded in (False, True):
            hog = subprocess.Popen([sys.executable, "-c", HOG]) if loaded else None
            try:
                time.sleep(1.0 if hog else 0.0)
                start = time.perf_counter()
                whole = whole_prompt_profile(engine)
                whole_took_s = time.perf_counter() - start
                start = time.perf_counter()
                depth = chunks_at_depth_profile(engine)
                depth_took_s = time.perf_counter() - start
            finally:
                if hog:
                    hog.kill()
                    hog.wait()
            for tokens in args.prompts:
                measured = run_chunks(engine, prompt_steps(tokens, chunk))
                row = {
                    "round": round_,
                    "profile_under_load": loaded,
                    "tokens": tokens,
                    "measured_s": measured,
                    "whole_s": whole.prefill_s(tokens),
                    "depth_s": depth.prefill_s(tokens) + (-(-tokens // chunk) - 1) * depth.prefill_fixed_s,
                    "whole_profile_took_s": whole_took_s,
                    "depth_profile_took_s": depth_took_s,
                }
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
