"""Does a profile point deep in a long context steady the price of prompts far past the profile's largest point?

One start-up profile per process, as a worker measures it (`measure_profile`), with the prefill shapes of the
`--variant` asked for; prints its terms, its own time and the idle prices of `--prices` prompt lengths (whole
prompts, chunked as a worker runs them: the router prices the squares of a whole prompt). Run each variant in
fresh processes, alternating, with and without a neighbour loading the cores (`--burst-seed`); `--variant run`
instead runs those prompts (random tokens, chunk by chunk as a worker runs one alone) and prints what they took:

    PYTHONPATH=src python docs/experiments/long_prompt_pricing/deep_point.py --variant deep256 [--burst-seed 3]
    PYTHONPATH=src python docs/experiments/long_prompt_pricing/deep_point.py --variant run
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import time

import torch

from pdserve.config import EngineConfig
from pdserve.engine import profiling
from pdserve.engine.engine import LLMEngine
from pdserve.protocol.engine_request import EngineRequest
from pdserve.protocol.sampling import SamplingParams

BASE = ((64, 0), (256, 0), (1024, 0), (256, 1024))  # the worker's shapes before this experiment
VARIANTS = {"base": BASE, "deep256": (*BASE, (256, 3840)), "deep512": (*BASE, (512, 3584))}


def burst(seed: int, seconds: float) -> None:
    """A bursty neighbour: matrix products on 2 threads for 0.5-3 s, then idle 0.5-3 s."""
    torch.set_num_threads(2)
    rng, a = random.Random(seed), torch.randn(512, 512)
    end = time.time() + seconds
    while time.time() < end:
        busy_until = time.time() + rng.uniform(0.5, 3)
        while time.time() < busy_until:
            a @ a
        time.sleep(rng.uniform(0.5, 3))


def run_prompts(engine: LLMEngine, lengths: list[int]) -> None:
    gen = torch.Generator().manual_seed(1)
    for n in lengths:
        ids = torch.randint(0, engine.model_config.vocab_size, (n,), generator=gen).tolist()
        engine.add_request(EngineRequest(f"r{n}", ids, SamplingParams(max_tokens=1)))
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        print(json.dumps({"variant": "run", "tokens": n, "took_s": round(time.perf_counter() - start, 2)}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--variant", choices=[*sorted(VARIANTS), "run"], required=True)
    parser.add_argument("--burst-seed", type=int, help="load the cores as a bursty neighbour while profiling")
    parser.add_argument("--prices", type=int, nargs="+", default=[1024, 4000, 8160])
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, dtype="float32", num_threads=1, num_kv_blocks=2048))
    if args.variant == "run":
        run_prompts(engine, args.prices)
        return
    shapes = VARIANTS[args.variant]
    measured = profiling._prefill_points
    profiling._prefill_points = lambda e, timed, gen: measured(e, timed, gen, shapes)  # type: ignore[assignment]
    neighbour = None
    if args.burst_seed is not None:
        neighbour = multiprocessing.Process(target=burst, args=(args.burst_seed, 600.0), daemon=True)
        neighbour.start()
    start = time.perf_counter()
    profile = profiling.measure_profile(engine)
    took = time.perf_counter() - start
    if neighbour is not None:
        neighbour.terminate()
    record = {
        "variant": args.variant,
        "burst_seed": args.burst_seed,
        "profile_s": round(took, 1),
        "per_token_s": profile.prefill_per_token_s,
        "per_square_s": profile.prefill_per_token2_s,
        **{f"price_{n}": round(profile.prefill_s(n), 2) for n in args.prices},
    }
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
