"""The order a worker's scheduler takes waiting prompts in, through a real Scheduler and BlockManager: higher
priority first, each tenant's in turn by prompt tokens, and first come, first served for one tenant alone."""

from __future__ import annotations

import random

from pdserve.config import SchedulerConfig
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sequence
from pdserve.protocol.sampling import SamplingParams


def admitted_order(prompts: list[tuple[str, str, int, int]]) -> list[str]:
    """(id, tenant, priority, prompt tokens) added in this order, then admitted one prompt a step."""
    config = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096, max_prefills_per_step=1)
    scheduler = Scheduler(config, BlockManager(num_blocks=4096, block_size=16))
    for seq_id, tenant, priority, tokens in prompts:
        rng = random.Random(seq_id)  # prompts of their own: no prefix cache hit starts one past position 0
        prompt = [rng.randrange(1, 30000) for _ in range(tokens)]
        scheduler.add(Sequence(seq_id, prompt, SamplingParams(max_tokens=1), tenant=tenant, priority=priority))
    order = []
    while scheduler.waiting:
        out = scheduler.schedule()
        order += [c.seq_id for c in out.chunks if c.start_position == 0]
        scheduler.complete_step()
    return order


def test_a_tenants_one_prompt_goes_next_to_anothers_hundred_not_behind_them():
    flood = [(f"a{i}", "flood", 0, 64) for i in range(10)]
    order = admitted_order([*flood, ("b0", "quiet", 0, 64), *[(f"a{i}", "flood", 0, 64) for i in range(10, 12)]])
    assert order.index("b0") == 1  # a0 started first; b0's tag is where a0's began, behind it by arrival
    assert [s for s in order if s != "b0"] == [f"a{i}" for i in range(12)]  # each tenant's own in arrival order


def test_turns_are_by_prompt_tokens():
    """Two tenants waiting at once: one's 256-token prompts take turns with four of the other's 64-token ones."""
    order = admitted_order(
        [*[(f"l{i}", "long", 0, 256) for i in range(3)], *[(f"s{i}", "short", 0, 64) for i in range(12)]]
    )
    assert order[:11] == ["l0", "s0", "s1", "s2", "s3", "l1", "s4", "s5", "s6", "s7", "l2"]


def test_one_tenant_alone_is_first_come_first_served_and_higher_priority_goes_first():
    ids = [f"r{i}" for i in range(8)]
    assert admitted_order([(i, "", 0, 16 + 40 * (n % 3)) for n, i in enumerate(ids)]) == ids
    order = admitted_order([("low", "a", -1, 32), ("mid", "a", 0, 32), ("high", "b", 2, 32), ("mid2", "b", 0, 32)])
    assert order == ["high", "mid", "mid2", "low"]
