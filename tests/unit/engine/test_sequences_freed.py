"""The engine's count of the sequences it freed: each request's last output says it once the request's blocks were
free, and its published load says it as sampled with the free blocks, so a router can tell which of the two came
first (services/router/worker_frees.py)."""

from __future__ import annotations

from pdserve.protocol.engine_request import EngineRequest
from pdserve.protocol.sampling import SamplingParams
from tests.unit.engine.engine_harness import make_engine


def test_each_end_says_the_count_its_free_made_and_the_published_load_says_it_with_the_free_blocks() -> None:
    engine = make_engine(num_kv_blocks=16, block_size=4)
    for name, max_tokens in (("short", 2), ("long", 6), ("aborted", 40)):
        engine.add_request(EngineRequest(name, [5, 6, 7, 8, 9], SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    assert engine.stats()["sequences_freed"] == 0
    last = {}
    while "long" not in last:
        for out in engine.step():
            if out.finished:
                last[out.request_id] = out.sequences_freed
                stats = engine.stats()  # sampled after this end: its blocks are free in it
                assert stats["sequences_freed"] == out.sequences_freed
                assert stats["kv_blocks_free"] == 16 - engine.blocks.num_used_blocks
    assert last == {"short": 1, "long": 2}
    assert engine.abort("aborted")
    assert engine.stats()["sequences_freed"] == 3 and engine.stats()["kv_blocks_free"] == 16
