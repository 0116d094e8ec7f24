"""A decode-only engine's reservations: the blocks a prompt's KV will arrive in, taken between steps."""

from __future__ import annotations

from pdserve.config import EngineConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.protocol.engine_request import EngineRequest
from pdserve.protocol.roles import EngineMode
from pdserve.protocol.sampling import SamplingParams
from tests.unit.engine.test_engine import run_to_end


def test_a_reservation_leaves_preempted_sequences_the_blocks_they_wait_for() -> None:
    """On a decode worker a sequence preempted for want of blocks resumes before new hand-offs take what frees
    up: a reservation that would leave it short is refused (the router sheds it or places it elsewhere)."""
    scheduler = SchedulerConfig(mode=EngineMode.DECODE_ONLY)
    config = EngineConfig(
        model="tiny-random", dtype="float32", device="cpu", block_size=4, num_kv_blocks=8, scheduler=scheduler
    )
    engine = LLMEngine(config)
    for name, prompt_tokens, max_tokens in (("short", 12, 4), ("preempted", 16, 6)):
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        assert engine.reserve(EngineRequest(name, list(range(1, prompt_tokens + 1)), sampling)) is not None
        engine.commit(name, 1)
    engine.step()  # each needs one more block, one is free: the last admitted is preempted
    assert [s.seq_id for s in engine.scheduler.waiting] == ["preempted"] and engine.blocks.num_free_blocks == 4
    new = EngineRequest("new", list(range(1, 17)), SamplingParams(max_tokens=2, ignore_eos=True))
    assert engine.reserve(new) is None
    finished = run_to_end(engine)
    resumed = finished["preempted"]
    assert resumed[-1].finished and sum(len(o.new_token_ids) for o in resumed) == 5  # the first came with commit
    assert engine.reserve(new) is not None
