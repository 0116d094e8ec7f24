"""A decode-only engine's reservations: the blocks a prompt's KV will arrive in, taken between steps."""

from __future__ import annotations

import pytest

from pdserve.config import EngineConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.errors import InvalidRequestError, OverloadedError
from pdserve.protocol.engine_request import EngineRequest
from pdserve.protocol.outputs import FinishReason
from pdserve.protocol.roles import EngineMode
from pdserve.protocol.sampling import SamplingParams
from tests.unit.engine.engine_harness import run_to_end


def test_a_reservation_leaves_preempted_sequences_the_blocks_they_wait_for() -> None:
    """On a decode worker a sequence preempted for want of blocks resumes before new hand-offs take what frees
    up: a reservation that would leave it short is refused, and the worker publishes those blocks as owed, not free
    (its routers shed the hand-off or place it elsewhere instead of on a worker that refuses it)."""
    scheduler = SchedulerConfig(mode=EngineMode.DECODE_ONLY)
    config = EngineConfig(
        model="tiny-random", dtype="float32", device="cpu", block_size=4, num_kv_blocks=8, scheduler=scheduler
    )
    engine = LLMEngine(config)
    for name, prompt_tokens, max_tokens in (("short", 12, 4), ("preempted", 16, 6)):
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        engine.reserve(EngineRequest(name, list(range(1, prompt_tokens + 1)), sampling))
        engine.commit(name, 1)
    engine.step()  # each needs one more block, one is free: the last admitted is preempted
    assert [s.seq_id for s in engine.scheduler.waiting] == ["preempted"] and engine.blocks.num_free_blocks == 4
    assert published(engine) == {"kv_blocks_free": 0, "kv_blocks_owed": 4, "kv_blocks_used": 4}  # it needs 5
    new = EngineRequest("new", list(range(1, 17)), SamplingParams(max_tokens=2, ignore_eos=True))
    with pytest.raises(OverloadedError, match="no free KV blocks for 16 tokens"):
        engine.reserve(new)
    finished = run_to_end(engine)
    resumed = finished["preempted"]
    assert resumed[-1].finished and sum(len(o.new_token_ids) for o in resumed) == 5  # the first came with commit
    assert published(engine) == {"kv_blocks_free": 8, "kv_blocks_owed": 0, "kv_blocks_used": 0}
    assert len(engine.reserve(new)) == 4


def published(engine: LLMEngine) -> dict[str, int]:
    """The KV blocks the worker publishes: free for a new hand-off, owed to its own sequences, used."""
    return {k: v for k, v in engine.stats().items() if k in ("kv_blocks_free", "kv_blocks_owed", "kv_blocks_used")}


def test_a_reservation_leaves_each_growing_sequence_a_block_to_grow_into() -> None:
    """A hand-off that takes the block a running sequence is about to need gets it preempted (and its recompute
    preempted by the next hand-off): a reservation leaves one free block per running sequence that will outgrow
    its blocks; one whose max_tokens fit in what it holds needs none. What it publishes as free is what a
    reservation may take."""
    scheduler = SchedulerConfig(mode=EngineMode.DECODE_ONLY)
    config = EngineConfig(
        model="tiny-random", dtype="float32", device="cpu", block_size=4, num_kv_blocks=10, scheduler=scheduler
    )
    engine = LLMEngine(config)
    for name, prompt_tokens, max_tokens in (("growing", 8, 6), ("done-growing", 7, 2)):  # 2 blocks each
        engine.reserve(EngineRequest(name, list(range(1, prompt_tokens + 1)), SamplingParams(max_tokens=max_tokens)))
        engine.commit(name, 1)
    assert engine.blocks.num_free_blocks == 6
    assert published(engine) == {"kv_blocks_free": 5, "kv_blocks_owed": 1, "kv_blocks_used": 4}

    def reserve(name: str, tokens: int) -> None:
        engine.reserve(EngineRequest(name, list(range(1, tokens + 1)), SamplingParams(max_tokens=1)))

    with pytest.raises(OverloadedError, match="no free KV blocks for 24 tokens"):
        reserve("takes-all", 24)
    reserve("leaves-one", 20)
    engine.commit("leaves-one", 1)  # its max_tokens came with its first token: it ends there
    run_to_end(engine)
    assert engine.scheduler.num_preemptions == 0


def test_a_reservation_leaves_a_block_to_grow_into_for_a_hand_off_whose_kv_is_still_arriving() -> None:
    """Reserved but not yet committed (its prompt still prefilling or its KV in transfer), a sequence will grow
    as soon as it runs: the next reservation leaves it its block as if it ran."""
    scheduler = SchedulerConfig(mode=EngineMode.DECODE_ONLY)
    config = EngineConfig(
        model="tiny-random", dtype="float32", device="cpu", block_size=4, num_kv_blocks=6, scheduler=scheduler
    )
    engine = LLMEngine(config)

    def reserve(name: str, tokens: int, max_tokens: int) -> None:
        engine.reserve(EngineRequest(name, list(range(1, tokens + 1)), SamplingParams(max_tokens=max_tokens)))

    reserve("arriving", 18, 4)  # 5 blocks of its 6
    with pytest.raises(OverloadedError, match="no free KV blocks for 4 tokens"):
        reserve("takes-its-block", 4, 1)
    assert engine.blocks.num_free_blocks == 1


def test_a_full_batch_refuses_a_reservation_until_a_sequence_ends() -> None:
    """max_num_seqs holds on a decode worker too: a sequence whose KV is still arriving has its place in the
    batch, and a hand-off past the cap is refused before any byte moves, not run in an oversized step."""
    scheduler = SchedulerConfig(max_num_seqs=2, mode=EngineMode.DECODE_ONLY)
    config = EngineConfig(model="tiny-random", dtype="float32", device="cpu", num_kv_blocks=64, scheduler=scheduler)
    engine = LLMEngine(config)
    prompt = list(range(1, 9))
    engine.reserve(EngineRequest("decoding", prompt, SamplingParams(max_tokens=3, ignore_eos=True)))
    engine.commit("decoding", 1)
    engine.reserve(EngineRequest("arriving", prompt, SamplingParams(max_tokens=3, ignore_eos=True)))
    third = EngineRequest("third", prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    with pytest.raises(OverloadedError, match=r"batch is full \(2 sequences, max_num_seqs 2\)"):
        engine.reserve(third)
    assert engine.blocks.num_free_blocks == 62 and engine.num_sequences == 2  # the refused one took nothing
    with pytest.raises(InvalidRequestError, match="request_id"):  # what is never valid says so, full or not
        engine.reserve(EngineRequest("arriving", prompt, SamplingParams(max_tokens=3)))
    run_to_end(engine)  # "decoding" ends; "arriving" has not committed, so it holds its place
    assert len(engine.reserve(third)) == 1


def test_a_commit_without_kv_keys_none_of_its_blocks_into_the_prefix_cache() -> None:
    """A request its first token ended (the prefill worker sent no KV) leaves its never-written blocks out of
    the prefix cache; one whose KV came keys its full blocks there. Without KV a first token ends the request even
    where this engine's own check would go on: the prefill worker's decision holds (test_guided_failures.py)."""
    scheduler = SchedulerConfig(mode=EngineMode.DECODE_ONLY)
    config = EngineConfig(
        model="tiny-random", dtype="float32", device="cpu", block_size=4, num_kv_blocks=16, scheduler=scheduler
    )
    engine = LLMEngine(config)
    prompt = list(range(1, 13))  # three full blocks
    engine.reserve(EngineRequest("ended", prompt, SamplingParams(max_tokens=1, ignore_eos=True)))
    assert engine.commit("ended", 1, kv_received=False).finished
    assert engine.blocks.num_cached_blocks == 0 and engine.blocks.num_free_blocks == 16
    engine.reserve(EngineRequest("goes-on", prompt, SamplingParams(max_tokens=3, ignore_eos=True)))
    assert engine.commit("goes-on", 1, kv_received=False).finish_reason is FinishReason.STOP
    assert engine.blocks.num_cached_blocks == 0 and engine.blocks.num_free_blocks == 16
    engine.reserve(EngineRequest("kv-came", prompt, SamplingParams(max_tokens=2, ignore_eos=True)))
    engine.commit("kv-came", 1)
    run_to_end(engine)
    assert engine.blocks.num_cached_blocks == 3
