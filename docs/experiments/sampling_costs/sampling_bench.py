"""What a decode step's sampler costs with each per-request feature, against plain greedy in the same run.

One step's logits for B rows of SmolLM2's vocabulary (49,152): standard normal (flat: a top-p nucleus of most
of the vocabulary) and, for the "peaked" settings, the same times 8 (a nucleus of a few tokens, as a model's
mostly are); every row has a prompt of P tokens and an output of O tokens so far (the histories penalties
read). Each setting is timed over many calls, the settings interleaved round by round so a noisy host slows
them alike; the median round is printed, and its ratio to plain greedy.

    PYTHONPATH=src python docs/experiments/sampling_costs/sampling_bench.py [--device cuda]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np
import torch

from pdserve.engine.sampler import Sampler
from pdserve.protocol.sampling import SamplingParams

VOCAB = 49_152
SETTINGS = {
    "greedy": SamplingParams(),
    "temperature 1.0": SamplingParams(temperature=1.0),
    "temperature 1.0, seeded": SamplingParams(temperature=1.0, seed=1),
    "temperature 0.8, top-p 0.9": SamplingParams(temperature=0.8, top_p=0.9),
    "the same, peaked logits": SamplingParams(temperature=0.8, top_p=0.9),
    "top-k 50": SamplingParams(temperature=1.0, top_k=50),
    "top-k 50, top-p 0.9": SamplingParams(temperature=1.0, top_k=50, top_p=0.9),
    "top-k 50, seeded": SamplingParams(temperature=1.0, top_k=50, seed=1),
    "peaked top-p 0.9, seeded": SamplingParams(temperature=0.8, top_p=0.9, seed=1),
    "repetition 1.1": SamplingParams(repetition_penalty=1.1),
    "presence 0.5 + frequency 0.5": SamplingParams(presence_penalty=0.5, frequency_penalty=0.5),
    "logit_bias, 16 tokens": SamplingParams(logit_bias=tuple((t, -5.0) for t in range(16))),
    "logprobs 5": SamplingParams(logprobs=5),
}


def step(sampler: Sampler, logits: torch.Tensor, params: SamplingParams, histories: list) -> None:
    rows = len(histories)
    seeded = [None if params.seed is None else (params.seed + row, 100) for row in range(rows)]
    tokens = sampler(logits, [params] * rows, seeded, histories if params.penalized else None)
    if params.logprobs is not None:
        sampler.logprobs(logits, tokens, list(range(rows)), [params.logprobs] * rows)
    if logits.is_cuda:
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(1)
    rng = random.Random(0)
    sampler = Sampler()
    for rows, prompt_len, output_len in [(1, 512, 128), (32, 1000, 200), (64, 4000, 500)]:
        logits = torch.randn(rows, VOCAB, device=device)
        histories = [
            (
                np.unique(np.array([rng.randrange(VOCAB) for _ in range(prompt_len)])),
                [rng.randrange(VOCAB) for _ in range(output_len)],
            )
            for _ in range(rows)
        ]
        times: dict[str, list[float]] = {name: [] for name in SETTINGS}
        for _ in range(args.rounds):
            for name, params in SETTINGS.items():
                start = time.perf_counter()
                given = logits * 8 if "peaked" in name else logits
                for _ in range(args.calls):
                    step(sampler, given, params, histories)
                times[name].append((time.perf_counter() - start) / args.calls)
        base = statistics.median(times["greedy"])
        print(f"B={rows}, prompt {prompt_len}, output {output_len}, {device}:")
        for name, samples in times.items():
            median = statistics.median(samples)
            print(f"  {name:30s} {median * 1e3:8.2f} ms  x{median / base:5.2f}")


if __name__ == "__main__":
    main()
