"""A seeded request's tokens are the same however its engines split it: colocated, handed from a prefill-only to a
decode-only engine (the KV copied as a transfer would), or migrated mid-stream with the tokens it already sent.
A seeded token's noise is its seed's and position's alone, so no engine needs to know what was drawn elsewhere."""

from __future__ import annotations

from dataclasses import replace

from pdserve.config import EngineConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.protocol.engine_request import EngineRequest
from pdserve.protocol.roles import EngineMode
from pdserve.protocol.sampling import SamplingParams
from tests.unit.engine.engine_harness import run_to_end

PROMPT = [5, 17, 99, 120, 33, 7, 8, 200, 201, 45, 46, 47]
SEEDED = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)


def engine(mode: EngineMode) -> LLMEngine:
    config = EngineConfig(model="tiny-random", dtype="float32", device="cpu", num_kv_blocks=64, num_threads=1)
    return LLMEngine(replace(config, scheduler=SchedulerConfig(mode=mode)))


def colocated(request: EngineRequest) -> list[int]:
    e = engine(EngineMode.MIXED)
    e.add_request(request)
    return [t for out in run_to_end(e)[request.request_id] for t in out.new_token_ids]


def handed_off(request: EngineRequest) -> list[int]:
    prefill, decode = engine(EngineMode.PREFILL_ONLY), engine(EngineMode.DECODE_ONLY)
    prefill.add_request(request)
    while not (outs := prefill.step()):
        pass
    (first,) = outs
    blocks = decode.reserve(request)
    for source, target in zip(prefill.runner.kv_caches, decode.runner.kv_caches, strict=True):
        target[:, blocks] = source[:, list(first.handoff_block_ids)]
    prefill.release(request.request_id)
    decode.commit(request.request_id, first.new_token_ids[0])
    return [*first.new_token_ids, *(t for out in run_to_end(decode)[request.request_id] for t in out.new_token_ids)]


def test_a_seeded_request_samples_the_same_tokens_colocated_handed_off_and_migrated() -> None:
    expected = colocated(EngineRequest("a", PROMPT, SEEDED))
    assert len(expected) == SEEDED.max_tokens
    assert handed_off(EngineRequest("a", PROMPT, SEEDED)) == expected
    sent = 5  # a stream moved after five tokens: its prompt carries them, and it continues from the sixth
    sampling = replace(SEEDED, max_tokens=16 - sent)
    moved = EngineRequest("a.2", PROMPT + expected[:sent], sampling, resumed_output_tokens=sent)
    assert colocated(moved) == expected[sent:]
    assert handed_off(moved) == expected[sent:]
    other_seed = colocated(EngineRequest("b", PROMPT, replace(SEEDED, seed=1235)))
    assert other_seed != expected  # the draws matter: the test can tell
