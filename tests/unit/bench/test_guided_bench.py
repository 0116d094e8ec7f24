"""The guided decoding bench on tiny-random: a row per case, the unconstrained one its own baseline, and the mask's
time on the engine thread only where rows are constrained."""

from __future__ import annotations

import pytest

from pdserve.bench.guided_bench import run_guided_bench
from pdserve.config import EngineConfig


def test_each_case_is_timed_against_the_unconstrained_batch() -> None:
    config = EngineConfig(model="tiny-random", dtype="float32", num_threads=1)
    result = run_guided_bench(config, batch=4, constrained=[4, 1, 4], prompt_len=8, steps=3, rounds=2)
    rows = {row["constrained"]: row for row in result["rows"]}
    assert [row["constrained"] for row in result["rows"]] == [0, 1, 4]  # each case once, however often asked
    assert rows[0]["mask_ms"] == 0.0
    assert all(rows[k]["mask_ms"] > 0 and rows[k]["step_ms"] > 0 for k in (1, 4))


def test_a_prompt_past_the_models_context_is_exit_2_in_a_line(capsys) -> None:
    from pdserve.cli import main

    argv = ["bench", "guided", "--model", "tiny-random", "--batch", "2", "--constrained", "1", "--threads", "1"]
    assert main([*argv, "--prompt-len", "100000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve bench guided: ") and len(err.splitlines()) == 1, err


def test_constrained_rows_must_fit_the_batch() -> None:
    with pytest.raises(ValueError, match="constrained rows"):
        run_guided_bench(EngineConfig(model="tiny-random"), batch=4, constrained=[5], prompt_len=8, steps=3, rounds=1)
