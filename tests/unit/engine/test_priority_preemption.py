"""A decode worker short of KV blocks preempts the newest of its lowest priority running, never a higher priority
for a lower one; a preempted sequence goes back first unless a higher priority waits (vLLM's priority policy)."""

from __future__ import annotations

from pdserve.config import SchedulerConfig
from pdserve.protocol.outputs import FinishReason
from tests.unit.engine.test_scheduler import Sim, fake_token


def test_a_higher_priority_is_never_preempted_for_a_lower_one_and_goes_back_before_it() -> None:
    """The newest running sequence is preempted only among the lowest priority running: here the older one,
    scheduled before it this very step, gives its place up; preempted, it waits behind a higher priority."""
    sim = Sim(SchedulerConfig(max_num_batched_tokens=64, long_prefill_chunk=64), 5, 4)
    low = sim.add("low", list(range(8)), max_tokens=12)
    sim.step()
    urgent = sim.add("urgent", list(range(50, 58)), max_tokens=12)
    urgent.priority = 5
    out = sim.sched.schedule()
    assert [c.seq_id for c in out.chunks] == ["low", "urgent"]
    sim.sched.complete_step()
    for s in (low, urgent):
        s.output_token_ids.append(fake_token(s))
    out = sim.sched.schedule()  # each needs a third block, and one is free: low's goes to urgent
    assert out.preempted == ["low"] and [c.seq_id for c in out.chunks] == ["urgent"]
    assert low.block_table == [] and sim.bm.num_free_blocks == 5 - len(urgent.block_table)
    sim.sched.complete_step()
    later = sim.add("later", list(range(90, 94)), max_tokens=2)
    later.priority = 5
    sim.sched.finish(urgent, FinishReason.LENGTH)
    out = sim.sched.schedule()
    assert [c.seq_id for c in out.chunks][0] == "later"  # a higher priority waiting goes before a preempted lower
