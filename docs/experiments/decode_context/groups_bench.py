"""A decode step of a batch mixing context lengths, its rows attended in groups of similar context
(model_runner._decode_groups) against one call padded to the longest, alternated in one process on one engine:
the model runner's step timed, the mean of `--repeats`, median over `--rounds`."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pdserve.config import EngineConfig
from pdserve.engine import model_runner
from pdserve.engine.engine import LLMEngine
from pdserve.engine.scheduler import ScheduledChunk

BATCHES = {"1x6000 + 7x64": [6000] + [64] * 7, "2x4000 + 6x500": [4000] * 2 + [500] * 6, "8x2048": [2048] * 8}


def decodes(engine: LLMEngine, contexts: list[int]) -> list[ScheduledChunk]:
    chunks, first = [], 0
    for i, context in enumerate(contexts):
        blocks = engine.blocks.blocks_for(context + 1)
        chunks.append(ScheduledChunk(f"s{i}", [1], context, list(range(first, first + blocks)), True))
        first += blocks
    return chunks


def step_s(engine: LLMEngine, chunks: list[ScheduledChunk], repeats: int) -> float:
    engine.runner.execute(chunks)
    start = time.perf_counter()
    for _ in range(repeats):
        engine.runner.execute(chunks)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(2)
    engine = LLMEngine(EngineConfig(model=args.model))
    slack = model_runner.GROUP_SLACK_TOKENS
    for name, contexts in BATCHES.items():
        chunks = decodes(engine, contexts)
        times: dict[str, list[float]] = {"grouped": [], "padded": []}
        for _ in range(args.rounds):
            for side in times:
                model_runner.GROUP_SLACK_TOKENS = slack if side == "grouped" else 10**9
                times[side].append(step_s(engine, chunks, args.repeats))
        grouped, padded = (statistics.median(times[side]) for side in ("grouped", "padded"))
        model_runner.GROUP_SLACK_TOKENS = slack
        groups = len(engine.runner._decode_groups(chunks))
        print(
            f"{name}: {groups} groups {grouped * 1e3:.0f} ms a step, one padded call {padded * 1e3:.0f} ms, "
            f"padded/grouped {padded / grouped:.2f}"
        )


if __name__ == "__main__":
    main()
