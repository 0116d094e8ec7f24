"""The fixed-shape decode steps ("static": the path CUDA captures, run uncaptured) give the eager engine's
tokens, with padding rows beside real ones and with prefill steps in between, and return every block."""

from __future__ import annotations

import warnings

import pytest

from pdserve.config import EngineConfig, SchedulerConfig
from pdserve.engine.decode_graphs import batch_sizes
from pdserve.engine.engine import LLMEngine
from pdserve.protocol.engine_request import EngineRequest
from pdserve.protocol.roles import EngineMode
from pdserve.protocol.sampling import SamplingParams

pytestmark = pytest.mark.timeout(120)

# Lengths inside a block, on a block boundary and across several blocks (block size 16).
PROMPTS = [[5, 6, 7], list(range(100, 116)), list(range(3, 60)), [9] * 130, list(range(200, 250))]


def _engine(decode_graphs: str) -> LLMEngine:
    config = EngineConfig(
        model="tiny-random",
        dtype="float32",
        device="cpu",
        num_kv_blocks=128,
        num_threads=1,
        decode_graphs=decode_graphs,
        scheduler=SchedulerConfig(max_num_seqs=8),
    )
    return LLMEngine(config)


def _run(engine: LLMEngine) -> dict[str, list[int]]:
    """Two requests first, the rest joining while they decode: steps of decodes alone and mixed ones."""
    params = [
        SamplingParams(max_tokens=20, ignore_eos=True),
        SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.8, seed=7),
    ]
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(PROMPTS[:2]):
        engine.add_request(EngineRequest(f"r{i}", prompt, params[i % 2]))
    step = 0
    while engine.has_unfinished():
        step += 1
        if step in (4, 9, 10):
            i = {4: 2, 9: 3, 10: 4}[step]
            engine.add_request(EngineRequest(f"r{i}", PROMPTS[i], params[i % 2]))
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    return tokens


def test_static_decode_steps_give_the_eager_tokens_and_free_every_block() -> None:
    eager = _engine("off")
    assert eager.runner.decode_graphs is None
    expected = _run(eager)
    static = _engine("static")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex's advice to compile: uncompiled is this path on CPU
        got = _run(static)
    assert got == expected
    assert all(len(t) == 20 for t in got.values()) and len(got) == len(PROMPTS)
    graphs = static.runner.decode_graphs
    assert graphs is not None and graphs.steps_run > 20  # most steps decode only; 3 or 5 rows pad to 4 or 8
    assert static.blocks.num_used_blocks == 0


def test_the_scratch_block_is_past_the_block_managers() -> None:
    engine = _engine("static")
    assert engine.runner.kv_caches[0].shape[1] == engine.blocks.num_blocks + 1
    assert engine.runner.decode_graphs.scratch_block == engine.blocks.num_blocks


def test_auto_runs_eagerly_on_the_cpu() -> None:
    assert _engine("auto").runner.decode_graphs is None


def test_a_prefill_only_engine_has_no_decode_steps_to_fix() -> None:
    config = EngineConfig(
        model="tiny-random",
        device="cpu",
        num_kv_blocks=64,
        decode_graphs="static",
        scheduler=SchedulerConfig(mode=EngineMode.PREFILL_ONLY),
    )
    assert LLMEngine(config).runner.decode_graphs is None


@pytest.mark.parametrize(
    ("max_batch", "sizes"),
    [(1, [1]), (3, [1, 2, 3]), (8, [1, 2, 4, 8]), (12, [1, 2, 4, 8, 12]), (32, [1, 2, 4, 8, 16, 24, 32])],
)
def test_batch_sizes_pad_by_at_most_seven_rows(max_batch: int, sizes: list[int]) -> None:
    assert batch_sizes(max_batch) == sizes


def test_batch_sizes_stop_at_the_captured_maximum() -> None:
    assert batch_sizes(10_000)[-1] == 256


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="decode_graphs must be one of"):
        EngineConfig(decode_graphs="cuda")
