"""A prefill worker's order at chunk boundaries (engine/short_first.py): a prompt that fits one step goes ahead of a
longer prompt's remaining chunks, within a credit of one chunk's tokens between two of its chunks."""

from __future__ import annotations

import time

from pdserve.config import EngineConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.protocol.engine_request import EngineRequest
from pdserve.protocol.perf_profile import QueuedPrefill
from pdserve.protocol.roles import EngineMode
from pdserve.protocol.sampling import SamplingParams
from tests.unit.engine.test_scheduler import Sim

PREFILL = SchedulerConfig(
    max_num_batched_tokens=8, long_prefill_chunk=8, max_prefills_per_step=1, short_prompts_first=True
)


def steps(sim: Sim, n: int | None = None) -> list[tuple[str, int]]:
    """Each step's one prompt chunk, as (sequence, tokens), for `n` steps or until the queue is empty."""
    out = []
    while sim.sched.has_work and (n is None or len(out) < n):
        chunks = sim.step().chunks
        assert len(chunks) == 1
        out.append((chunks[0].seq_id, len(chunks[0].token_ids)))
    return out


def test_a_short_prompt_runs_at_the_next_chunk_boundary_not_after_the_long_prompts_last_chunk() -> None:
    sim = Sim(PREFILL, num_blocks=64)
    sim.add("long", list(range(30)), max_tokens=1)
    assert steps(sim, 1) == [("long", 8)]
    sim.add("short", list(range(100, 105)), max_tokens=1)
    assert steps(sim) == [("short", 5), ("long", 8), ("long", 8), ("long", 6)]
    assert sim.bm.num_used_blocks == 0


def test_a_short_prompt_arrived_after_a_waiting_long_one_goes_first() -> None:
    sim = Sim(PREFILL, num_blocks=64)
    sim.add("long", list(range(20)), max_tokens=1)
    sim.add("short", list(range(100, 103)), max_tokens=1)
    assert steps(sim) == [("short", 3), ("long", 8), ("long", 8), ("long", 4)]


def test_short_prompts_go_ahead_by_at_most_one_chunks_tokens_between_two_of_the_long_prompts_chunks() -> None:
    """Under a stream of short prompts the long one still gets every other step at least: never starved."""
    sim = Sim(PREFILL, num_blocks=64)
    sim.add("long", list(range(32)), max_tokens=1)
    assert steps(sim, 1) == [("long", 8)]
    for i in range(5):
        sim.add(f"s{i}", list(range(100 + 10 * i, 103 + 10 * i)), max_tokens=1)
    assert steps(sim) == [
        ("s0", 3), ("s1", 3), ("s2", 3),  # 9 tokens ahead: the credit of 8 is spent
        ("long", 8),
        ("s3", 3), ("s4", 3),
        ("long", 8), ("long", 8),
    ]  # fmt: skip


def test_a_lower_priority_short_prompt_does_not_go_ahead_of_a_higher_priority_long_one() -> None:
    sim = Sim(PREFILL, num_blocks=64)
    sim.add("long", list(range(20)), max_tokens=1).priority = 1
    sim.add("short", list(range(100, 103)), max_tokens=1)
    assert steps(sim) == [("long", 8), ("long", 8), ("long", 4), ("short", 3)]


def test_a_short_prompt_without_free_blocks_costs_the_long_prompt_no_step() -> None:
    sim = Sim(PREFILL, num_blocks=9, block_size=4)
    sim.add("long", list(range(30)), max_tokens=1)  # all its chunks' blocks: 8 of 9
    assert steps(sim, 1) == [("long", 8)]
    sim.add("short", list(range(100, 106)), max_tokens=1)  # needs 2
    assert steps(sim) == [("long", 8), ("long", 8), ("long", 6), ("short", 6)]


def test_in_order_without_the_policy() -> None:
    sim = Sim(SchedulerConfig(max_num_batched_tokens=8, long_prefill_chunk=8, max_prefills_per_step=1), 64)
    sim.add("long", list(range(20)), max_tokens=1)
    sim.add("short", list(range(100, 103)), max_tokens=1)
    assert steps(sim) == [("long", 8), ("long", 8), ("long", 4), ("short", 3)]
    assert sim.sched.queued_ahead_of_short() is None


def test_a_short_prompt_waits_for_the_short_ones_queued_and_the_long_prompts_chunk_in_flight() -> None:
    """What the worker reports for a router to price a short prompt's wait: the short prompts whole, and a chunk of the
    long prompt as long as its last chunk took, or before one ran, priced as its share of the long one's squares (from
    8 done to 16: 16² - 8²); the whole queue apart."""
    sim = Sim(PREFILL, num_blocks=64)
    long = sim.add("long", list(range(30)), max_tokens=1)
    steps(sim, 1)
    sim.add("a", list(range(100, 105)), max_tokens=1)
    sim.add("b", list(range(110, 116)), max_tokens=1)
    sim.add("other long", list(range(200, 220)), max_tokens=1)
    shorts = QueuedPrefill(2, 5 + 6, 5**2 + 6**2)
    assert sim.sched.queued_ahead_of_short() == (QueuedPrefill(3, 8 + 11, 16**2 - 8**2 + shorts.token_squares), 0.0)
    assert sim.sched.queued_prefill() == QueuedPrefill(4, 22 + 5 + 6 + 20, 30**2 - 8**2 + 5**2 + 6**2 + 20**2)
    long.last_chunk_s = 1.5  # the engine's step timed its first chunk
    assert sim.sched.queued_ahead_of_short() == (shorts, 1.5)
    sim.run()
    assert sim.sched.queued_ahead_of_short() == (QueuedPrefill(), 0.0)


def test_what_a_short_prompt_waits_for_counts_the_reads_of_each_prompts_cached_prefix() -> None:
    """A short prompt after 16 cached tokens counts 21² - 16², and the chunk in flight of a long prompt with 24 of its
    tokens computed (16 of them cached) counts 32² - 24², as a router prices them (not 5² and 16² - 8², as though
    nothing came before their new tokens)."""
    sim = Sim(PREFILL, num_blocks=64)
    seed = sim.add("seed", list(range(20)), max_tokens=1)
    sim.run()
    prefix = seed.prompt_token_ids[:16]
    sim.add("long", prefix + list(range(100, 120)), max_tokens=1)  # 16 cached, 20 new
    steps(sim, 1)  # its first chunk: 8 tokens
    sim.add("short", prefix + list(range(200, 205)), max_tokens=1)  # 16 cached, 5 new
    short = 21**2 - 16**2
    assert sim.sched.queued_ahead_of_short() == (QueuedPrefill(2, 8 + 5, 32**2 - 24**2 + short), 0.0)
    assert sim.sched.queued_prefill() == QueuedPrefill(2, 12 + 5, 36**2 - 24**2 + short)


def test_a_prefill_engine_reports_a_chunk_in_flight_as_long_as_its_prompts_last_chunk_took() -> None:
    scheduler = SchedulerConfig(
        max_num_batched_tokens=64,
        long_prefill_chunk=64,
        max_prefills_per_step=1,
        short_prompts_first=True,
        mode=EngineMode.PREFILL_ONLY,
    )
    engine = LLMEngine(EngineConfig(model="tiny-random", num_threads=1, num_kv_blocks=64, scheduler=scheduler))
    engine.add_request(EngineRequest("long", list(range(3, 203)), SamplingParams(max_tokens=2)))
    stats = engine.stats()
    assert (stats["short_prompt_tokens"], stats["prefill_chunk_us"], stats["queued_short_prefill_tokens"]) == (64, 0, 0)
    began = time.monotonic()
    engine.step()  # its first chunk
    took = time.monotonic() - began
    stats = engine.stats()
    assert 0 < stats["prefill_chunk_us"] <= took * 1e6
    assert stats["queued_short_prefill_tokens"] == 0 and stats["queued_prefill_tokens"] == 200 - 64
