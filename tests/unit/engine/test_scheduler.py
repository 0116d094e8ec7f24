from __future__ import annotations

import random

import pytest

from pdserve.config import SchedulerConfig
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.protocol.outputs import FinishReason
from pdserve.protocol.perf_profile import QueuedPrefill
from pdserve.protocol.sampling import SamplingParams


def fake_token(seq: Sequence) -> int:
    """What the simulated model samples: depends only on the request and how far it got."""
    return 1000 + (sum(map(ord, seq.seq_id)) * 31 + seq.num_output_tokens) % 997


def expected_outputs(seq_id: str, n: int) -> list[int]:
    probe = Sequence(seq_id, [0], SamplingParams())
    out = []
    for _ in range(n):
        out.append(fake_token(probe))
        probe.output_token_ids.append(out[-1])
    return out


def is_decode(chunk_len: int, start: int) -> bool:
    # What the model runner treats as a decode: one token attending to cached context.
    return chunk_len == 1 and start > 0


class Sim:
    """Drives a real Scheduler and BlockManager; plays the model by appending a fake token per sampled chunk,
    and checks the step invariants on every schedule."""

    def __init__(
        self,
        config: SchedulerConfig,
        num_blocks: int,
        block_size: int = 4,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.config = config
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.sched = Scheduler(config, self.bm)
        self.seqs: dict[str, Sequence] = {}
        self.history: list[SchedulerOutput] = []

    def add(self, seq_id: str, prompt: list[int], max_tokens: int = 4) -> Sequence:
        seq = Sequence(seq_id, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        self.seqs[seq_id] = seq
        self.sched.add(seq)
        return seq

    def step(self) -> SchedulerOutput:
        running_before = list(self.sched.running)
        before = {s.seq_id: (s.num_computed_tokens, list(s.output_token_ids)) for s in self.seqs.values()}
        out = self.sched.schedule()
        self._check(out, running_before, before)
        sampled = self.sched.complete_step()
        assert {s.seq_id for s in sampled} == {c.seq_id for c in out.chunks if c.sample}
        for chunk in out.chunks:
            seq = self.seqs[chunk.seq_id]
            assert seq.num_computed_tokens == chunk.start_position + len(chunk.token_ids)
            if chunk.sample:
                seq.output_token_ids.append(fake_token(seq))
                if seq.num_output_tokens >= seq.sampling.max_tokens:
                    self.sched.finish(seq, FinishReason.LENGTH)
        self.history.append(out)
        self._check_blocks()
        return out

    def _check(self, out: SchedulerOutput, running_before: list[Sequence], before: dict) -> None:
        cfg, bs = self.config, self.bm.block_size
        assert out.num_tokens <= cfg.max_num_batched_tokens
        assert len(out.chunks) <= cfg.max_num_seqs
        assert len(self.sched.running) <= cfg.max_num_seqs
        ids = [c.seq_id for c in out.chunks]
        assert len(ids) == len(set(ids))
        assert not set(ids) & set(out.preempted)
        kinds = [is_decode(len(c.token_ids), c.start_position) for c in out.chunks]
        assert kinds == sorted(kinds, reverse=True), "a decode comes after a prefill chunk"
        for c in out.chunks:
            seq = self.seqs[c.seq_id]
            n = len(c.token_ids)
            assert 1 <= n <= cfg.long_prefill_chunk
            assert seq.status is SequenceStatus.RUNNING and seq in self.sched.running
            if c.seq_id in before and before[c.seq_id][0] > 0 and seq in running_before:
                assert c.start_position == before[c.seq_id][0]  # continues where it left off
            assert c.start_position == seq.num_computed_tokens
            assert c.token_ids == seq.token_ids[c.start_position : c.start_position + n]
            assert c.sample == (c.start_position + n == seq.num_tokens)
            assert c.block_table == seq.block_table
            assert len(c.block_table) * bs >= c.start_position + n
        # Victims are taken from the most recently admitted end.
        assert out.preempted == [s.seq_id for s in reversed(running_before)][: len(out.preempted)]
        # Preempted requests wait ahead of newer ones, in their original admission order.
        head = [s.seq_id for s in list(self.sched.waiting)[: len(out.preempted)]]
        assert head == out.preempted[::-1]
        for seq_id in out.preempted:
            seq = self.seqs[seq_id]
            assert seq.block_table == []
            assert seq.num_computed_tokens == 0
            assert seq.status is SequenceStatus.WAITING and seq in self.sched.waiting
            assert seq.output_token_ids == before[seq_id][1]  # generated tokens are kept

    def _check_blocks(self) -> None:
        queued = {id(s) for s in self.sched.running} | {id(s) for s in self.sched.waiting}
        detached = [s for s in self.seqs.values() if s.status is not SequenceStatus.FINISHED and id(s) not in queued]
        held = [b for s in [*self.sched.running, *detached] for b in s.block_table]
        assert self.bm.num_used_blocks == len(set(held))
        assert self.bm.num_used_blocks + self.bm.num_free_blocks == self.bm.num_blocks
        assert self.bm.num_cached_blocks <= self.bm.num_free_blocks
        for s in self.sched.waiting:
            assert s.block_table == []

    def run(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_work:
                return
            self.step()
        raise AssertionError(f"not done after {max_steps} steps")


def test_an_admitted_prompt_holds_the_blocks_of_all_its_chunks_so_recomputes_do_not_thrash() -> None:
    """Admitted with its first chunk's blocks only, each prompt (or recompute) saw the same free pool, and their
    later chunks preempted the newest of them, which lost what it computed: 8 requests of 30 + 100 tokens in 64
    blocks ran 4102 tokens for the 1032 they need. (A prefix cache hides part of it: recomputes find their own
    freed blocks.)"""
    sim = Sim(SchedulerConfig(long_prefill_chunk=8), 64, enable_prefix_caching=False)
    for i in range(8):
        sim.add(f"r{i}", [(7 * i + j) % 250 + 3 for j in range(30)], max_tokens=100)
    sim.run()
    ran, needed = sum(out.num_tokens for out in sim.history), 8 * (30 + 100 - 1)
    assert ran < 1.8 * needed, (ran, needed, sim.sched.num_preemptions)


@pytest.mark.parametrize("num_blocks", [200, 19])
@pytest.mark.parametrize("seed", range(5))
def test_budget_and_sequence_cap_hold_every_step(seed: int, num_blocks: int) -> None:
    rng = random.Random(seed)
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24, long_prefill_chunk=10)
    sim = Sim(cfg, num_blocks)  # 19 blocks of 4: the longest request fits alone, not with others
    shared = [rng.randrange(500) for _ in range(24)]

    def prompt() -> list[int]:
        head = shared[: rng.choice([0, 5, 12, 24])]
        return head + [rng.randrange(500) for _ in range(rng.randint(1, 60 - len(head)))]

    pending = [(f"r{i}", prompt(), rng.randint(1, 8)) for i in range(14)]
    for _ in range(5):
        sim.add(*pending.pop(0))
    steps = 0
    while sim.sched.has_work or pending:
        if pending and rng.random() < 0.3:
            sim.add(*pending.pop(0))
        sim.step()
        steps += 1
        assert steps < 1000
    if num_blocks == 200:  # the caps were reached, so their checks were not idle
        assert max(out.num_tokens for out in sim.history) == cfg.max_num_batched_tokens
        assert max(len(out.chunks) for out in sim.history) == cfg.max_num_seqs
    # 19 blocks are too few to fill the budget (a prompt is admitted with all its blocks): the checks of every step
    # then hold under block pressure.
    for seq in sim.seqs.values():
        assert seq.status is SequenceStatus.FINISHED and seq.finish_reason is FinishReason.LENGTH
        assert seq.output_token_ids == expected_outputs(seq.seq_id, seq.sampling.max_tokens)
    assert sim.bm.num_used_blocks == 0
    if num_blocks < 20:
        assert any(out.preempted for out in sim.history)


@pytest.mark.parametrize(("chunk", "budget"), [(16, 100), (100, 16), (7, 7)])
def test_long_prompt_is_prefilled_in_consecutive_chunks(chunk: int, budget: int) -> None:
    sim = Sim(SchedulerConfig(max_num_batched_tokens=budget, long_prefill_chunk=chunk), num_blocks=64)
    prompt = list(range(50))
    sim.add("long", prompt, max_tokens=2)
    chunks = []
    while not sim.seqs["long"].output_token_ids:
        (c,) = sim.step().chunks
        chunks.append(c)
    size = min(chunk, budget)
    assert len(chunks) == -(-50 // size)
    assert [c.start_position for c in chunks] == list(range(0, 50, size))
    assert [t for c in chunks for t in c.token_ids] == prompt
    assert [c.sample for c in chunks] == [False] * (len(chunks) - 1) + [True]
    out = sim.step()
    (decode,) = out.chunks
    assert decode.start_position == 50 and len(decode.token_ids) == 1 and decode.sample
    assert out.prefill_attention_squares == 0  # a decode's context is the decode step's own cost
    assert out.decode_context_tokens == 51  # which reads the prompt's 50 tokens and its own
    assert not sim.sched.has_work
    assert sim.bm.num_used_blocks == 0


def test_decodes_come_before_prefill_chunks() -> None:
    sim = Sim(SchedulerConfig(max_num_batched_tokens=64, long_prefill_chunk=8), num_blocks=64)
    sim.add("a", [1, 2, 3, 4], max_tokens=5)
    sim.add("b", list(range(100, 140)), max_tokens=5)
    sim.add("c", [5, 6, 7], max_tokens=5)
    first = sim.step()
    assert [c.seq_id for c in first.chunks] == ["a", "b", "c"]  # all prefills, admission order
    second = sim.step()
    assert [c.seq_id for c in second.chunks] == ["a", "c", "b"]
    assert [len(c.token_ids) for c in second.chunks] == [1, 1, 8]
    assert second.decode_context_tokens == 5 + 4  # a's 4 prompt tokens and c's 3, each with its new token
    assert second.chunks[2].start_position == 8
    sim.run()
    assert sim.bm.num_used_blocks == 0


def test_a_prefill_cap_of_one_runs_prompts_first_come_first_served() -> None:
    """As a prefill worker runs: one prompt per step (each chunk of a long one before the next prompt starts),
    although the budget would hold several short ones; decodes still join every step."""
    cfg = SchedulerConfig(max_num_batched_tokens=64, long_prefill_chunk=8, max_prefills_per_step=1)
    sim = Sim(cfg, num_blocks=64)
    sim.add("a", [1, 2, 3, 4], max_tokens=3)
    sim.add("b", list(range(100, 112)), max_tokens=3)
    sim.add("c", [5, 6, 7], max_tokens=3)
    steps = [[(c.seq_id, len(c.token_ids)) for c in sim.step().chunks] for _ in range(4)]
    assert steps == [[("a", 4)], [("a", 1), ("b", 8)], [("a", 1), ("b", 4)], [("b", 1), ("c", 3)]]
    sim.run()
    assert sim.bm.num_used_blocks == 0


@pytest.mark.parametrize("caching", [False, True])
def test_preemption_frees_the_newest_and_recomputes_it(caching: bool) -> None:
    bs = 4
    sim = Sim(SchedulerConfig(max_num_batched_tokens=64, long_prefill_chunk=64), 6, bs, caching)
    for i in range(3):
        sim.add(f"s{i}", [10 * i + k for k in range(6)], max_tokens=10)  # 2 blocks now, 4 at the end
    first = sim.step()
    assert len(first.chunks) == 3 and sim.bm.num_free_blocks == 0
    recomputes = 0
    preempted_at: dict[str, int] = {}
    for _ in range(500):
        if not sim.sched.has_work:
            break
        out = sim.step()
        for c in out.chunks:
            seq = sim.seqs[c.seq_id]
            if c.seq_id in preempted_at:
                # The first run after preemption recomputes prompt and outputs (less any cached prefix).
                n_tokens = preempted_at.pop(c.seq_id)
                if caching:
                    assert c.start_position % bs == 0 and c.start_position < n_tokens
                else:
                    assert c.start_position == 0
                assert c.token_ids == seq.token_ids[c.start_position : n_tokens]
                assert seq.num_tokens - 1 == n_tokens  # it sampled right after the recompute
                assert c.sample
                recomputes += 1
        for seq_id in out.preempted:
            preempted_at[seq_id] = sim.seqs[seq_id].num_tokens
    assert recomputes > 0
    assert not sim.sched.has_work
    assert sum(s.num_preemptions for s in sim.seqs.values()) >= recomputes
    for seq in sim.seqs.values():
        assert seq.status is SequenceStatus.FINISHED
        assert seq.output_token_ids == expected_outputs(seq.seq_id, 10)
    assert sim.bm.num_used_blocks == 0


def test_the_oldest_running_sequence_is_never_preempted_for_a_newer_one() -> None:
    sim = Sim(SchedulerConfig(max_num_batched_tokens=64, long_prefill_chunk=64), 5, 4)
    sim.add("old", list(range(8)), max_tokens=12)
    sim.step()
    sim.add("new", list(range(50, 58)), max_tokens=12)
    preempted = []
    while sim.sched.has_work:
        preempted += sim.step().preempted
    assert preempted and set(preempted) == {"new"}
    assert sim.seqs["old"].num_preemptions == 0


@pytest.mark.parametrize("reason", [FinishReason.ABORT, FinishReason.LENGTH])
def test_finishing_everything_midway_frees_every_block(reason: FinishReason) -> None:
    rng = random.Random(7)
    sim = Sim(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=16, long_prefill_chunk=6), 40)
    for i in range(8):
        sim.add(f"r{i}", [rng.randrange(50) for _ in range(rng.randint(5, 30))], max_tokens=20)
    for _ in range(6):
        sim.step()
    assert sim.sched.waiting and sim.sched.running and sim.bm.num_used_blocks > 0
    for seq in list(sim.seqs.values()):
        if seq.status is not SequenceStatus.FINISHED:
            sim.sched.finish(seq, reason)
    assert sim.bm.num_used_blocks == 0
    assert sim.bm.num_free_blocks == sim.bm.num_blocks
    assert not sim.sched.has_work
    assert sim.sched.schedule().chunks == []
    for seq in sim.seqs.values():
        assert seq.status is SequenceStatus.FINISHED and seq.finish_reason is reason and seq.block_table == []


def test_a_request_sharing_a_finished_prefix_starts_past_it() -> None:
    bs = 4
    sim = Sim(SchedulerConfig(max_num_batched_tokens=256, long_prefill_chunk=256), 64, bs)
    a = sim.add("a", list(range(100, 140)), max_tokens=3)
    sim.step()
    a_table = list(a.block_table)
    sim.run()
    assert sim.bm.num_used_blocks == 0

    hits = sim.bm.prefix_hits
    b = sim.add("b", a.prompt_token_ids[:33] + [7] * 12, max_tokens=2)
    out = sim.step()
    (chunk,) = out.chunks
    assert b.num_cached_tokens == 32
    assert out.prefill_attention_squares == (32 + 13) ** 2 - 32**2  # its 13 new tokens read the 32 cached too
    assert chunk.start_position == 32
    assert chunk.token_ids == b.prompt_token_ids[32:]
    assert chunk.block_table[:8] == a_table[:8]
    assert sim.bm.prefix_hits == hits + 8
    sim.run()

    # The whole prompt cached (a multiple of the block size): its last block is recomputed.
    c = sim.add("c", a.prompt_token_ids, max_tokens=1)
    (chunk,) = sim.step().chunks
    assert chunk.start_position == 36 == c.num_cached_tokens
    assert chunk.token_ids == c.prompt_token_ids[36:] and chunk.sample
    assert sim.bm.num_used_blocks == 0  # finished after its one token


def test_prefix_hit_respects_the_prefill_chunk() -> None:
    sim = Sim(SchedulerConfig(max_num_batched_tokens=256, long_prefill_chunk=5), 64, 4)
    a = sim.add("a", list(range(30)), max_tokens=1)
    sim.run()
    b = sim.add("b", a.prompt_token_ids[:20] + list(range(60, 75)), max_tokens=1)
    starts = []
    while b.status is not SequenceStatus.FINISHED:
        (chunk,) = sim.step().chunks
        starts.append(chunk.start_position)
    assert starts == [20, 25, 30]


def test_detach_keeps_blocks_until_freed() -> None:
    sim = Sim(SchedulerConfig(max_num_batched_tokens=64, long_prefill_chunk=64), 6, 4)
    a = sim.add("a", list(range(10)), max_tokens=5)
    sim.step()
    assert a.num_output_tokens == 1
    table = list(a.block_table)
    sim.sched.detach(a)
    assert a.block_table == table and len(table) == 3
    assert sim.bm.num_used_blocks == 3
    assert not sim.sched.has_work
    assert sim.sched.schedule().chunks == []

    b = sim.add("b", list(range(50, 62)), max_tokens=1)  # takes the other 3 blocks
    (chunk,) = sim.step().chunks
    assert set(chunk.block_table).isdisjoint(table)
    c = sim.add("c", [1, 2, 3], max_tokens=1)
    assert b.status is SequenceStatus.FINISHED
    sim.step()  # b's blocks came back, c fits in them; a's are still held
    assert c.status is SequenceStatus.FINISHED
    assert sim.bm.num_used_blocks == 3
    sim.bm.free(a)
    assert sim.bm.num_used_blocks == 0


def test_detached_blocks_are_not_handed_out_under_pressure() -> None:
    sim = Sim(SchedulerConfig(max_num_batched_tokens=64, long_prefill_chunk=64), 6, 4)
    a = sim.add("a", list(range(10)), max_tokens=5)
    sim.step()
    sim.sched.detach(a)
    big = sim.add("big", list(range(50, 62)) + [1], max_tokens=1)  # needs 4 blocks, 3 are free
    for _ in range(3):
        assert sim.step().chunks == []
    assert big.status is SequenceStatus.WAITING and big.block_table == []
    sim.sched.finish(a, FinishReason.ABORT)
    sim.run()
    assert big.status is SequenceStatus.FINISHED
    assert sim.bm.num_used_blocks == 0


def test_the_queue_counts_the_prompt_tokens_left_to_compute_past_a_cached_prefix_and_mid_chunk() -> None:
    """What a prefill worker reports as queued, per prompt: a router predicts the wait behind it from this. Its squares
    are each prompt's attention as a router prices it: new tokens read the cached and computed tokens before them too
    (n new after c counts (c + n)² - c²)."""
    sim = Sim(SchedulerConfig(max_num_batched_tokens=10, long_prefill_chunk=10, max_prefills_per_step=1), 64, 4)
    a = sim.add("a", list(range(30)), max_tokens=1)
    assert sim.sched.queued_prefill() == QueuedPrefill(1, 30, 30 * 30)
    sim.step()  # its first chunk
    # the rest of a prompt part-way through: what is left of its 30² once 10 tokens are done
    assert sim.sched.queued_prefill() == QueuedPrefill(1, 20, 30 * 30 - 10 * 10)
    sim.run()
    sim.add("b", a.prompt_token_ids[:20] + list(range(60, 72)), max_tokens=1)  # 20 cached, 12 new
    sim.add("c", list(range(80, 92)), max_tokens=1)
    assert sim.sched.queued_prefill() == QueuedPrefill(2, 12 + 12, 32 * 32 - 20 * 20 + 12 * 12)
    sim.step()  # b's first chunk: 10 of its 12 new tokens, after its 20 cached
    assert sim.sched.queued_prefill() == QueuedPrefill(2, 2 + 12, 32 * 32 - 30 * 30 + 12 * 12)
    sim.run()
    assert sim.sched.queued_prefill() == QueuedPrefill()
