"""Each request's queue time (arrival to the step that first ran it) and prefill time (that step to its first
token), as the engine reports them for pdserve_request_queue_time_seconds and pdserve_request_prefill_time_seconds:
once a request, however many chunks or recomputes it took."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import pytest

from pdserve.config import EngineConfig, SchedulerConfig
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.engine import LLMEngine
from pdserve.protocol.engine_request import EngineRequest
from pdserve.protocol.roles import EngineMode
from pdserve.protocol.sampling import SamplingParams
from tests.unit.engine.engine_harness import GREEDY, make_engine, prompts, record_schedules

pytestmark = pytest.mark.timeout(120)


@dataclass
class Timed:
    """What a run to the end reported: every queue and prefill time, and when (this test's clock) each step
    began and ended and each request finished."""

    queue_s: list[float] = field(default_factory=list)
    prefill_s: list[float] = field(default_factory=list)
    requeue_s: list[float] = field(default_factory=list)
    steps: list[tuple[float, float]] = field(default_factory=list)
    finished_at: dict[str, float] = field(default_factory=dict)


def run_timed(engine: LLMEngine, max_steps: int = 2000) -> Timed:
    timed = Timed()
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return timed
        began = time.monotonic()
        outputs = engine.step()
        ended = time.monotonic()
        timed.steps.append((began, ended))
        timed.queue_s += engine.last_step_queue_s
        timed.prefill_s += engine.last_step_prefill_s
        timed.requeue_s += engine.last_step_requeue_s
        timed.finished_at |= {out.request_id: ended for out in outputs if out.finished}
    raise AssertionError(f"engine still busy after {max_steps} steps")


def test_a_request_behind_a_full_batch_queues_for_the_first_ones_whole_run() -> None:
    """One place in the batch: the second request waits until the first is done; the first waits for nothing."""
    engine = make_engine(max_num_seqs=1)
    first, second = prompts(2, seed=1)
    engine.add_request(EngineRequest("first", first, SamplingParams(max_tokens=120, ignore_eos=True)))
    engine.add_request(EngineRequest("second", second, GREEDY))
    started = time.monotonic()
    timed = run_timed(engine)
    first_ran = timed.finished_at["first"] - started
    assert len(timed.queue_s) == 2 and len(timed.prefill_s) == 2  # once each, not once a step
    first_queue, second_queue = timed.queue_s  # in the order steps first ran them
    assert first_queue < first_ran / 20
    assert second_queue >= first_ran
    assert all(0 < s < first_ran for s in timed.prefill_s)


def test_a_chunked_prompt_is_one_prefill_from_its_first_chunk_to_its_first_token(monkeypatch) -> None:
    engine = make_engine(long_prefill_chunk=16, max_num_batched_tokens=16)
    plans = record_schedules(engine, monkeypatch)
    [prompt] = prompts(1, lo=100, hi=100)
    engine.add_request(EngineRequest("long", prompt, SamplingParams(max_tokens=3, ignore_eos=True)))
    timed = run_timed(engine)
    chunk_steps = [i for i, plan in enumerate(plans) if plan.num_tokens > 1]
    assert chunk_steps == list(range(7))  # 100 tokens in chunks of 16
    assert len(timed.queue_s) == 1 and len(timed.prefill_s) == 1
    # From inside its first chunk's step to inside its last's: every chunk step between them is in it.
    between = sum(end - begin for begin, end in timed.steps[1:6])
    assert between <= timed.prefill_s[0] <= timed.steps[6][1] - timed.steps[0][0]


def test_a_preempted_and_recomputed_request_is_timed_by_its_first_scheduling_only() -> None:
    """A pool too small for two outputs: one is preempted and recomputed, its recompute no second queue or
    prefill (vLLM counts the first scheduling)."""
    config = EngineConfig(model="tiny-random", dtype="float32", device="cpu", block_size=4, num_kv_blocks=16)
    engine = LLMEngine(config)
    sampling = SamplingParams(max_tokens=40, ignore_eos=True)
    for name, first in (("a", 5), ("b", 100)):
        engine.add_request(EngineRequest(name, list(range(first, first + 10)), sampling))
    timed = run_timed(engine)
    assert engine.scheduler.num_preemptions >= 1
    assert len(timed.queue_s) == 2 and len(timed.prefill_s) == 2


def test_each_preemption_is_timed_from_its_step_to_the_step_that_runs_the_sequence_again(monkeypatch) -> None:
    """pdserve_preemption_wait_seconds: the time a preempted sequence lost waiting to be recomputed, once a
    preemption, which its request's queue time (its first wait) leaves out."""
    config = EngineConfig(model="tiny-random", dtype="float32", device="cpu", block_size=4, num_kv_blocks=16)
    engine = LLMEngine(config)
    plans = record_schedules(engine, monkeypatch)
    sampling = SamplingParams(max_tokens=40, ignore_eos=True)
    for name, first in (("a", 5), ("b", 100)):
        engine.add_request(EngineRequest(name, list(range(first, first + 10)), sampling))
    timed = run_timed(engine)
    waits: list[tuple[int, int]] = []  # (the step that preempted it, the step that ran it again), in that order
    since: dict[str, int] = {}
    for step, plan in enumerate(plans):
        waits += [(since.pop(c.seq_id), step) for c in plan.chunks if c.seq_id in since]
        since |= dict.fromkeys(plan.preempted, step)
    assert len(waits) == engine.scheduler.num_preemptions >= 1 and not since
    assert len(timed.requeue_s) == len(waits) and len(timed.queue_s) == 2
    for wait, (preempted, ran) in zip(timed.requeue_s, waits, strict=True):
        (began, ended), (ran_began, ran_ended) = timed.steps[preempted], timed.steps[ran]
        assert ran_began - ended <= wait <= ran_ended - began


def test_a_request_dropped_before_any_step_ran_it_has_no_queue_time() -> None:
    engine = make_engine(max_num_seqs=1)
    first, second = prompts(2, seed=2)
    engine.add_request(EngineRequest("runs", first, GREEDY))
    engine.add_request(EngineRequest("dropped", second, GREEDY))
    engine.step()
    assert len(engine.last_step_queue_s) == len(engine.last_step_prefill_s) == 1  # "runs"
    assert engine.abort("dropped")
    timed = run_timed(engine)
    assert timed.queue_s == timed.prefill_s == []


def test_a_decode_worker_queues_from_its_commit_not_while_the_kv_arrives() -> None:
    """The KV's transfer is timed by pdserve_kv_transfer_seconds: a decode worker's queue is its committed
    sequence's wait for a step. Its prompt was prefilled elsewhere: no prefill time here."""
    scheduler = SchedulerConfig(mode=EngineMode.DECODE_ONLY)
    engine = LLMEngine(EngineConfig(model="tiny-random", dtype="float32", device="cpu", scheduler=scheduler))
    engine.reserve(EngineRequest("handed-off", list(range(1, 21)), SamplingParams(max_tokens=4, ignore_eos=True)))
    reserved = time.monotonic()
    time.sleep(0.3)  # its KV in transfer
    engine.commit("handed-off", 1)
    in_transfer = time.monotonic() - reserved
    timed = run_timed(engine)
    assert len(timed.queue_s) == 1 and timed.queue_s[0] < in_transfer  # no 0.1 s guess at a loaded host's step
    assert timed.prefill_s == []


async def test_the_async_engine_hands_each_steps_times_to_its_hook_on_the_engine_thread() -> None:
    config = EngineConfig(model="tiny-random", device="cpu", num_kv_blocks=16, num_threads=1)
    engine = AsyncEngine(LLMEngine(config))
    reported: list[tuple[list[float], list[float], list[float], str]] = []
    engine.on_request_times = lambda queue_s, prefill_s, requeue_s: reported.append(
        (queue_s, prefill_s, requeue_s, threading.current_thread().name)
    )
    try:
        request = EngineRequest("timed", [5, 6, 7, 8] * 5, SamplingParams(max_tokens=6, ignore_eos=True))
        outputs = [out async for out in engine.generate(request)]
        await asyncio.sleep(0)
    finally:
        engine.stop()
    assert outputs[-1].finished
    assert [(len(q), len(p), len(r), thread) for q, p, r, thread in reported] == [(1, 1, 0, "engine-loop")]
