"""The guided decoding bench on tiny-random: a row per case, the unconstrained one its own baseline, and the mask's
time on the engine thread only where rows are constrained."""

from __future__ import annotations

import pytest

from pdserve.bench.guided_bench import run_guided_bench
from pdserve.config import EngineConfig


def test_each_case_is_timed_against_the_unconstrained_batch() -> None:
    config = EngineConfig(model="tiny-random", dtype="float32", num_threads=1)
    result = run_guided_bench(config, batch=4, constrained=[1, 4], prompt_len=8, steps=3, rounds=2)
    rows = {row["constrained"]: row for row in result["rows"]}
    assert list(rows) == [0, 1, 4]
    assert rows[0]["vs_unconstrained"] == 1.0 and rows[0]["mask_ms"] == 0.0
    assert all(rows[k]["mask_ms"] > 0 and rows[k]["step_ms"] > 0 for k in (1, 4))


def test_constrained_rows_must_fit_the_batch() -> None:
    with pytest.raises(ValueError, match="constrained rows"):
        run_guided_bench(EngineConfig(model="tiny-random"), batch=4, constrained=[5], prompt_len=8, steps=3, rounds=1)
