"""The engine end to end on tiny-random: blocks freed, greedy the same alone, batched, chunked and preempted, stop
tokens, bad requests refused, the prefix cache per salt."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest

from pdserve.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.errors import InvalidRequestError
from pdserve.protocol.engine_request import EngineRequest
from pdserve.protocol.outputs import FinishReason
from pdserve.protocol.sampling import SamplingParams
from tests.unit.engine.engine_harness import (
    GREEDY,
    assert_idle,
    complete,
    make_engine,
    prompts,
    record_schedules,
    run_to_end,
    tokens,
)

# A scheduling bug tends to hang the engine loop rather than fail; bound every test.
pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def shared_engine() -> LLMEngine:
    return make_engine()


@pytest.fixture
def engine(shared_engine: LLMEngine) -> Iterator[LLMEngine]:
    assert_idle(shared_engine)
    yield shared_engine
    # A failed test must not leave work behind for the next one.
    for seq in [*shared_engine.scheduler.running, *shared_engine.scheduler.waiting]:
        shared_engine.abort(seq.seq_id)


@pytest.fixture(scope="module")
def reference(shared_engine: LLMEngine) -> list[list[int]]:
    """Greedy outputs of each prompt run alone on a roomy pool."""
    return [complete(shared_engine, [p], GREEDY)[0][0] for p in prompts(5)]


def test_no_blocks_leak_after_finish(engine: LLMEngine) -> None:
    done = engine.generate(prompts(4, seed=1), SamplingParams(max_tokens=10))
    assert all(c.finish_reason in (FinishReason.LENGTH, FinishReason.EOS) for c in done)
    assert_idle(engine)


def test_abort_mid_generation_frees_blocks(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    for i, p in enumerate(prompts(3, seed=2)):
        engine.add_request(EngineRequest(f"abort-{i}", p, params))
    for _ in range(3):
        engine.step()
    assert engine.blocks.num_used_blocks > 0
    used = engine.blocks.num_used_blocks
    assert engine.abort("abort-1")
    assert engine.blocks.num_used_blocks < used
    for _ in range(2):
        assert "abort-1" not in {o.request_id for o in engine.step()}
    assert engine.abort("abort-0")
    assert engine.abort("abort-2")
    assert_idle(engine)
    assert not engine.abort("abort-1")  # already gone
    assert engine.step() == []


def test_abort_of_a_waiting_request() -> None:
    engine = make_engine(max_num_seqs=1)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    engine.add_request(EngineRequest("running", prompts(1, seed=3)[0], params))
    engine.add_request(EngineRequest("waiting", prompts(1, seed=4)[0], params))
    engine.step()
    assert engine.abort("waiting")
    outs = run_to_end(engine)
    assert set(outs) == {"running"}
    assert outs["running"][-1].finish_reason is FinishReason.LENGTH
    assert_idle(engine)


def test_unknown_request_abort_returns_false(engine: LLMEngine) -> None:
    assert engine.abort("never-added") is False
    assert_idle(engine)


def test_greedy_is_the_same_alone_and_batched(engine: LLMEngine, reference: list[list[int]]) -> None:
    together = complete(engine, prompts(5), GREEDY)
    assert tokens(together) == reference
    assert all(reason is FinishReason.LENGTH and len(t) == 24 for t, reason in together)
    assert_idle(engine)


@pytest.mark.parametrize(
    ("num_kv_blocks", "scheduler"),
    [
        (8, {}),  # 5 requests of up to 64 tokens, 128 tokens of KV: preemption
        (256, {"long_prefill_chunk": 7}),
        (256, {"max_num_batched_tokens": 9, "long_prefill_chunk": 9}),
        (8, {"long_prefill_chunk": 5, "max_num_seqs": 3}),
    ],
)
def test_greedy_is_the_same_under_preemption_and_chunked_prefill(
    num_kv_blocks: int, scheduler: dict[str, int], reference: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(num_kv_blocks, **scheduler)
    plans = record_schedules(engine, monkeypatch)
    assert tokens(complete(engine, prompts(5), GREEDY)) == reference
    assert_idle(engine)
    if num_kv_blocks == 8:
        assert any(p.preempted for p in plans)
    if "long_prefill_chunk" in scheduler:
        # Some prefill continued a previous chunk.
        assert any(c.start_position > 0 and len(c.token_ids) > 1 for p in plans for c in p.chunks)


def test_prefix_cache_hit_gives_the_same_output() -> None:
    engine = make_engine(64)
    prompt = prompts(1, lo=50, hi=50, seed=5)[0]
    ((first, _),) = complete(engine, [prompt], GREEDY)
    engine.add_request(EngineRequest("again", prompt, GREEDY))
    outs = run_to_end(engine)["again"]
    assert outs[0].num_cached_tokens == 48  # 3 full blocks of 16; the rest is recomputed
    assert engine.blocks.prefix_hits >= 3
    assert [t for o in outs for t in o.new_token_ids] == first
    assert_idle(engine)


def test_sampling_is_reproducible_per_seed(engine: LLMEngine) -> None:
    prompt = prompts(1, seed=6)[0]

    def sample(seed: int, others: int = 0) -> list[int]:
        params = [SamplingParams(max_tokens=20, temperature=1.0, seed=seed, ignore_eos=True)]
        params += [SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)] * others
        return complete(engine, [prompt] + prompts(others, seed=7), params)[0][0]

    a = sample(123)
    assert sample(123) == a
    assert sample(123, others=3) == a  # unaffected by unseeded neighbours in the batch
    assert sample(124) != a
    assert_idle(engine)


def test_max_tokens_ends_with_length(engine: LLMEngine) -> None:
    for n in (1, 2, 7):
        ((done, reason),) = complete(engine, prompts(1, seed=8), SamplingParams(max_tokens=n, ignore_eos=True))
        assert len(done) == n
        assert reason is FinishReason.LENGTH
    assert_idle(engine)


def test_stop_token_id_ends_with_stop(engine: LLMEngine, reference: list[list[int]]) -> None:
    full = reference[0]
    # A token whose first occurrence is past the start, so the stop is visibly early.
    index = next(i for i, t in enumerate(full) if i > 0 and t not in full[:i])
    stop = full[index]
    ((done, reason),) = complete(
        engine, prompts(1), SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=(stop,))
    )
    assert reason is FinishReason.STOP
    assert done in (full[:index], full[: index + 1])
    assert_idle(engine)


def test_a_stop_tokens_own_text_is_not_in_the_output(engine: LLMEngine, reference: list[list[int]]) -> None:
    """As vLLM (and a stop string here): the output's text ends before the stop token, whose id is still sent."""
    full = reference[0]
    # A token of its own ASCII character (tiny-random's byte tokens: id 3 + the byte), first seen past the start.
    index = next(i for i, t in enumerate(full) if i > 1 and t not in full[:i] and 35 <= t < 130)
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    before = engine.generate([prompts(1)[0]], replace(greedy, max_tokens=index))[0]
    through = engine.generate([prompts(1)[0]], replace(greedy, max_tokens=index + 1))[0]
    stopped = engine.generate([prompts(1)[0]], replace(greedy, stop_token_ids=(full[index],)))[0]
    assert stopped.token_ids == full[: index + 1] and stopped.finish_reason is FinishReason.STOP
    assert stopped.text == before.text != through.text
    assert_idle(engine)


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ([], SamplingParams(), "prompt"),
        ([5, 259], SamplingParams(), "prompt_token_ids"),
        ([-1, 5], SamplingParams(), "prompt_token_ids"),
        ([5] * 100, SamplingParams(max_tokens=4000), "sampling.max_tokens"),  # 4100 > the 4096-token context
        ([5], SamplingParams(stop_token_ids=(259,)), "sampling.stop_token_ids"),
    ],
)
def test_invalid_requests_are_rejected(
    engine: LLMEngine, prompt: list[int], params: SamplingParams, field: str
) -> None:
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(EngineRequest("bad", prompt, params))
    assert err.value.field == field
    assert_idle(engine)
    assert engine.abort("bad") is False  # nothing half-registered


def test_context_limit_is_inclusive(engine: LLMEngine) -> None:
    engine.validate([5] * 96, SamplingParams(max_tokens=4000))  # exactly 4096: allowed


def test_duplicate_request_id_is_rejected(engine: LLMEngine) -> None:
    engine.add_request(EngineRequest("dup", [5, 6, 7], SamplingParams(max_tokens=3)))
    with pytest.raises(InvalidRequestError):
        engine.add_request(EngineRequest("dup", [8, 9], SamplingParams(max_tokens=3)))
    outs = run_to_end(engine)
    assert len(outs["dup"]) == 3  # the first one is unharmed
    assert_idle(engine)


def test_request_larger_than_the_pool_is_rejected_up_front() -> None:
    engine = make_engine(num_kv_blocks=4)  # 64 tokens of KV
    with pytest.raises(InvalidRequestError):
        engine.add_request(EngineRequest("huge", [5] * 60, SamplingParams(max_tokens=10)))
    with pytest.raises(InvalidRequestError):
        engine.add_request(EngineRequest("huge-prompt", [5] * 65, SamplingParams(max_tokens=1)))
    assert_idle(engine)
    # One that fits exactly runs to completion instead of waiting forever, even alongside others.
    engine.add_request(EngineRequest("fits", [5] * 50, SamplingParams(max_tokens=14, ignore_eos=True)))
    engine.add_request(EngineRequest("other", [6] * 30, SamplingParams(max_tokens=10, ignore_eos=True)))
    outs = run_to_end(engine, max_steps=500)
    assert outs["fits"][-1].finish_reason is FinishReason.LENGTH
    assert sum(len(o.new_token_ids) for o in outs["fits"]) == 14
    assert_idle(engine)


def test_prefix_cache_is_shared_only_under_the_same_salt() -> None:
    """A tenant's salt starts its key chain: the same prompt under another salt is computed afresh (no hit,
    so no timing difference to observe), and under its own salt hits as before."""
    engine = make_engine(64)
    prompt = prompts(1, lo=50, hi=50, seed=6)[0]
    engine.add_request(EngineRequest("a", prompt, GREEDY, cache_salt=b"tenant-a"))
    first = run_to_end(engine)["a"]
    engine.add_request(EngineRequest("b", prompt, GREEDY, cache_salt=b"tenant-b"))
    engine.add_request(EngineRequest("plain", prompt, GREEDY))
    outs = run_to_end(engine)
    assert outs["b"][0].num_cached_tokens == 0 == outs["plain"][0].num_cached_tokens
    engine.add_request(EngineRequest("a-again", prompt, GREEDY, cache_salt=b"tenant-a"))
    again = run_to_end(engine)["a-again"]
    assert again[0].num_cached_tokens == 48
    assert [t for o in again for t in o.new_token_ids] == [t for o in first for t in o.new_token_ids]
    assert_idle(engine)


def test_a_resumed_stream_keeps_its_penalties_history(engine: LLMEngine) -> None:
    """A stream moved after k tokens is prefilled again with those k tokens appended to its prompt; told they
    are its own output, the engine penalizes them as output and continues exactly as the unmoved stream."""
    penalized = SamplingParams(max_tokens=24, ignore_eos=True, presence_penalty=1.5, frequency_penalty=1.0)
    prompt = prompts(1, lo=30, hi=30, seed=4)[0]
    unmoved = complete(engine, [prompt], penalized)[0][0]
    assert unmoved != complete(engine, [prompt], GREEDY)[0][0]  # the penalties matter here
    k = 10
    rest = SamplingParams(max_tokens=24 - k, ignore_eos=True, presence_penalty=1.5, frequency_penalty=1.0)
    engine.add_request(EngineRequest("resumed", prompt + unmoved[:k], rest, resumed_output_tokens=k))
    outs = run_to_end(engine)["resumed"]
    assert [t for o in outs for t in o.new_token_ids] == unmoved[k:]
    assert complete(engine, [prompt + unmoved[:k]], rest)[0][0] != unmoved[k:]  # without the history it differs


def test_resumed_output_tokens_past_the_prompt_are_invalid(engine: LLMEngine) -> None:
    with pytest.raises(InvalidRequestError, match=r"must be in \[0, 3\], got 4") as err:
        engine.add_request(EngineRequest("bad", [5, 6, 7], SamplingParams(), resumed_output_tokens=4))
    assert err.value.field == "resumed_output_tokens"
    assert_idle(engine)


def test_a_stop_string_ending_in_the_last_tokens_whole_characters_finishes_with_stop() -> None:
    """SmolLM2's token 15107 is a space and the first two bytes of an emoji: ending on it, the space is text (the
    emoji's bytes are dropped), so a stop string " " is found at the finish: cut there, and the reason is STOP."""
    config = EngineConfig(model="smollm2-135m", dtype="float32", device="cpu", num_kv_blocks=64, num_threads=1)
    engine = LLMEngine(config)
    forced = dict(max_tokens=1, ignore_eos=True, logit_bias=((15107, 100.0),))
    plain, stopped = engine.generate(
        [engine.tokenizer.encode("Hi")] * 2, [SamplingParams(**forced), SamplingParams(**forced, stop=(" ",))]
    )
    assert (plain.token_ids, plain.text, plain.finish_reason) == ([15107], " ", FinishReason.LENGTH)
    assert (stopped.token_ids, stopped.text, stopped.finish_reason) == ([15107], "", FinishReason.STOP)


def test_a_prefill_worker_refuses_only_a_prompt_its_whole_kv_cannot_hold() -> None:
    """It hands the prompt's blocks off after the first token, so max_tokens takes none of its KV: a small prefill
    worker serves long answers, and a prompt past its KV is invalid there, named as the prompt."""
    from pdserve.config import SchedulerConfig
    from pdserve.protocol.roles import EngineMode

    config = EngineConfig(model="tiny-random", dtype="float32", device="cpu", num_kv_blocks=2, num_threads=1)
    engine = LLMEngine(replace(config, scheduler=SchedulerConfig(mode=EngineMode.PREFILL_ONLY)))
    size = engine.blocks.block_size
    engine.add_request(EngineRequest("long-answer", [5] * size, SamplingParams(max_tokens=50 * size)))
    with pytest.raises(InvalidRequestError, match="the prompt needs 3 KV blocks; this worker has 2") as err:
        engine.add_request(EngineRequest("long-prompt", [5] * (2 * size + 1), SamplingParams(max_tokens=1)))
    assert err.value.field == "prompt_token_ids"


def test_a_request_that_fills_the_kv_to_its_last_slot_runs_and_one_token_more_is_refused() -> None:
    """The last token is sampled, never run through the model: a request fills prompt + max_tokens - 1 slots."""
    engine = make_engine(num_kv_blocks=4, block_size=4)
    prompt, greedy = list(range(5, 15)), SamplingParams(max_tokens=7, ignore_eos=True)  # 10 + 7 - 1 = 16 slots
    ((tokens, reason),) = complete(engine, [prompt], greedy)
    assert reason is FinishReason.LENGTH and tokens == complete(make_engine(), [prompt], greedy)[0][0]
    assert_idle(engine)
    with pytest.raises(InvalidRequestError, match=r"prompt \+ max_tokens needs 5 KV blocks; this worker has 4"):
        engine.add_request(EngineRequest("one-more", prompt, SamplingParams(max_tokens=8)))
    with pytest.raises(InvalidRequestError, match="the prompt needs 5 KV blocks; this worker has 4") as err:
        engine.add_request(EngineRequest("too-long", list(range(5, 22)), SamplingParams(max_tokens=1)))
    assert err.value.field == "prompt_token_ids"  # no max_tokens would make it fit
