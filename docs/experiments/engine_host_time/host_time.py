"""The engine's host time per sequence per decode step: everything a step does outside the model's forward
pass and LM head (scheduling, inputs, sampling, detokenizing, outputs), in the main thread's CPU time so a
noisy neighbour's load counts less. On a GPU with decode in CUDA graphs the model's part of a step shrinks
to a replay; what this measures is then most of the step.

    PYTHONPATH=src python docs/experiments/engine_host_time/host_time.py --batch 32 --context 512 --steps 300
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from pdserve.config import EngineConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.protocol.engine_request import EngineRequest
from pdserve.protocol.sampling import SamplingParams


def measure(batch: int, context: int, steps: int) -> dict[str, Any]:
    config = EngineConfig(
        model="tiny-random",
        dtype="float32",
        device="cpu",
        num_threads=1,
        num_kv_blocks=batch * ((context + steps + 60) // 16 + 2),  # no preemption: every step decodes them all
        scheduler=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=8192, long_prefill_chunk=8192),
    )
    engine = LLMEngine(config)
    for i in range(batch):
        prompt = [3 + (i + j) % 250 for j in range(context)]
        engine.add_request(EngineRequest(f"r{i}", prompt, SamplingParams(max_tokens=steps + 50, ignore_eos=True)))
    for _ in range(10):  # the prompts, then a few decode steps
        engine.step()
    model = engine.runner.model
    in_model = 0.0

    def timed(method: Callable[..., Any]) -> Callable[..., Any]:
        """`method` (the model's forward or LM head), adding its thread CPU time to `in_model`."""

        def call(*args: Any) -> Any:
            nonlocal in_model
            start = time.thread_time()
            out = method(*args)
            in_model += time.thread_time() - start
            return out

        return call

    model.forward, model.compute_logits = timed(model.forward), timed(model.compute_logits)
    start = time.thread_time()
    for _ in range(steps):
        assert len(engine.step()) == batch
    total = time.thread_time() - start
    host = total - in_model
    return {
        "batch": batch,
        "context": context,
        "steps": steps,
        "step_ms": total / steps * 1e3,
        "model_ms": in_model / steps * 1e3,
        "host_us_per_seq": host / steps / batch * 1e6,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args()
    print(json.dumps(measure(args.batch, args.context, args.steps)))


if __name__ == "__main__":
    main()
