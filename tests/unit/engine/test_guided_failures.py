"""A matcher that fails mid-output (its grammar past the worker's limits on lexers) fails its request: the caller
gets the tokens before, then an error naming the constraint, never a STOP that reads as a complete match. A prefill
worker's decision that the first token ended a request holds on the decode worker, which has no KV to go on with.

Lexer states are capped low here, so that tiny-random's byte-sized tokens reach the cap within a few tokens; they
are shared by every copy of a compiled grammar, so a grammar one walk wore to the cap fails the next at its first."""

from __future__ import annotations

import asyncio
import re

import llguidance
import pytest

from pdserve.engine import guided
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.engine import LLMEngine
from pdserve.errors import InvalidRequestError
from pdserve.protocol.engine_request import EngineRequest
from pdserve.protocol.handoff import FirstToken
from pdserve.protocol.output_constraint import OutputConstraint
from pdserve.protocol.outputs import FinishReason, RequestOutput
from pdserve.protocol.roles import EngineMode
from pdserve.protocol.sampling import SamplingParams
from tests.unit.engine.test_seeded_handoff import PROMPT, engine

LETTERS = OutputConstraint("regex", "[a-z]{30}")
BRANCHES = OutputConstraint("regex", "g[a-z]{30}|h[0-9]{30}")


@pytest.fixture(autouse=True)
def few_lexer_states(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(guided, "_limits", lambda: llguidance.LLParserLimits(max_lexer_states=12))


def letters(max_tokens: int = 40) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, constraint=LETTERS)


def worn(e: LLMEngine) -> llguidance.LLMatcher:
    """BRANCHES compiled, its shared lexer states worn to the cap down the h branch: a copy that takes g fails."""
    compiled = e.guided.compile(BRANCHES)
    walk = compiled.deep_copy()
    for token in e.tokenizer.encode("h" + "0123456789" * 3):
        walk.compute_bitmask()
        if not walk.consume_token(token):
            return compiled
    raise AssertionError("never reached the cap")


def take_g(e: LLMEngine) -> SamplingParams:
    return SamplingParams(max_tokens=8, constraint=BRANCHES, logit_bias=((e.tokenizer.encode("g")[0], 100.0),))


def test_a_constraint_failing_mid_output_ends_it_with_an_error_after_the_tokens_before():
    e = engine(EngineMode.MIXED)
    e.add_request(EngineRequest("r", PROMPT, letters()))
    outputs: list[RequestOutput] = []
    while e.has_unfinished():
        outputs += e.step()
    *before, last = outputs
    assert last.finish_reason is FinishReason.ABORT and last.error is not None
    assert last.error.field == "sampling.regex"
    assert f"could not be held to it past {len(before)} tokens" in str(last.error)
    assert before and re.fullmatch("[a-z]+", "".join(out.new_text for out in before))
    assert all(out.error is None and out.finish_reason is None for out in before)
    # Its shared lexer states may be what ran out: the next request compiles the grammar afresh.
    assert LETTERS.grammar not in e.guided._compiled


def test_its_stream_yields_the_tokens_before_then_raises_the_error():
    async_engine = AsyncEngine(engine(EngineMode.MIXED))

    async def stream() -> list[int]:
        tokens: list[int] = []
        with pytest.raises(InvalidRequestError, match=r"sampling\.regex: the output could not be held") as failed:
            async for out in async_engine.generate(EngineRequest("r", PROMPT, letters())):
                tokens += out.new_token_ids
        assert f"past {len(tokens)} tokens" in str(failed.value)
        return tokens

    try:
        assert asyncio.run(stream())
    finally:
        async_engine.stop()


def test_a_prefill_whose_first_token_fails_its_constraint_raises_and_hands_nothing_off():
    """Before, its matcher's error read as STOP: no KV was sent, and the decode worker, whose own matcher took the
    same token, went on and failed the request with INTERNAL."""
    e = engine(EngineMode.PREFILL_ONLY)
    async_engine = AsyncEngine(e)
    request = EngineRequest("p", PROMPT, take_g(e), grammar=worn(e))
    try:
        with pytest.raises(InvalidRequestError, match="past 0 tokens"):
            asyncio.run(async_engine.prefill(request))
    finally:
        async_engine.stop()
    assert e.blocks.num_used_blocks == 0 and not e.has_unfinished()


def test_a_decode_worker_ends_a_request_whose_first_token_the_prefill_worker_ended():
    """No KV came: the prefill worker's reason holds, whatever this worker's own check of the token finds; a prefill
    worker of an earlier build says none (STOP). Before, this raised "no KV came, yet its first token did not end
    it"."""
    e = engine(EngineMode.DECODE_ONLY)
    for request_id, said, ends in [("a", FinishReason.EOS, FinishReason.EOS), ("b", None, FinishReason.STOP)]:
        e.reserve(EngineRequest(request_id, PROMPT, letters()))
        out = e.commit(request_id, e.tokenizer.encode("q")[0], kv_received=False, first_finish=said)
        assert (out.finish_reason, out.error) == (ends, None)
    assert e.blocks.num_used_blocks == 0 and not e.has_unfinished()


def test_a_decode_worker_whose_own_matcher_fails_on_the_first_token_raises():
    e = engine(EngineMode.DECODE_ONLY)
    async_engine = AsyncEngine(e)
    request = EngineRequest("d", PROMPT, take_g(e), grammar=worn(e))

    async def commit() -> None:
        await async_engine.reserve(request)
        async for _ in async_engine.commit_and_stream("d", FirstToken(e.tokenizer.encode("g")[0], True, 0)):
            raise AssertionError("streamed")

    try:
        with pytest.raises(InvalidRequestError, match="past 0 tokens"):
            asyncio.run(commit())
    finally:
        async_engine.stop()
    assert e.blocks.num_used_blocks == 0


def test_a_batch_run_raises_the_error_rather_than_return_a_cut_output_as_complete():
    """`pdserve generate` printed the tokens before the failure and the failing one, finish `abort`."""
    e = engine(EngineMode.MIXED)
    with pytest.raises(InvalidRequestError, match="could not be held to it past"):
        e.generate([PROMPT, PROMPT], [letters(), SamplingParams(max_tokens=4)])
    assert not e.has_unfinished()
