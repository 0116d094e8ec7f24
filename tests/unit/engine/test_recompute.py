"""A sequence preempted for want of blocks and recomputed (a pool too small for two sequences' outputs): what it
reports and computes is what it did at admission, not its recompute's."""

from __future__ import annotations

from dataclasses import replace

import torch

from pdserve.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.protocol.engine_request import EngineRequest
from pdserve.protocol.outputs import RequestOutput
from pdserve.protocol.sampling import SamplingParams


def small_pool(num_kv_blocks: int) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model="tiny-random", dtype="float32", device="cpu", block_size=4, num_kv_blocks=num_kv_blocks)
    )


def last_outputs(engine: LLMEngine) -> dict[str, RequestOutput]:
    last: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        last |= {out.request_id: out for out in engine.step()}
    return last


def test_a_recompute_reports_no_cached_prompt_tokens_of_its_own_blocks() -> None:
    engine = small_pool(16)
    sampling = SamplingParams(max_tokens=40, ignore_eos=True)
    for name, first in (("a", 5), ("b", 100)):
        engine.add_request(EngineRequest(name, list(range(first, first + 10)), sampling))
    last = last_outputs(engine)
    assert engine.scheduler.num_preemptions >= 1
    assert {name: out.num_cached_tokens for name, out in last.items()} == {"a": 0, "b": 0}  # nothing was cached
    assert engine.blocks.prefix_hits == 0  # nor is the recompute's reuse of its own blocks a hit (metric, eviction)


def test_a_recompute_after_the_first_token_computes_no_prompt_logits() -> None:
    """The prompt's logprobs were all recorded before the first token: a recompute's prompt rows would be full
    vocabulary logits for nothing (hundreds of MB a chunk on a large vocabulary)."""
    engine = small_pool(14)
    rows: list[int] = []
    compute_logits = engine.model.compute_logits

    def counting(hidden: torch.Tensor) -> torch.Tensor:
        rows.append(hidden.shape[0])
        return compute_logits(hidden)

    engine.model.compute_logits = counting  # type: ignore[method-assign]
    engine.add_request(EngineRequest("a", list(range(5, 25)), SamplingParams(max_tokens=30, ignore_eos=True)))
    asked = SamplingParams(max_tokens=30, ignore_eos=True, prompt_logprobs=1)
    engine.add_request(EngineRequest("b", list(range(100, 120)), asked))
    emitted = 0
    while engine.has_unfinished():
        emitted += sum(len(out.prompt_logprobs) for out in engine.step())
    assert engine.scheduler.num_preemptions >= 1 and emitted == 19
    assert sum(r for r in rows if r > 2) == 20  # b's 20 prompt rows once; every other step 2 rows or fewer


def test_a_preempted_stream_is_told_it_waits_until_its_recompute_caught_up() -> None:
    """Between its preemption and its next token nothing else comes: the notices (no token) are what tell a router's
    stall bound that the worker lives, through the wait and the chunked recompute alike."""
    config = EngineConfig(model="tiny-random", dtype="float32", device="cpu", block_size=4, num_kv_blocks=16)
    engine = LLMEngine(replace(config, scheduler=replace(config.scheduler, long_prefill_chunk=4)))
    sampling = SamplingParams(max_tokens=40, ignore_eos=True)
    for name, first in (("a", 5), ("b", 100)):
        engine.add_request(EngineRequest(name, list(range(first, first + 10)), sampling))
    streamed: set[str] = set()  # past their first token: from then on every step tells them something
    silent_steps, recompute_noticed = 0, False
    while engine.has_unfinished():
        notices = engine.preempted_outputs()
        assert all(not out.new_token_ids and out.finish_reason is None for out in notices)
        noticed = {out.request_id for out in notices}
        recompute_noticed |= any(s.seq_id in noticed for s in engine.scheduler.running)
        seqs = {s.seq_id: s for s in (*engine.scheduler.waiting, *engine.scheduler.running)}
        preempted_before = {name: seq.num_preemptions for name, seq in seqs.items()}
        outputs = engine.step()
        tokens = {out.request_id for out in outputs}
        # Silent: a streamed sequence that got neither a token nor a notice, unless this very step preempted it
        # (its notice comes with the next one).
        silent_steps += sum(
            1
            for name in (seqs.keys() & streamed) - tokens - noticed
            if seqs[name].num_preemptions == preempted_before[name]
        )
        streamed |= tokens
    assert engine.scheduler.num_preemptions >= 1 and recompute_noticed
    assert silent_steps == 0
