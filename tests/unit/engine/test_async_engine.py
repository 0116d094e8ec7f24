"""AsyncEngine: callers on an event loop, the engine on its own thread; a caller that leaves must not stop it,
and a request id in flight belongs to its first caller."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterable, Iterator

import pytest

from pdserve.config import EngineConfig
from pdserve.engine.async_engine import AsyncEngine, EngineDeadError
from pdserve.engine.engine import LLMEngine
from pdserve.engine.output_streams import DuplicateRequestError
from pdserve.engine.scheduler import SchedulerConfig
from pdserve.engine.step_faults import InjectedEngineFault, StepFaults
from pdserve.errors import InvalidRequestError, UnavailableError
from pdserve.protocol.engine_request import EngineRequest
from pdserve.protocol.handoff import FirstToken
from pdserve.protocol.roles import EngineMode
from pdserve.protocol.sampling import SamplingParams

pytestmark = pytest.mark.timeout(60)
PROMPT = [5, 6, 7, 8, 9] * 4  # two blocks of 16
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def make_engine(mode: EngineMode) -> AsyncEngine:
    config = EngineConfig(
        model="tiny-random", device="cpu", num_kv_blocks=16, num_threads=1, scheduler=SchedulerConfig(mode=mode)
    )
    return AsyncEngine(LLMEngine(config))


@pytest.fixture
def mixed() -> Iterator[AsyncEngine]:
    engine = make_engine(EngineMode.MIXED)
    yield engine
    engine.stop()


@pytest.fixture
def prefill_only() -> Iterator[AsyncEngine]:
    engine = make_engine(EngineMode.PREFILL_ONLY)
    yield engine
    engine.stop()


async def until_used(engine: AsyncEngine, blocks: int) -> None:
    """The engine's published stats show `blocks` KV blocks held by live requests or hand-offs."""
    for _ in range(200):
        if engine.stats["kv_blocks_used"] == blocks:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{engine.stats['kv_blocks_used']} blocks used, expected {blocks}")


async def tokens(outputs: AsyncIterator) -> list[int]:
    return [t async for out in outputs for t in out.new_token_ids]


async def test_a_release_returns_at_once_and_the_engine_thread_frees_the_blocks_after_its_step(prefill_only):
    """The hand-off's release never waits for the step in flight (the first token downstream would wait with it);
    the blocks are free once that step ends."""
    engine = prefill_only
    held = await engine.prefill(EngineRequest("held", PROMPT, GREEDY))
    assert not held.finished and len(held.handoff_block_ids) == 2
    await until_used(engine, 2)
    gate, stepping = threading.Event(), threading.Event()

    def hold_the_engine_thread(*_: object) -> None:
        stepping.set()
        gate.wait(10)

    engine.on_step = hold_the_engine_thread
    other = asyncio.ensure_future(engine.prefill(EngineRequest("other", [1, 2, 3], GREEDY)))
    assert await asyncio.to_thread(stepping.wait, 10)  # the engine thread is mid-step
    engine.release("held")  # returns while the step runs
    assert engine.stats["kv_blocks_used"] >= 2  # not freed yet: only the engine thread touches the blocks
    engine.on_step = None
    gate.set()
    assert (await asyncio.wait_for(other, timeout=10)).handoff_block_ids
    engine.release("other")
    await until_used(engine, 0)
    assert engine.alive


async def test_duplicate_id_fails_the_second_caller_and_the_first_completes_mixed(mixed):
    expected = await tokens(mixed.generate(EngineRequest("alone", PROMPT, GREEDY)))
    assert len(expected) == GREEDY.max_tokens
    first = mixed.generate(EngineRequest("dup", PROMPT, GREEDY))
    got = (await anext(first)).new_token_ids
    with pytest.raises(DuplicateRequestError) as err:
        await anext(mixed.generate(EngineRequest("dup", [1, 2, 3], GREEDY)))
    assert err.value.field == "request_id"
    got += await asyncio.wait_for(tokens(first), timeout=20)
    assert got == expected
    await until_used(mixed, 0)


async def test_duplicate_id_fails_the_second_caller_and_the_first_completes_prefill(prefill_only):
    engine = prefill_only
    gate = threading.Event()
    engine.on_step = lambda *_: gate.wait(10)  # the first prefill is mid-step when the second arrives
    first = asyncio.ensure_future(engine.prefill(EngineRequest("dup", PROMPT, GREEDY)))
    await asyncio.sleep(0.2)
    with pytest.raises(DuplicateRequestError):
        await engine.prefill(EngineRequest("dup", [1, 2, 3], GREEDY))
    engine.on_step = None
    gate.set()
    out = await asyncio.wait_for(first, timeout=10)
    assert not out.finished and len(out.new_token_ids) == 1
    blocks = out.handoff_block_ids
    # Its blocks are held for the hand-off, stream closed: a second prefill now is refused by the engine itself,
    # and leaves the first's hand-off alone.
    with pytest.raises(InvalidRequestError, match="request_id"):
        await engine.prefill(EngineRequest("dup", [1, 2, 3], GREEDY))
    await until_used(engine, len(blocks))
    engine.release("dup")
    await until_used(engine, 0)


async def test_duplicate_reservation_leaves_the_first_alone():
    engine = make_engine(EngineMode.DECODE_ONLY)
    try:
        blocks = await engine.reserve(EngineRequest("dup", PROMPT, GREEDY))
        assert len(blocks) == 2
        with pytest.raises(InvalidRequestError, match="request_id"):
            await engine.reserve(EngineRequest("dup", PROMPT, GREEDY))
        await until_used(engine, 2)
        outputs = await tokens(engine.commit_and_stream("dup", FirstToken(7, True, 0)))
        assert outputs[0] == 7 and len(outputs) == GREEDY.max_tokens
        await until_used(engine, 0)
    finally:
        engine.stop()


async def test_a_reservation_whose_caller_left_holds_no_blocks():
    """The reserve runs on the engine thread after its caller was cancelled: it is undone, not leaked."""
    engine = make_engine(EngineMode.DECODE_ONLY)
    try:
        busy = EngineRequest("busy", PROMPT, SamplingParams(max_tokens=100, ignore_eos=True))
        await engine.reserve(busy)
        gate, stepping = threading.Event(), threading.Event()

        def hold_the_engine_thread(*_: object) -> None:
            stepping.set()
            gate.wait(10)

        engine.on_step = hold_the_engine_thread
        busy = engine.commit_and_stream("busy", FirstToken(7, True, 0))
        await anext(busy)  # committed: the engine thread now steps it
        assert await asyncio.to_thread(stepping.wait, 10)
        reserve = asyncio.ensure_future(engine.reserve(EngineRequest("left", PROMPT, GREEDY)))
        await asyncio.sleep(0)  # submitted, queued behind the held step
        reserve.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reserve
        engine.on_step = None
        gate.set()
        await busy.aclose()  # aborts "busy"
        await until_used(engine, 0)
        assert not await engine.abort("left")  # it ran, and was dropped at once
    finally:
        engine.stop()


async def test_a_dead_engine_thread_fails_every_waiting_caller_as_unavailable_and_says_so(mixed):
    """A step that raises ends the engine thread: the streams on it, a command queued behind that step and every
    later call fail with EngineDeadError (UNAVAILABLE at the gRPC edge) instead of waiting forever."""
    engine = mixed
    died: list[BaseException] = []
    engine.on_death = died.append
    long = SamplingParams(max_tokens=100, ignore_eos=True)
    holds = [(threading.Event(), threading.Event()) for _ in range(2)]  # (stepping, gate) for two steps in a row

    def hold_the_engine_thread(*_: object) -> None:
        stepping, gate = next((e for e in holds if not e[1].is_set()), holds[-1])
        stepping.set()
        gate.wait(10)

    engine.on_step = hold_the_engine_thread
    other = asyncio.ensure_future(tokens(engine.generate(EngineRequest("other", PROMPT, long))))
    assert await asyncio.to_thread(holds[0][0].wait, 10)  # held after other's first step: the add below runs next
    engine.faults.fail_when_stepped("doomed")
    doomed = asyncio.ensure_future(tokens(engine.generate(EngineRequest("doomed", PROMPT, long))))
    await asyncio.sleep(0.05)
    holds[0][1].set()
    assert await asyncio.to_thread(holds[1][0].wait, 10)  # held in the step that ran "doomed"
    queued = asyncio.ensure_future(engine.abort("nobody"))  # waits behind the step that will raise
    await asyncio.sleep(0.05)
    holds[1][1].set()
    for call in (doomed, other, queued):
        with pytest.raises(EngineDeadError) as err:
            await asyncio.wait_for(call, timeout=10)
        assert isinstance(err.value, UnavailableError)
    assert not engine.alive
    assert [type(e) for e in died] == [InjectedEngineFault]
    with pytest.raises(EngineDeadError):
        await engine.abort("later")


async def test_a_slowed_request_sleeps_each_step_it_runs_and_is_forgotten_when_done(mixed):
    """The slow-device fault: the steps that run the request each take the delay longer (a lower bound, so it
    holds on a loaded machine), its output is unchanged, and the engine forgets it once the stream ends."""
    plain = await tokens(mixed.generate(EngineRequest("plain", PROMPT, GREEDY)))
    mixed.faults.slow_when_stepped("slow", 0.05)
    start = asyncio.get_running_loop().time()
    slowed = await tokens(mixed.generate(EngineRequest("slow", PROMPT, GREEDY)))
    assert slowed == plain
    assert asyncio.get_running_loop().time() - start >= 0.05 * GREEDY.max_tokens
    assert mixed.faults._slowed == {}  # noqa: SLF001 (no public view of the fault's state)


async def test_the_fault_sees_each_step_that_runs_a_long_prompt_not_only_its_last_chunk():
    """A prompt of 4 chunks runs in 4 steps, and a slowed one is slowed in each (a test holds a prefill worker with
    it): the steps before its last have no output for it."""
    scheduler = SchedulerConfig(
        mode=EngineMode.PREFILL_ONLY, long_prefill_chunk=16, max_num_batched_tokens=16, max_prefills_per_step=1
    )
    config = EngineConfig(model="tiny-random", device="cpu", num_kv_blocks=16, num_threads=1, scheduler=scheduler)
    engine = AsyncEngine(LLMEngine(config))
    seen: list[list[str]] = []

    class Recorded(StepFaults):
        def stepped(self, request_ids: Iterable[str]) -> None:
            seen.append(list(request_ids))

    engine.faults = Recorded()
    try:
        await engine.prefill(EngineRequest("long", [3 + i % 200 for i in range(64)], SamplingParams(max_tokens=1)))
    finally:
        engine.stop()
    assert [ids.count("long") for ids in seen] == [1, 1, 1, 1]


async def test_a_prefill_names_exactly_the_blocks_it_holds_for_the_hand_off(prefill_only, mixed):
    held = await prefill_only.prefill(EngineRequest("held", PROMPT * 2, GREEDY))  # 40 tokens: three blocks of 16
    assert len(set(held.handoff_block_ids)) == len(held.handoff_block_ids) == 3
    await until_used(prefill_only, 3)
    done = await prefill_only.prefill(EngineRequest("one-token", PROMPT, SamplingParams(max_tokens=1)))
    assert done.finished and done.handoff_block_ids == ()  # nothing follows: its blocks are free already
    prefill_only.release("held")
    await until_used(prefill_only, 0)
    outputs = [out async for out in mixed.generate(EngineRequest("mixed", PROMPT, GREEDY))]
    assert sum(len(out.new_token_ids) for out in outputs) == 12
    assert {out.handoff_block_ids for out in outputs} == {()}


async def until_idle(engine: AsyncEngine) -> None:
    """Every request the engine holds has finished its last step."""
    for _ in range(500):
        if engine.stats["running"] == engine.stats["waiting"] == 0:
            # The last step's outputs were handed to this loop before the stats said so: let them arrive.
            await asyncio.sleep(0.01)
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine still busy: {engine.stats}")


async def test_a_caller_behind_the_engine_gets_the_steps_it_missed_as_one_output(mixed):
    """The engine steps on while its caller is busy; the caller's next read merges what queued meanwhile: the
    same tokens and text in order, the last step's finish, one message downstream instead of eleven."""
    plain = [out async for out in mixed.generate(EngineRequest("plain", PROMPT, GREEDY))]
    stream = mixed.generate(EngineRequest("behind", PROMPT, GREEDY))
    first = await anext(stream)
    await until_idle(mixed)
    rest = [out async for out in stream]
    # The first read may already merge a few steps (a loaded host runs the engine ahead of the caller's start).
    assert len(rest) == 1 and len(rest[0].new_token_ids) > 1
    assert first.new_token_ids + rest[0].new_token_ids == [t for out in plain for t in out.new_token_ids]
    assert first.new_text + rest[0].new_text == "".join(out.new_text for out in plain)
    assert rest[0].finish_reason == plain[-1].finish_reason
    assert rest[0].num_prompt_tokens == len(PROMPT)


async def test_a_caller_behind_a_dying_engine_gets_what_was_produced_then_the_failure(mixed):
    """Outputs queued before the engine thread died reach the caller, merged, before the EngineDeadError."""
    stream = mixed.generate(EngineRequest("behind", PROMPT, SamplingParams(max_tokens=100, ignore_eos=True)))
    await anext(stream)
    behind = mixed._streams.get("behind")  # noqa: SLF001 (what the caller has not read yet)
    assert behind is not None
    queue = behind.queue
    for _ in range(500):
        if queue.qsize() >= 3:
            break
        await asyncio.sleep(0.01)
    mixed.faults.fail_when_stepped("behind")
    for _ in range(500):
        if not mixed.alive:
            break
        await asyncio.sleep(0.01)
    caught_up = await anext(stream)
    assert len(caught_up.new_token_ids) >= 3 and not caught_up.finished
    with pytest.raises(EngineDeadError):
        await anext(stream)


async def test_work_waiting_for_held_blocks_sleeps_until_a_release_and_times_no_empty_steps(prefill_only):
    """A prompt that cannot get blocks while hand-offs hold them waits for the release: the engine thread
    neither spins (it would take the GIL from the threads sending those hand-offs) nor reports steps that ran
    nothing (they read as a worker four times faster than it is)."""
    engine = prefill_only
    held = await engine.prefill(EngineRequest("held", [3] * (12 * 16), GREEDY))  # 13 of the 16 blocks
    await until_used(engine, len(held.handoff_block_ids))
    steps: list[tuple[int, int, float]] = []
    engine.on_step = lambda *step: steps.append(step)
    waiting = asyncio.ensure_future(engine.prefill(EngineRequest("waiting", [4] * (5 * 16), GREEDY)))
    await asyncio.sleep(0.5)
    assert not waiting.done() and steps == []
    engine.release("held")
    assert (await asyncio.wait_for(waiting, timeout=10)).handoff_block_ids
    assert len(steps) == 1 and steps[0][0] == 5 * 16


async def test_a_streams_start_taken_mid_stream_is_not_marked_again_and_nothing_stays_after_it(mixed):
    """What a decode worker does: take a stream's start after its first tokens, stream on, end."""
    stream = mixed.generate(EngineRequest("taken", PROMPT, GREEDY))
    await anext(stream)
    await anext(stream)
    assert mixed.take_started("taken") is not None
    await tokens(stream)
    await tokens(mixed.generate(EngineRequest("never-taken", PROMPT, GREEDY)))
    assert mixed._started._marked == {}  # noqa: SLF001
    assert set(mixed._started._ns) == {"never-taken"}  # noqa: SLF001 (kept for a caller that takes it late)


@pytest.mark.parametrize("closing_cancelled", [False, True])
async def test_an_id_whose_caller_left_is_in_flight_until_its_abort_ran_and_never_gets_its_outputs(
    mixed, closing_cancelled: bool
):
    """A caller that leaves mid-step frees its id only once the engine thread applied its abort: the step in flight
    still delivers that request's output under the id. A new caller with the id meanwhile is refused; had it been
    let in, it was handed the old request's last token and finish, and its own request ran on for nobody. So too
    when the caller's closing is cancelled again while it awaits the abort (a drain, a stop)."""
    other = [9, 10, 11, 12] * 3
    expected = await tokens(mixed.generate(EngineRequest("alone", other, GREEDY)))
    gate, stepping = threading.Event(), threading.Event()
    steps = 0

    def hold_the_second_step(*_: object) -> None:
        nonlocal steps
        steps += 1
        if steps == 2:
            stepping.set()
            gate.wait(10)

    mixed.on_step = hold_the_second_step
    old = mixed.generate(EngineRequest("x", PROMPT, SamplingParams(max_tokens=2, ignore_eos=True)))
    await anext(old)
    assert await asyncio.to_thread(stepping.wait, 10)  # the step of its last token, not yet delivered
    closing = asyncio.ensure_future(old.aclose())  # its caller leaves: the abort waits for that step
    for _ in range(5):
        await asyncio.sleep(0)
    if closing_cancelled:
        closing.cancel()
        await asyncio.wait([closing])
    try:
        with pytest.raises(DuplicateRequestError):
            await anext(mixed.generate(EngineRequest("x", other, GREEDY)))
    finally:
        mixed.on_step = None
        gate.set()
        await asyncio.wait([closing], timeout=10)
    await until_used(mixed, 0)
    while "x" in mixed._streams:  # noqa: SLF001 (forgotten once the loop saw the abort done)
        await asyncio.sleep(0.01)
    assert await asyncio.wait_for(tokens(mixed.generate(EngineRequest("x", other, GREEDY))), timeout=20) == expected


async def test_each_step_reports_the_context_its_decoding_sequences_attend_over(mixed):
    """What the live speed correction prices a decode step by (a long-context batch is not a slow worker)."""
    steps: list[tuple[int, int, int]] = []
    mixed.on_step = lambda prefill, decode, seconds, prefill_squares, decode_context: steps.append(
        (prefill, decode, decode_context)
    )
    await tokens(mixed.generate(EngineRequest("ctx", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))))
    assert steps == [(20, 0, 0), (0, 1, 21), (0, 1, 22)]  # the prompt, then its decodes over 20 + 1, 20 + 2 tokens
