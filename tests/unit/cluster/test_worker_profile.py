"""A worker times its model on scratch KV blocks (measure_profile) before its warm-up prompt runs: the warm-up
leaves a block in the prefix cache when the block size is small, and the profile's random KV written over it
would be every later prompt's wrong prefix hit. The profile refuses to run on a pool that holds anything."""

from __future__ import annotations

import pytest
import torch

from pdserve.cluster.worker_runtime import WorkerRuntime
from pdserve.cluster.worker_spec import WorkerSpec
from pdserve.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.profiling import DEEP_CONTEXT, _decode_points, _prefill_points, measure_profile
from pdserve.engine.scheduler import ScheduledChunk
from pdserve.protocol.perf_profile import PerfProfile, attention_squares
from pdserve.protocol.roles import Role
from pdserve.protocol.sampling import SamplingParams
from tests.unit.engine.engine_harness import make_engine

pytestmark = pytest.mark.timeout(120)


def test_the_profile_refuses_a_pool_the_prefix_cache_holds_blocks_of() -> None:
    engine = make_engine(num_kv_blocks=64, block_size=4)
    measure_profile(engine)  # a fresh pool: scratch
    engine.generate([[0, 1, 2, 3]], SamplingParams(max_tokens=1))
    assert engine.blocks.num_cached_blocks == 1
    with pytest.raises(RuntimeError, match="before any request"):
        measure_profile(engine)


def test_the_profile_times_decode_at_a_deep_context_too_where_the_pool_holds_it() -> None:
    """Decode steps at context 64 alone cannot tell a sequence's cost from its context's; the deep ones can."""
    timed: list[tuple[int, int]] = []

    def cost(chunks: list[ScheduledChunk]) -> float:
        timed.append((len(chunks), chunks[0].start_position))
        return 0.02 + 0.005 * len(chunks) + 1e-6 * sum(c.start_position + 1 for c in chunks)

    roomy = make_engine(num_kv_blocks=8 * 129)  # 8 sequences of 2049 tokens
    fitted = PerfProfile.fit([(64, 0, 0.01)], _decode_points(roomy, cost))
    assert timed == [(1, 64), (8, 64), (32, 64), (1, DEEP_CONTEXT), (8, DEEP_CONTEXT)]
    assert (fitted.decode_fixed_s, fitted.decode_per_seq_s) == pytest.approx((0.02, 0.005 + 1e-6))
    assert fitted.decode_per_context_token_s == pytest.approx(1e-6)
    timed.clear()
    _decode_points(make_engine(num_kv_blocks=256), cost)  # one sequence of 2049 tokens fits, eight do not
    assert timed == [(1, 64), (8, 64), (32, 64), (1, DEEP_CONTEXT)]


def test_the_profile_times_a_chunk_after_a_cached_prefix_where_the_pool_holds_it() -> None:
    """Three whole prompts fix the quadratic's three terms exactly, so the attention term a conversation's next turn
    pays would carry one point's noise (0 in one run: cached_point.py); a chunk after 1024 cached tokens pins it."""
    timed: list[tuple[int, int]] = []

    def cost(chunks: list[ScheduledChunk]) -> float:
        (chunk,) = chunks
        new, cached = len(chunk.token_ids), chunk.start_position
        assert len(chunk.block_table) * 16 >= cached + new  # the blocks its context and its own tokens take
        timed.append((new, cached))
        return 0.01 + 1e-4 * new + 1e-8 * ((cached + new) ** 2 - cached**2)

    points = _prefill_points(make_engine(num_kv_blocks=128), cost, torch.Generator().manual_seed(0))
    assert timed == [(64, 0), (256, 0), (1024, 0), (256, 1024)]
    fitted = PerfProfile.fit(points, [(1, 64, 0.01)])
    assert fitted.prefill_s(256, cached=2048) == pytest.approx(0.01 + 1e-4 * 256 + 1e-8 * (2304**2 - 2048**2))
    timed.clear()
    _prefill_points(make_engine(num_kv_blocks=72), cost, torch.Generator())  # 1024 tokens fit, 1280 do not
    assert timed == [(64, 0), (256, 0), (1024, 0)]


def test_the_profile_times_a_chunk_deep_in_a_long_context_where_the_model_and_the_pool_hold_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prompt of 8k tokens is priced 40 times past the squares of the other points: a chunk after 3840 cached
    tokens gives the attention term a lever near it. tiny-random's 4096 positions leave it out."""
    timed: list[tuple[int, int]] = []

    def cost(chunks: list[ScheduledChunk]) -> float:
        (chunk,) = chunks
        timed.append((len(chunk.token_ids), chunk.start_position))
        return 0.01 + 1e-4 * len(chunk.token_ids) + 1e-8 * attention_squares(len(chunk.token_ids), chunk.start_position)

    engine = make_engine(num_kv_blocks=256)  # 4096 tokens
    _prefill_points(engine, cost, torch.Generator())
    assert (256, 3840) not in timed  # 3840 + 256 is past tiny-random's 4096 positions
    timed.clear()
    monkeypatch.setattr(LLMEngine, "max_model_len", property(lambda self: 8192))
    points = _prefill_points(engine, cost, torch.Generator())
    assert timed[-1] == (256, 3840)
    fitted = PerfProfile.fit(points, [(1, 64, 0.01)])
    assert fitted.prefill_s(8160) == pytest.approx(0.01 + 1e-4 * 8160 + 1e-8 * 8160**2)
    timed.clear()
    _prefill_points(make_engine(num_kv_blocks=255), cost, torch.Generator())  # the pool holds 4080 tokens
    assert (256, 3840) not in timed


def test_a_worker_with_small_blocks_profiles_before_its_warm_up() -> None:
    config = EngineConfig(model="tiny-random", device="cpu", dtype="float32", block_size=4, num_kv_blocks=64)
    worker = WorkerRuntime(WorkerSpec(Role.PREFILL, config, metrics_port=None), lambda ctx: None)
    try:
        worker.wait_ready(timeout_s=60)
    finally:
        worker.stop()
