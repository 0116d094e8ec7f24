"""Datasets: what each request sends (prompt token ids) and how many tokens it asks back.

Prompts are random token ids, so a run measures the serving system, not the text. Every run of a
sweep draws its own prompts (the caller passes a fresh generator): the server's prefix cache must not
turn a later rate's prefills into cache hits.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdserve.trace import read_trace

DATASETS = ("random", "sharegpt-synthetic", "prefix-repetition", "trace")
FIRST_TOKEN_ID = 3  # ids below are special tokens (pad/bos/eos) in the built-in models
TRACE_BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake trace format

# Lognormal (mu, sigma) of ShareGPT lengths, in tokens. The means after vLLM's filter below match the
# published ShareGPT means (161 input, 338 output tokens; Kwon et al. 2023, the vLLM paper); the sigmas
# are our choice, giving the heavy right tail (median input ~97, output ~230).
SHAREGPT_INPUT = (4.62, 1.2)
SHAREGPT_OUTPUT = (5.47, 0.95)
SHAREGPT_MIN_LEN, SHAREGPT_MAX_INPUT, SHAREGPT_MAX_TOTAL = 4, 1024, 2048  # vLLM's ShareGPT filter


@dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]
    output_len: int
    arrival_s: float = 0.0  # offset from the run's start; set by the trace or by arrivals.schedule

    @property
    def input_len(self) -> int:
        return len(self.prompt_token_ids)


# Ten times the most `pdserve plan --num-requests` simulates: 50 s at the 20,000 req/s one loadgen process sends
# (request_rate.py), hours at a rate a cluster serves. Every prompt is built before the first is sent, 41 bytes a token
# (measured): 10**8 of the default 1024 tokens would need 4 TB; a million of them is still 42 GB, so count and
# --random-input-len together bound the memory, this only the count.
MAX_NUM_PROMPTS = 1_000_000
AT_LEAST_ONE = {  # field -> its flag
    "num_prompts": "--num-prompts",
    "random_input_len": "--random-input-len",
    "random_output_len": "--random-output-len",
    "num_prefixes": "--prefix-repetition-num-prefixes",
    "prefix_output_len": "--prefix-repetition-output-len",
}


@dataclass(frozen=True)
class WorkloadConfig:
    """What to send; loadgen's flags take their defaults from here (`--random-input-len` -> random_input_len)."""

    dataset_name: str = "random"  # one of DATASETS
    num_prompts: int = 1000  # requests per rate (a trace: at most this many)
    vocab_size: int = 49152  # prompt ids are drawn below this (the served model's vocabulary)
    random_input_len: int = 1024  # random and sharegpt-synthetic: prompt tokens
    random_output_len: int = 128  # ... and output tokens
    random_range_ratio: float = 0.0  # lengths uniform in len * [1 - r, 1 + r]
    prefix_len: int = 256  # prefix-repetition: shared prefix tokens
    suffix_len: int = 256  # ... each request's own suffix tokens
    num_prefixes: int = 10  # ... distinct prefixes
    prefix_output_len: int = 128  # ... output tokens
    trace: Path | None = None  # Mooncake-format JSONL: timestamp (ms), input_length, output_length

    def __post_init__(self) -> None:
        if self.dataset_name not in DATASETS:
            raise ValueError(f"dataset must be one of {DATASETS}, got {self.dataset_name!r}")
        if not 0 <= self.random_range_ratio < 1:
            raise ValueError(f"--random-range-ratio must be in [0, 1), got {self.random_range_ratio}")
        if self.dataset_name == "trace" and self.trace is None:
            raise ValueError("--dataset-name trace needs --trace PATH")
        for name, flag in AT_LEAST_ONE.items():
            if getattr(self, name) < 1:
                raise ValueError(f"{flag} must be at least 1, got {getattr(self, name)}")
        if self.num_prompts > MAX_NUM_PROMPTS:
            raise ValueError(f"--num-prompts must be at most {MAX_NUM_PROMPTS:,}, got {self.num_prompts:,}")
        if self.vocab_size <= FIRST_TOKEN_ID:
            raise ValueError(f"vocab size {self.vocab_size} leaves no ordinary token ids")


def build_workload(config: WorkloadConfig, rng: np.random.Generator) -> list[Request]:
    builders = {
        "random": _random,
        "sharegpt-synthetic": _sharegpt_synthetic,
        "prefix-repetition": _prefix_repetition,
        "trace": _trace,
    }
    return builders[config.dataset_name](config, rng)


def _tokens(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    return rng.integers(FIRST_TOKEN_ID, vocab_size, size=n).tolist()


def _lengths(rng: np.random.Generator, length: int, ratio: float, n: int) -> np.ndarray:
    """Uniform integers in [length * (1 - ratio), length * (1 + ratio)], as vLLM's random dataset; at least 1."""
    low, high = max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))
    return rng.integers(low, high + 1, size=n)


def _random(c: WorkloadConfig, rng: np.random.Generator) -> list[Request]:
    inputs = _lengths(rng, c.random_input_len, c.random_range_ratio, c.num_prompts)
    outputs = _lengths(rng, c.random_output_len, c.random_range_ratio, c.num_prompts)
    return [Request(_tokens(rng, int(i), c.vocab_size), int(o)) for i, o in zip(inputs, outputs, strict=True)]


def _sharegpt_synthetic(c: WorkloadConfig, rng: np.random.Generator) -> list[Request]:
    requests: list[Request] = []
    while len(requests) < c.num_prompts:
        i = max(SHAREGPT_MIN_LEN, round(rng.lognormal(*SHAREGPT_INPUT)))
        o = max(SHAREGPT_MIN_LEN, round(rng.lognormal(*SHAREGPT_OUTPUT)))
        if i <= SHAREGPT_MAX_INPUT and i + o <= SHAREGPT_MAX_TOTAL:
            requests.append(Request(_tokens(rng, i, c.vocab_size), o))
    return requests


def _prefix_repetition(c: WorkloadConfig, rng: np.random.Generator) -> list[Request]:
    """`num_prefixes` shared prefixes, each used by an equal share of the prompts, in shuffled order."""
    prefixes = [_tokens(rng, c.prefix_len, c.vocab_size) for _ in range(c.num_prefixes)]
    order = rng.permutation(np.arange(c.num_prompts) % c.num_prefixes)
    return [Request(prefixes[p] + _tokens(rng, c.suffix_len, c.vocab_size), c.prefix_output_len) for p in order]


def _trace(c: WorkloadConfig, rng: np.random.Generator) -> list[Request]:
    """Mooncake-format JSONL (pdserve.trace: read and checked as `pdserve plan` reads it) replayed from its first
    timestamp, in timestamp order (requests are sent in list order: a line stamped earlier than the one before it
    would otherwise go late, its wait counted as TTFT); equal hash ids give equal prompt blocks."""
    assert c.trace is not None
    lines = read_trace(c.trace, c.num_prompts)
    start_ms = lines[0].timestamp_ms
    seed = int(rng.integers(2**63))  # one seed for the whole trace, so a hash id means one block everywhere
    requests = []
    for line in lines:
        prompt: list[int] = []
        for hash_id in line.hash_ids:
            prompt += _tokens(np.random.default_rng([seed, hash_id]), TRACE_BLOCK_TOKENS, c.vocab_size)
        n = line.input_length
        prompt = prompt[:n] + _tokens(rng, max(0, n - len(prompt)), c.vocab_size)
        requests.append(Request(prompt, line.output_length, (line.timestamp_ms - start_ms) / 1e3))
    return requests
