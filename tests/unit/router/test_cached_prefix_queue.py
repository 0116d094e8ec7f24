"""A prefill worker's queue as the router prices it, where a queued prompt follows a long cached prefix (a shared system
prompt, a conversation's next turn): its new tokens read the prefix, so it holds the worker as long as the router
prices that prompt itself, not as long as the same tokens alone. A worker's queue is a real scheduler's (block size
16, chunks of 512), reported as the engine reports it; the router's prompts come off it as the worker counted them."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from pdserve.config import RouterConfig, SchedulerConfig
from pdserve.engine.scheduler import Scheduler
from pdserve.protocol.perf_profile import PerfProfile, QueuedPrefill, attention_squares
from pdserve.registry.base import WorkerState
from services.router.load_tracker import LoadTracker
from services.router.predictor import Predictor
from tests.unit.engine.test_scheduler import Sim
from tests.unit.round_profile import PROFILE
from tests.unit.router.router_builder import Router, prompt, shed, worker

# smollm2-135m's prefill on 2 CPU cores (test_perf_profile), where 512 tokens after 3584 cached took 3.2 s: it prices
# them 2.75 s with their reads of the prefix, 0.92 s as 512 new tokens alone.
HOST = PerfProfile(0.02, 1.5e-3, 5e-7, 0.06, 4e-3)
CHUNK = 512
PREFILL = SchedulerConfig(
    max_num_batched_tokens=CHUNK, long_prefill_chunk=CHUNK, max_prefills_per_step=1, short_prompts_first=True
)
CACHED = 3584


def conversation(new_tokens: int, prefix_caching: bool = True) -> Sim:
    """A prefill worker that ran a 3584-token conversation (its cache holds it, if it caches prefixes), and its next
    turn of `new_tokens` queued."""
    sim = Sim(PREFILL, num_blocks=320, block_size=16, enable_prefix_caching=prefix_caching)
    first = sim.add("turn 1", prompt(CACHED), max_tokens=1)
    sim.run()
    sim.add("turn 2", first.prompt_token_ids + prompt(new_tokens, seed=1), max_tokens=1)
    return sim


def reported(sched: Scheduler, **fields: object) -> WorkerState:
    """The worker's registry entry of this queue, its fields as the engine's stats fill them."""
    queued = sched.queued_prefill()
    short, _ = sched.queued_ahead_of_short() or (queued, 0.0)
    return worker(
        "p0",
        profile=HOST,
        short_prompt_tokens=CHUNK,
        queued_prefill_prompts=queued.prompts,
        queued_prefill_tokens=queued.tokens,
        queued_prefill_token_squares=queued.token_squares,
        queued_short_prefill_prompts=short.prompts,
        queued_short_prefill_tokens=short.tokens,
        queued_short_prefill_token_squares=short.token_squares,
        **fields,
    )


def test_a_request_behind_a_turn_after_a_cached_conversation_waits_for_its_reads_of_it() -> None:
    """The next turn, 512 new tokens after 3584 cached: a short prompt and a long one behind it wait 2.75 s, as the
    router prices that turn's own prefill (3x the 0.92 s of its 512 tokens alone)."""
    pred = Predictor(RouterConfig(), LoadTracker())
    w = reported(conversation(512).sched)
    turn_s = HOST.prefill_s(512, CACHED)
    assert turn_s > 2.9 * HOST.prefill_s(512)
    assert pred.queue_s(w, 100) == pytest.approx(turn_s)  # it fits one step: the short part of the queue
    assert pred.queue_s(w, 2000) == pytest.approx(turn_s)  # the whole queue
    assert pred.ttft_s(w, 100, 0) == pytest.approx(pred.own_ttft_s(w, 100, 0) + turn_s)


def test_a_turn_part_way_through_its_chunks_waits_for_what_is_left_of_it_after_all_it_read() -> None:
    """1024 new tokens after 3584 cached, its first chunk done: the chunk left reads all 4096 before it."""
    sim = conversation(1024)
    sim.step()
    pred = Predictor(RouterConfig(), LoadTracker())
    w = reported(sim.sched)
    assert pred.queue_s(w, 100) == pytest.approx(HOST.prefill_s(512, CACHED + 512))  # the chunk in flight
    assert pred.queue_s(w, 2000) == pytest.approx(HOST.prefill_s(512, CACHED + 512))


def test_the_same_turn_with_nothing_cached_is_priced_as_before() -> None:
    """Its 512 tokens alone, where no conversation came before: 0.92 s, as the queue was priced before its reads
    counted; and a worker whose prefix cache is off computes all 4096 tokens of the turn."""
    pred = Predictor(RouterConfig(), LoadTracker())
    alone = Sim(PREFILL, num_blocks=320, block_size=16)
    alone.add("turn", prompt(512, seed=1), max_tokens=1)
    assert pred.queue_s(reported(alone.sched), 100) == pytest.approx(HOST.prefill_s(512))
    uncached = conversation(512, prefix_caching=False)
    assert pred.queue_s(reported(uncached.sched), 2000) == pytest.approx(HOST.prefill_s(CACHED + 512))


def test_admission_sheds_a_request_its_slo_would_miss_behind_a_turn_after_a_cached_conversation() -> None:
    """A 100-token prompt with a 2 s TTFT SLO: behind the turn's 2.75 s it would miss it, so it is shed with a retry
    hint; were the turn priced as 512 new tokens alone (0.92 s), it would be admitted, to miss it."""
    router = Router([reported(conversation(512).sched), worker("d0", "decode", profile=HOST)])
    shed(router, prompt(100, seed=2), "queue", slo_s=(2.0, 1.0))
    alone = Sim(PREFILL, num_blocks=320, block_size=16)
    alone.add("turn", prompt(512, seed=1), max_tokens=1)
    Router([reported(alone.sched), worker("d0", "decode", profile=HOST)]).admit(prompt(100, seed=2), slo_s=(2.0, 1.0))


def test_our_cached_prompt_prefilled_since_does_not_take_another_routers_prompts_squares():
    """Our 2048-token prompt, 1984 of it cached, was 64 new tokens on the worker, which counted their reads of the
    1984 in its squares: once it is prefilled, what is left of the report is the other router's four 1024-token
    prompts, priced as what they cost, not as if the 2048 tokens taken off had been one of them, nor with the reads
    of our prefix left in."""
    convex = replace(PROFILE, prefill_per_token2_s=5e-6)
    tracker = LoadTracker()
    pred = Predictor(RouterConfig(), tracker)
    ours = attention_squares(64, 1984)
    report = dict(queued_prefill_tokens=4 * 1024 + 64, queued_prefill_prompts=5)
    placed = tracker.start(
        "p0", "d0", new_tokens=64, seconds=convex.prefill_s(64, 1984), blocks=128, prompt_tokens=2048
    )
    time.sleep(0.01)  # the report sampled after our placement, before its prefill ended
    w = worker("p0", profile=convex, load_at=time.time(), queued_prefill_token_squares=4 * 1024**2 + ours, **report)
    tracker.prefilled(placed)
    assert tracker.prefilled_since("p0", w.load_sampled_at) == QueuedPrefill(1, 64, ours)
    assert pred.reported_queue(w) == QueuedPrefill(4, 4 * 1024, 4 * 1024**2)
    assert pred.queue_s(w) == pytest.approx(4 * convex.prefill_s(1024))


def test_our_cached_prompt_prefilled_since_leaves_a_shorter_rest_of_the_queue_in_place():
    """Another router's 300-token prompt queued behind our chat turn (64 new tokens after 1984 cached): once ours is
    prefilled, theirs is still queued. Taking our whole prompt's 2048 tokens off emptied the report (300 + 64 - 2048
    < 0), and the worker was priced idle behind a prompt it had yet to run."""
    tracker = LoadTracker()
    pred = Predictor(RouterConfig(), tracker)
    ours = attention_squares(64, 1984)
    placed = tracker.start("p0", "d0", new_tokens=64, seconds=HOST.prefill_s(64, 1984), blocks=128, prompt_tokens=2048)
    time.sleep(0.01)
    report = dict(queued_prefill_tokens=300 + 64, queued_prefill_prompts=2, queued_prefill_token_squares=300**2 + ours)
    w = worker("p0", profile=HOST, load_at=time.time(), **report)
    tracker.prefilled(placed)
    assert pred.reported_queue(w) == QueuedPrefill(1, 300, 300**2)
    assert pred.queue_s(w) == pytest.approx(HOST.prefill_s(300))


def test_a_prompt_placed_after_the_report_was_sampled_takes_nothing_off_it():
    """Our short prompt placed and prefilled between two heartbeats was never in the report sampled before it:
    taking it off took another router's queued prompt with it."""
    tracker = LoadTracker()
    pred = Predictor(RouterConfig(), tracker)
    w = worker("p0", profile=HOST, load_at=time.time(), queued_prefill_tokens=200, queued_prefill_prompts=1)
    time.sleep(0.01)
    tracker.prefilled(
        tracker.start("p0", "d0", new_tokens=200, seconds=HOST.prefill_s(200), blocks=13, prompt_tokens=200)
    )
    assert pred.reported_queue(w) == QueuedPrefill(1, 200, 200**2)
