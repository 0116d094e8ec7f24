"""The engine bench on tiny-random: its rows, the GEMM floor beside each, and what the floor times."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from pdserve.bench.bandwidth import weight_bytes_per_step
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
        rounds=2,
    )
    assert result["decode_steps"] == "eager"  # decode graphs are captured on CUDA only
    rows = {row["name"]: row for row in result["rows"]}
    assert list(rows) == ["prefill", "decode B=1", "decode B=3"]
    for row in rows.values():
        ours, theirs, floor = (row["per_round"][k] for k in ("pdserve", "transformers", "floor"))
        assert len(ours) == len(theirs) == len(floor) == 2
        assert row["pdserve_tok_s"] == pytest.approx(statistics.median(ours)) and row["pdserve_tok_s"] > 0
        assert row["transformers_tok_s"] == pytest.approx(statistics.median(theirs)) and row["transformers_tok_s"] > 0
        # Ratios pair the figures of one round, not the medians.
        assert row["ratio"] == pytest.approx(statistics.median(o / t for o, t in zip(ours, theirs, strict=True)))
        assert row["floor_ratio"] == pytest.approx(statistics.median(f / t for f, t in zip(floor, theirs, strict=True)))
        # The share is the floor's time over the step's (a whole step cannot beat its own GEMMs); that it is below
        # 1 is a timing, which a machine loaded by other tests can upset in a round: only its computation is held.
        assert row["pdserve_share_of_floor"] > 0 and math.isfinite(row["pdserve_share_of_floor"])
    assert "bandwidth_bound_tok_s" not in rows["prefill"]  # a prefill is bound by compute
    for name in ("decode B=1", "decode B=3"):
        # Nor can a step beat reading its weights and KV once; tiny-random's few KB of them are read in nanoseconds.
        assert 0 < rows[name]["pdserve_share_of_bound"] < 1
    assert rows["decode B=3"]["bandwidth_bound_tok_s"] > rows["decode B=1"]["bandwidth_bound_tok_s"]  # one read, 3 rows


def test_a_step_reads_every_weight_once_but_the_embedding_table() -> None:
    """tiny-random's LM head is its own matrix; SmolLM2 ties it to the embedding (on CPU a transposed copy)."""
    for model in ("tiny-random", "smollm2-135m"):
        engine = LLMEngine(EngineConfig(model=model))
        c = engine.model_config
        per_layer = c.hidden_size * (2 * c.num_heads * c.head_dim + 2 * c.num_kv_heads * c.head_dim)
        per_layer += 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size
        params = c.num_layers * per_layer + c.hidden_size + c.vocab_size * c.hidden_size  # + final norm, LM head
        assert weight_bytes_per_step(engine.model) == 4 * params


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--prompt-len", "5000", "prompt_token_ids: 5000 tokens leave no room to generate"),
        ("--decode-tokens", "5000", "exceeds the model's context of 4096 tokens"),
    ],
)
def test_lengths_past_the_models_context_are_exit_2_in_a_line(capsys, flag, value, says) -> None:
    """As bench guided answers them: each was an InvalidRequestError traceback, exit 1."""
    from pdserve.cli import main

    argv = ["bench", "engine", "--model", "tiny-random", "--compare", "none", "--rounds", "1", "--batch-sizes", "1"]
    assert main([*argv, "--threads", "1", flag, value]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("pdserve bench engine: ") and says in line, line
