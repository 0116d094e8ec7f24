"""A decode worker's measured TPOT against the router's prediction, with long contexts in its batch.

A decode-only engine, profiled at start-up as a worker profiles itself, takes `batch` sequences of `context`
prompt tokens each through `reserve` and `commit` as a hand-off does (their KV is never sent: what the blocks hold
does not change a step's cost), then runs real engine steps. The prediction is the router's for the last of them:
`Predictor.tpot_s` on the worker's state as it reported it with the others decoding (speed factor 1, a fresh
profile), for a request of that context and max_tokens. Prints measured / predicted per (batch, context), and
for a mixed batch (one long context, the rest short).

    .venv/bin/python docs/experiments/decode_context/tpot_context.py --model smollm2-135m
"""

from __future__ import annotations

import argparse
import statistics
import time

from pdserve.config import EngineConfig, RouterConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.profiling import measure_profile
from pdserve.protocol.engine_request import EngineRequest
from pdserve.protocol.perf_profile import PerfProfile
from pdserve.protocol.roles import EngineMode, Role
from pdserve.protocol.sampling import SamplingParams
from pdserve.registry.base import WorkerState
from services.router.load_tracker import LoadTracker
from services.router.predictor import Predictor, own_context_tokens


def _state(engine: LLMEngine, profile: PerfProfile) -> WorkerState:
    """What the worker would publish now (worker_runtime.state's load and profile fields)."""
    s = engine.stats()
    return WorkerState(
        worker_id="d0",
        role=Role.DECODE,
        address="",
        block_size=engine.config.block_size,
        kv_blocks_total=s["kv_blocks_total"],
        kv_blocks_free=s["kv_blocks_free"],
        kv_blocks_owed=s["kv_blocks_owed"],
        running=s["running"],
        sequences=s["sequences"],
        max_num_seqs=engine.config.scheduler.max_num_seqs,
        profile=profile,
    )


def _add(engine: LLMEngine, request_id: str, context: int, steps: int) -> None:
    prompt = [i % engine.model_config.vocab_size for i in range(context)]
    engine.reserve(EngineRequest(request_id, prompt, SamplingParams(max_tokens=steps + 2, ignore_eos=True)))
    engine.commit(request_id, 5)


def _measure(engine: LLMEngine, contexts: list[int], steps: int) -> float:
    """The mean decode step of a batch of sequences at `contexts`, through `engine.step()`."""
    for i, c in enumerate(contexts):
        _add(engine, f"s{i}", c, steps)
    engine.step()  # warm-up: this shape's kernels
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        assert engine.last_step_tokens == len(contexts), "every sequence decodes every step"
    while engine.has_unfinished():
        engine.step()
    return statistics.mean(times)


def _predict(engine: LLMEngine, profile: PerfProfile, contexts: list[int], steps: int) -> float:
    """The router's TPOT for the last sequence joining the others (committed: each reported running)."""
    for i, c in enumerate(contexts[:-1]):
        _add(engine, f"o{i}", c, steps)
    w = _state(engine, profile)
    predictor = Predictor(RouterConfig(), LoadTracker())
    predicted = predictor.tpot_s(w, own_context_tokens(contexts[-1], steps + 2))
    while engine.has_unfinished():
        engine.step()
    return predicted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 2048, 6000])
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    longest = max(args.contexts)
    blocks = max(args.batches) * (-(-(longest + args.steps + 2) // EngineConfig.block_size) + 1)
    scheduler = SchedulerConfig(mode=EngineMode.DECODE_ONLY)
    config = EngineConfig(model=args.model, num_threads=args.threads, num_kv_blocks=blocks, scheduler=scheduler)
    engine = LLMEngine(config)
    start = time.perf_counter()
    profile = measure_profile(engine)
    print(f"start-up profile: {time.perf_counter() - start:.1f} s; {profile}")
    cases = [[c] * b for c in args.contexts for b in args.batches]
    cases.append([longest] + [min(args.contexts)] * (max(args.batches) - 1))  # one long context among short ones
    print("batch | contexts | measured ms | predicted ms | measured / predicted")
    for contexts in cases:
        measured = _measure(engine, contexts, args.steps)
        predicted = _predict(engine, profile, contexts, args.steps)
        shown = f"{contexts[0]}" if len(set(contexts)) == 1 else f"{contexts[0]} + {len(contexts) - 1}x{contexts[1]}"
        print(
            f"{len(contexts):5d} | {shown:>8} | {measured * 1e3:11.1f} | {predicted * 1e3:12.1f} | "
            f"{measured / predicted:5.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
