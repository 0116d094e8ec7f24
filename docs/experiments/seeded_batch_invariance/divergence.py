"""How often does a seeded completion change with what shares its batch? Each seeded request runs alone, then in
one continuous batch with the others (prompts of different lengths, so the batch's shape changes as they finish);
a completion whose tokens differ from its run alone counts, with the position of its first different token.

    PYTHONPATH=src python docs/experiments/seeded_batch_invariance/divergence.py --requests 48 --tokens 64

Greedy and the model are the same in both runs, so a difference is the sampler's response to the ~1e-4 a batch
moves the logits by. Prints one JSON line per temperature.
"""

from __future__ import annotations

import argparse
import json
import random

from pdserve.config import EngineConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.protocol.sampling import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[1.0])
    args = parser.parse_args()
    scheduler = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096)
    engine = LLMEngine(EngineConfig(model=args.model, dtype="float32", num_threads=1, scheduler=scheduler))
    text = engine.tokenizer.encode(
        "The history of the printing press begins in East Asia, where woodblock printing was used on cloth "
        "and later on paper. Movable type followed, first of baked clay and later of metal, and spread west. "
    )
    rng = random.Random(0)
    prompts = [(text * 8)[rng.randrange(200) :][: rng.randrange(8, 300)] for _ in range(args.requests)]
    for temperature in args.temperatures:
        params = [
            SamplingParams(max_tokens=args.tokens, temperature=temperature, seed=1000 + i, ignore_eos=True)
            for i in range(args.requests)
        ]
        alone = [engine.generate([p], [s])[0].token_ids for p, s in zip(prompts, params, strict=True)]
        together = [c.token_ids for c in engine.generate(prompts, params)]
        first_differ = [
            next(i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b)
            for x, y in zip(alone, together, strict=True)
            if x != y
        ]
        print(
            json.dumps(
                {
                    "temperature": temperature,
                    "requests": args.requests,
                    "tokens": args.tokens,
                    "diverged": len(first_differ),
                    "first_different_token": sorted(first_differ),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
