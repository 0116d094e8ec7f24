"""Whole decode steps with the CPU engine's heap settings (host_heap.py) on and off, one process per arm.

The runner calls `keep_large_allocations_in_heap` when it starts on a CPU; the "off" arm patches that call out, so
each process runs glibc's defaults or the raised thresholds for its whole life (mallopt cannot be undone). Arms
alternate, so a change in the host's load falls on both. Prints the mean engine step (ms) per batch.

    .venv/bin/python docs/experiments/decode_context/heap_ab.py --rounds 3
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

CASES = [[6000], [6000] * 2, [2048] * 8, [1024]]


def one_arm(arm: str, threads: int) -> None:
    """In this process: the engine, with the heap settings or without, and its steps for each case."""
    import pdserve.engine.model_runner as model_runner

    if arm == "off":
        model_runner.keep_large_allocations_in_heap = lambda: False  # type: ignore[assignment]
    sys.path.insert(0, str(Path(__file__).parent))
    from tpot_context import _measure

    from pdserve.config import EngineConfig, SchedulerConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.protocol.roles import EngineMode

    blocks = max(map(len, CASES)) * (-(-(max(map(max, CASES)) + 20) // EngineConfig.block_size) + 1)
    scheduler = SchedulerConfig(mode=EngineMode.DECODE_ONLY)
    config = EngineConfig(model="smollm2-135m", num_threads=threads, num_kv_blocks=blocks, scheduler=scheduler)
    engine = LLMEngine(config)
    for contexts in CASES:
        print(f"{arm} | {len(contexts)} x {contexts[0]} | {_measure(engine, contexts, 8) * 1e3:.0f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--arm", choices=["on", "off"], help="run one arm in this process (what the rounds spawn)")
    args = parser.parse_args()
    if args.arm:
        one_arm(args.arm, args.threads)
        return
    print("heap settings | batch | step ms")
    for _ in range(args.rounds):
        for arm in ("on", "off"):
            cmd = [sys.executable, __file__, "--arm", arm, "--threads", str(args.threads)]
            subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
