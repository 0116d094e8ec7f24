"""What `loadgen compare` warns of before comparing two result files: workloads that differ, so that the ratios
measure the workload as much as the servers. Read from what the files record: the backend, model, dataset, prompt
count, burstiness, concurrency bound and goodput bounds of each run, and the input and output lengths its
per-request records asked for (a vLLM result without those records is compared on what it has)."""

from __future__ import annotations

import json
from typing import Any

# Each run's recorded settings that shape its workload; the address (the servers compared) and the seed (the same
# lengths drawn afresh) are not among them.
SETTINGS = (
    "backend",
    "model_id",
    "dataset_name",
    "num_prompts",
    "burstiness",
    "max_concurrency",
    "goodput",
    "send_slo",
    "priority",
)
LENGTHS = {"input_len": "mean input length", "output_len": "mean output length"}
LENGTH_TOLERANCE = 0.05  # a length drawn with --random-range-ratio: its mean over a run moves by less than this


def workload_differences(runs_a: list[dict[str, Any]], runs_b: list[dict[str, Any]]) -> list[str]:
    """`name: A x, B y` for each recorded setting the two files' runs differ in; empty when they agree."""
    differences = []
    for key in SETTINGS:
        a, b = _values(runs_a, key), _values(runs_b, key)
        if a is not None and b is not None and a != b:
            differences.append(f"{key}: A {_show(a)}, B {_show(b)}")
    for key, name in LENGTHS.items():
        a_mean, b_mean = _mean(runs_a, key), _mean(runs_b, key)
        if a_mean is not None and b_mean is not None and abs(a_mean - b_mean) > LENGTH_TOLERANCE * max(a_mean, b_mean):
            differences.append(f"{name}: A {a_mean:.0f}, B {b_mean:.0f}")
    return differences


def _values(runs: list[dict[str, Any]], key: str) -> list[str] | None:
    """The distinct values the runs record for `key`, in a comparable form; None when no run records it."""
    if not any(key in run for run in runs):
        return None
    return sorted({json.dumps(run.get(key), sort_keys=True) for run in runs})


def _show(values: list[str]) -> str:
    return " / ".join(values)


def _mean(runs: list[dict[str, Any]], key: str) -> float | None:
    lengths = [r[key] for run in runs for r in run.get("requests") or () if isinstance(r.get(key), int | float)]
    return sum(lengths) / len(lengths) if lengths else None
