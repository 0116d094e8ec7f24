"""Block tables come in runs of consecutive ids, which KV transfers move without copies."""

from __future__ import annotations

from pdserve.bench.transfer_bench import churned_block_ids, count_runs
from pdserve.engine.block_manager import BlockManager
from tests.unit.engine.block_helpers import BS, admit, check_counts, make_seq


def _is_run(blocks: list[int]) -> bool:
    return blocks == list(range(blocks[0], blocks[0] + len(blocks)))


def test_blocks_come_in_runs_after_churn() -> None:
    """Transfers move runs without copies: a new table is one run when a free run holds it, and a table
    that grows continues its run while the next block is free."""
    bm = BlockManager(64, BS, enable_prefix_caching=False)
    seqs = [make_seq(f"s{i}", [1] * (BS * (i % 3 + 1))) for i in range(20)]
    for s in seqs:
        assert bm.allocate_slots(s, s.num_tokens)
    holes = [list(s.block_table) for s in seqs[::2]]  # of 1-3 blocks between live tables once freed
    for s in seqs[::2]:
        bm.free(s)
    big = make_seq("big", [1] * (BS * 9))
    assert bm.allocate_slots(big, big.num_tokens)
    assert _is_run(big.block_table)
    small = make_seq("small", [1] * BS)
    assert bm.allocate_slots(small, BS)
    assert [small.block_table[0]] in holes  # best fit: a one-block hole, not the start of a longer run
    chunked = make_seq("chunked", [1] * (BS * 4))  # a prompt computed one block per step
    for _ in range(4):
        assert bm.allocate_slots(chunked, BS)
        chunked.num_computed_tokens += BS
    assert _is_run(chunked.block_table)
    chunked.output_token_ids.extend([1] * BS)  # and decoding on past it
    assert bm.allocate_slots(chunked, BS)
    assert _is_run(chunked.block_table)
    # A table longer than any free run takes the longest runs it can, and the pool still adds up.
    rest = make_seq("rest", [1] * (BS * bm.num_free_blocks))
    assert bm.allocate_slots(rest, rest.num_tokens)
    assert bm.num_free_blocks == 0
    for s in [*seqs[1::2], big, small, chunked, rest]:
        bm.free(s)
    assert bm.num_free_blocks == bm.num_blocks
    check_counts(bm)


def test_evicted_cached_blocks_come_back_as_a_run_oldest_first() -> None:
    bm = BlockManager(12, BS)
    a, b = make_seq("a", list(range(6 * BS))), make_seq("b", [100 + i for i in range(6 * BS)])
    admit(bm, a)
    admit(bm, b)
    assert (a.block_table, b.block_table) == (list(range(6)), list(range(6, 12)))
    bm.free(a)  # tail first: 5 is the least recently used block, then 4, ...
    bm.free(b)
    assert bm.num_cached_blocks == 12
    c = make_seq("c", [200] * (4 * BS))
    assert bm.allocate_slots(c, c.num_tokens)
    assert c.block_table == [2, 3, 4, 5]
    assert bm.match_prefix(make_seq("a2", list(range(6 * BS)))) == [0, 1]  # a's prefix blocks stay cached


def test_a_run_cut_from_cached_blocks_stops_at_a_prefix_that_served_a_hit() -> None:
    """The oldest cached blocks sit just above a hot prefix (cached, reused since, freed again last): a new table
    evicts the cold ones and free blocks for its run, not the hot prefix below them, although it is adjacent."""
    bm = BlockManager(16, BS)
    hot, cold = list(range(100, 100 + 4 * BS)) + [1], list(range(200, 200 + 4 * BS)) + [1]
    h, c, filler = make_seq("hot", hot), make_seq("cold", cold), make_seq("filler", list(range(300, 300 + 5 * BS)))
    for seq in (h, c, filler):
        admit(bm, seq)
    assert (h.block_table, c.block_table) == ([0, 1, 2, 3, 4], [5, 6, 7, 8, 9])
    for seq in (c, filler, h):  # cold is the least recently used
        bm.free(seq)
    again = make_seq("hot-again", hot)
    assert admit(bm, again) == [0, 1, 2, 3]  # a hit: these blocks are hot now
    bm.free(again)
    new = make_seq("new", list(range(400, 400 + 9 * BS)))
    assert bm.allocate_slots(new, new.num_tokens)
    assert bm.match_prefix(make_seq("hot-3", hot)) == [0, 1, 2, 3]
    assert bm.match_prefix(make_seq("cold-2", cold)) == []


def test_a_hot_prefix_is_not_evicted_while_scattered_free_blocks_make_up_the_table() -> None:
    """A hot prefix is the only cached run and the free blocks are single holes: a new table takes the holes, not
    a run cut from the prefix; once the holes cannot make up a table, the oldest blocks go, hot or not."""
    bm = BlockManager(8, BS)
    prefix = list(range(100, 100 + 3 * BS))
    h, fillers = make_seq("hot", prefix), [make_seq(f"f{i}", [200 + i] * BS) for i in range(5)]
    for seq in (h, *fillers):
        admit(bm, seq)
    for seq in (fillers[1], fillers[3], h):  # holes at blocks 4 and 6; the prefix cached in 0-2
        bm.free(seq)
    again = make_seq("hot-again", prefix + [1])
    assert admit(bm, again) == [0, 1, 2]  # a hit: the prefix is hot now
    bm.free(again)
    scattered = make_seq("scattered", list(range(300, 300 + 2 * BS)))
    assert bm.allocate_slots(scattered, scattered.num_tokens) and sorted(scattered.block_table) == [4, 6]
    assert bm.match_prefix(make_seq("hot-3", prefix + [1])) == [0, 1, 2]
    short = make_seq("short", list(range(400, 400 + 2 * BS)))
    assert bm.allocate_slots(short, short.num_tokens)  # no free block left: the prefix's oldest go
    check_counts(bm)


def test_a_worker_that_has_served_a_while_still_hands_out_runs() -> None:
    """Fragmentation guard, on the transfer bench's model of a worker's pool (1 GiB of SmolLM2 bf16 blocks):
    a 1,000-token prompt gets at most two runs on a prefill worker and one on a decode worker."""
    prefill = [count_runs(churned_block_ids(2917, 63, 16, 0.1, 512, True, seed)) for seed in range(5)]
    decode = [count_runs(churned_block_ids(2917, 63, 16, 0.6, 1 << 30, False, seed)) for seed in range(5)]
    assert max(prefill) <= 2, prefill
    assert decode == [1] * 5, decode
