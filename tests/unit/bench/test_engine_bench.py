"""The engine bench on tiny-random: its rows, the GEMM floor beside each, and what the floor times."""

from __future__ import annotations

import pytest
import torch

from pdserve.bench.engine_bench import run_engine_bench
from pdserve.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.model import Linear


def test_projections_are_every_gemm_of_the_model_once() -> None:
    model = LLMEngine(EngineConfig(model="tiny-random")).model
    listed = model.projections()
    every = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(listed) == len({id(p) for p in listed}) == len(every)
    assert {id(p) for p in listed} == {id(p) for p in every}
    assert listed[-1] is model.lm_head


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bench_reports_each_row_against_transformers_and_the_gemm_floor(dtype: str) -> None:
    result = run_engine_bench(
        EngineConfig(model="tiny-random", dtype=dtype, num_threads=torch.get_num_threads()),
        batch_sizes=[1, 3],
        prompt_len=64,
        decode_prompt_len=8,
        decode_tokens=4,
        compare_transformers=True,
    )
    rows = {row["name"]: row for row in result["rows"]}
    assert list(rows) == ["prefill", "decode B=1", "decode B=3"]
    for row in rows.values():
        assert row["pdserve_tok_s"] > 0 and row["transformers_tok_s"] > 0
        assert row["ratio"] == pytest.approx(row["pdserve_tok_s"] / row["transformers_tok_s"])
        # A whole step cannot beat its own GEMMs: on tiny-random they are a small part of it.
        assert 0 < row["pdserve_share_of_floor"] < 1
        assert row["floor_ratio"] == pytest.approx(row["gemm_floor_tok_s"] / row["transformers_tok_s"])
