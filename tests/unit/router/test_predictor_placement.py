"""The predictor's TTFT/TPOT and placement's choices, on an in-process registry."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import replace

import pytest

from pdserve.config import RouterConfig
from pdserve.errors import UnavailableError
from pdserve.protocol import prefix_hash
from pdserve.protocol.prefix_hash import INLINE_HASH_TOKENS, prefix_hashes
from services.router.load_tracker import LoadTracker
from services.router.predictor import Predictor
from tests.unit.round_profile import PROFILE
from tests.unit.router.router_builder import BS, Router, prompt, replace_free, worker


def test_ttft_grows_with_the_reported_queue():
    pred = Predictor(RouterConfig(), LoadTracker())
    idle, busy = worker("p0"), worker("p1", queued_prefill_tokens=5000)
    assert pred.ttft_s(busy, 100, 0) == pytest.approx(pred.ttft_s(idle, 100, 0) + 5.0)
    slow = worker("p2", queued_prefill_tokens=5000, speed_factor=2.0)
    assert pred.ttft_s(slow, 100, 0) > pred.ttft_s(busy, 100, 0)


def test_another_routers_queued_prompts_are_priced_as_this_router_prices_its_own():
    """Two routers place on one prefill worker; each sees the other's prompts only in the worker's report. With a
    convex profile (attention's quadratic term) the report is priced per prompt, as each router prices its own
    placements, not per token: four 1024-token prompts wait as long whichever router placed them."""
    convex = replace(PROFILE, prefill_per_token2_s=5e-6)
    mine, theirs = LoadTracker(), LoadTracker()
    own, other = Predictor(RouterConfig(), mine), Predictor(RouterConfig(), theirs)
    sampled = time.time() - 1.0
    for _ in range(4):
        mine.start("p0", "d0", new_tokens=1024, seconds=convex.prefill_s(1024), blocks=64, prompt_tokens=1024)
    # The worker's heartbeat shows the four prompts queued; what it reports of them is what the other router sees.
    report = dict(queued_prefill_tokens=4 * 1024, queued_prefill_prompts=4, queued_prefill_token_squares=4 * 1024**2)
    w = worker("p0", profile=convex, load_at=sampled, **report)
    assert own.queue_s(w) == pytest.approx(4 * convex.prefill_s(1024))  # its own placements
    assert other.queue_s(w) == pytest.approx(own.queue_s(w))  # the report alone, priced the same
    linear = 4 * 1024 * convex.prefill_per_token_s
    assert other.queue_s(w) > 2 * linear  # per token, the quadratic term would be lost (here 25.1 s against 4.1 s)
    # A worker too old to count its prompts: its tokens priced per token, as before.
    old = worker("p0", profile=convex, load_at=sampled, queued_prefill_tokens=4 * 1024)
    assert other.queue_s(old) == pytest.approx(linear)


def test_a_reported_queue_loses_the_prompts_this_router_saw_prefilled_since_it_was_sampled():
    convex = replace(PROFILE, prefill_per_token2_s=5e-6)
    tracker = LoadTracker()
    pred = Predictor(RouterConfig(), tracker)
    report = dict(
        queued_prefill_tokens=1024 + 256, queued_prefill_prompts=2, queued_prefill_token_squares=1024**2 + 256**2
    )
    placed = tracker.start("p0", "d0", new_tokens=1024, seconds=convex.prefill_s(1024), blocks=64, prompt_tokens=1024)
    time.sleep(0.01)
    sampled = time.time()
    tracker.prefilled(placed)  # ours, the 1024-token one, prefilled after the report was sampled
    w = worker("p0", profile=convex, load_at=sampled, **report)
    assert pred.queue_s(w) == pytest.approx(convex.prefill_s(256))  # the other router's 256-token prompt is left
    assert pred.queued_tokens(w) == 256


def test_a_report_sampled_while_our_stream_held_its_blocks_gets_them_back_once_it_ended():
    """Our request's first token came back (its prompt's 4 blocks reserved, and the one its worker keeps free for its
    next), then the worker sampled 10 free, then the request ended: it has 15 free, where the report alone would shed
    the next 12-block request until the next heartbeat. One that ended before its first token came back reserved
    nothing the report could show."""
    tracker = LoadTracker()
    pred = Predictor(RouterConfig(), tracker)
    held = tracker.start("p0", "d0", new_tokens=64, seconds=0.01, blocks=8, prompt_tokens=64, prompt_blocks=4)
    tracker.prefilled(held)
    never = tracker.start("p0", "d0", new_tokens=64, seconds=0.01, blocks=8, prompt_tokens=64, prompt_blocks=4)
    time.sleep(0.01)
    w = worker("d0", "decode", kv_blocks_total=32, kv_blocks_free=10, load_at=time.time())
    time.sleep(0.01)
    assert pred.free_blocks(w) == 10 - 8  # the other, placed before the report, is still pending
    tracker.finished(held)
    tracker.prefilled(never)
    tracker.finished(never)
    assert pred.free_blocks(w) == 10 + 4 + 1


def test_ttft_grows_with_work_this_router_sent_but_the_heartbeat_does_not_show_yet():
    tracker = LoadTracker()
    pred = Predictor(RouterConfig(), tracker)
    w = worker("p0")
    before = pred.ttft_s(w, 100, 0)
    placement = tracker.start("p0", "d0", new_tokens=3000, seconds=3.0, blocks=200, prompt_tokens=3000)
    assert pred.ttft_s(w, 100, 0) == pytest.approx(before + 3.0)
    assert pred.queued_tokens(w) == 3000
    assert pred.ttft_s(worker("p1"), 100, 0) == pytest.approx(before)  # only the worker it went to
    tracker.prefilled(placement)
    assert pred.ttft_s(w, 100, 0) == pytest.approx(before)
    assert pred.queued_tokens(w) == 0


def test_ttft_shrinks_with_a_prefix_hit():
    pred = Predictor(RouterConfig(), LoadTracker())
    w = worker("p0")
    cold, warm, full = pred.ttft_s(w, 1024, 0), pred.ttft_s(w, 1024, 512), pred.ttft_s(w, 1024, 1024)
    assert cold - warm == pytest.approx(0.512)
    assert 0 < full < warm < cold  # a full hit still computes one token


def test_ttft_includes_kv_transfer_when_disaggregated_and_not_when_colocated():
    pred = Predictor(RouterConfig(transfer_gbps=1.0), LoadTracker())
    heavy = 1_000_000  # bytes of KV per prompt token: 1000 tokens take 1 s at 1 GB/s
    plain = pred.ttft_s(worker("p0", kv_bytes_per_token=0), 1000, 0)
    assert pred.transfer_s(worker("p0", kv_bytes_per_token=heavy), 1000) == pytest.approx(1.0)
    assert pred.ttft_s(worker("p0", kv_bytes_per_token=heavy), 1000, 0) == pytest.approx(plain + 1.0)
    colocated = worker("c0", role="colocated", kv_bytes_per_token=heavy)
    assert pred.transfer_s(colocated, 1000) == 0.0
    assert pred.ttft_s(colocated, 1000, 0) == pytest.approx(plain)
    faster = Predictor(RouterConfig(transfer_gbps=10.0), LoadTracker())
    assert faster.transfer_s(worker("p0", kv_bytes_per_token=heavy), 1000) == pytest.approx(0.1)


def test_tpot_grows_with_the_running_batch_reported_or_sent():
    tracker = LoadTracker()
    pred = Predictor(RouterConfig(), tracker)
    assert pred.tpot_s(worker("d0", "decode")) == pytest.approx(PROFILE.decode_step_s(1))
    assert pred.tpot_s(worker("d0", "decode", running=30)) == pytest.approx(PROFILE.decode_step_s(31))
    placements = [tracker.start("p0", "d1", new_tokens=10, seconds=0.01, blocks=1, prompt_tokens=10) for _ in range(10)]
    assert pred.tpot_s(worker("d1", "decode")) == pytest.approx(PROFILE.decode_step_s(11))
    tracker.prefilled(placements[0])
    tracker.finished(placements[0])
    assert pred.tpot_s(worker("d1", "decode")) == pytest.approx(PROFILE.decode_step_s(10))


def test_a_busy_decode_worker_adds_a_step_to_the_predicted_first_token_and_an_idle_one_nothing():
    """Its engine takes the hand-off's commands only between steps: the wait is load, so it is queueing."""
    idle = Router([worker("p0"), worker("d0", "decode")]).place(prompt(100), 16, 1.0)
    busy = Router([worker("p0"), worker("d0", "decode", running=30)]).place(prompt(100), 16, 1.0)
    assert busy.own_ttft_s == idle.own_ttft_s
    assert busy.queue_s - idle.queue_s == pytest.approx(PROFILE.decode_step_s(30))
    r = Router([worker("p0"), worker("d0", "decode")])
    r.tracker.start("p0", "d0", new_tokens=10, seconds=0.01, blocks=1, prompt_tokens=10)  # ours, not reported yet
    assert r.predictor.decode_wait_s(worker("d0", "decode")) == pytest.approx(PROFILE.decode_step_s(1))


def test_free_blocks_subtract_blocks_about_to_be_reserved():
    tracker = LoadTracker()
    pred = Predictor(RouterConfig(), tracker)
    placement = tracker.start("p0", "d0", new_tokens=100, seconds=0.1, blocks=90, prompt_tokens=100)
    assert pred.free_blocks(worker("d0", "decode", kv_blocks_free=100)) == 10
    tracker.prefilled(placement)
    assert pred.free_blocks(worker("d0", "decode", kv_blocks_free=100)) == 100


# --- Placement -----------------------------------------------------------------------------------------------


def test_slo_placement_picks_the_prefill_worker_with_the_lowest_predicted_ttft():
    r = Router(
        [
            worker("p0", queued_prefill_tokens=4000),
            worker("p1", queued_prefill_tokens=1000),
            worker("p2", queued_prefill_tokens=50),
            worker("p3", queued_prefill_tokens=0, speed_factor=3.0),  # idle but slow: 3 * 0.11 s
            worker("d0", "decode"),
        ]
    )
    placed = r.place(prompt(100), 16, 1.0)
    assert placed.prefill is not None and placed.prefill.worker_id == "p2"
    assert placed.predicted_ttft_s == pytest.approx(r.predictor.ttft_s(placed.prefill, 100, 0))
    assert placed.cached_tokens == 0
    r.tracker.start("p2", "d0", new_tokens=2000, seconds=2.0, blocks=10, prompt_tokens=2000)  # our own sends count too
    assert r.place(prompt(100), 16, 1.0).prefill.worker_id == "p3"


def test_slo_placement_prefers_the_prefill_worker_holding_the_prompts_prefix():
    r = Router([worker("p0"), worker("p1", queued_prefill_tokens=200), worker("d0", "decode")])
    tokens = prompt(1024)
    first = r.place(tokens, 16, 1.0)
    assert first.prefill.worker_id == "p0"  # less loaded, nobody has the prefix
    assert len(first.block_hashes) == 1024 // BS  # every full block: what the worker keys
    r.index.record(worker("p1").cache_key, first.block_hashes)  # what the router does after placing on p1
    second = r.place(tokens, 16, 1.0)
    assert second.prefill.worker_id == "p1"
    assert second.cached_tokens == (1024 - 1) // BS * BS  # a hit stops short of the last token, computed anew
    assert second.predicted_ttft_s < first.predicted_ttft_s
    # A different prompt shares no leading block: back to the idle worker.
    assert r.place(prompt(1024, seed=1), 16, 1.0).prefill.worker_id == "p0"


def test_a_worker_restarted_under_its_id_holds_none_of_its_predecessors_prefixes():
    """A drain's restart (or a crash's replacement) keeps the worker's id; its new process has an empty cache."""
    r = Router([worker("p0", pid=100), worker("p1", queued_prefill_tokens=200, pid=200), worker("d0", "decode")])
    tokens = prompt(1024)
    r.index.record(worker("p1", pid=200).cache_key, prefix_hashes(tokens[:-1], BS))
    assert r.place(tokens, 16, 1.0).prefill.worker_id == "p1"
    r.registry.publish(worker("p1", queued_prefill_tokens=200, pid=201))  # the same address, a new process
    placed = r.place(tokens, 16, 1.0)
    assert placed.prefill.worker_id == "p0" and placed.cached_tokens == 0
    # A container restarted in place: the same address and pid, a new instance id.
    r.index.record(worker("p1", pid=201, instance="a").cache_key, prefix_hashes(tokens[:-1], BS))
    r.registry.publish(worker("p1", queued_prefill_tokens=200, pid=201, instance="a"))
    assert r.place(tokens, 16, 1.0).prefill.worker_id == "p1"
    r.registry.publish(worker("p1", queued_prefill_tokens=200, pid=201, instance="b"))
    assert r.place(tokens, 16, 1.0).prefill.worker_id == "p0"


def test_slo_placement_ignores_a_prefix_hit_that_does_not_start_at_block_0():
    r = Router([worker("p0"), worker("p1", queued_prefill_tokens=200), worker("d0", "decode")])
    tokens = prompt(1024)
    hashes = prefix_hashes(tokens[:-1], BS)
    r.index.record(worker("p1").cache_key, hashes[1:])
    placed = r.place(tokens, 16, 1.0)
    assert placed.prefill.worker_id == "p0" and placed.cached_tokens == 0


def test_slo_placement_picks_a_decode_worker_with_room_within_tpot_preferring_the_most_free_blocks():
    r = Router(
        [
            worker("p0"),
            worker("d0", "decode", kv_blocks_free=5),  # no room for 100 + 16 tokens (8 blocks)
            worker("d1", "decode", kv_blocks_free=500),
            worker("d2", "decode", kv_blocks_free=800, running=4),
            worker("d3", "decode", kv_blocks_free=4000, running=100),  # roomiest but too slow
        ]
    )
    placed = r.place(prompt(100), 16, tpot_slo_s=0.1)
    assert placed.blocks_needed == math.ceil((100 + 16) / BS)
    assert placed.decode.worker_id == "d2"
    assert placed.predicted_tpot_s == pytest.approx(PROFILE.decode_step_s(5))
    r.tracker.start(
        "p0", "d2", new_tokens=100, seconds=0.1, blocks=750, prompt_tokens=100
    )  # d2's room is promised away
    assert r.place(prompt(100), 16, tpot_slo_s=0.1).decode.worker_id == "d1"


def test_slo_placement_skips_a_decode_worker_whose_batch_is_full_reported_or_by_our_own_sends():
    """A decode worker holds at most max_num_seqs sequences (it refuses the hand-off past it): those it reported
    (decoding, preempted, KV arriving), plus ours placed after it sampled them, or all of ours, the more."""
    full = worker("d0", "decode", kv_blocks_free=4000, sequences=4, max_num_seqs=4, load_at=time.time() - 1)
    r = Router([worker("p0"), full, worker("d1", "decode", kv_blocks_free=500, max_num_seqs=4)])
    assert r.place(prompt(100), 16, tpot_slo_s=1.0).decode.worker_id == "d1"
    r = Router([worker("p0"), replace(full, sequences=2), worker("d1", "decode", kv_blocks_free=500)])
    assert r.place(prompt(100), 16, tpot_slo_s=1.0).decode.worker_id == "d0"  # the most free blocks
    for _ in range(2):  # placed after the report: it cannot show them
        r.tracker.start("p0", "d0", new_tokens=100, seconds=0.1, blocks=8, prompt_tokens=100)
    assert r.place(prompt(100), 16, tpot_slo_s=1.0).decode.worker_id == "d1"
    r = Router([worker("p0"), replace(full, sequences=0, load_at=time.time() + 1), worker("d1", "decode")])
    for _ in range(4):  # all ours, before a report that shows none of them yet (it sampled before they arrived)
        r.tracker.start("p0", "d0", new_tokens=100, seconds=0.1, blocks=8, prompt_tokens=100)
    assert r.place(prompt(100), 16, tpot_slo_s=1.0).decode.worker_id == "d1"
    older = worker("d2", "decode", running=3, waiting=1, max_num_seqs=4)  # a build that does not report `sequences`
    assert not r.predictor.has_batch_room(older)
    colocated = worker("c0", "colocated", sequences=4, max_num_seqs=4)  # queues its prompts past the cap instead
    assert r.predictor.has_batch_room(colocated)


def test_a_report_sampled_before_our_streams_ended_does_not_hold_their_places_against_new_ones():
    """The report counted two of ours (placed before it sampled) that have ended since: with a cap of 2 the
    batch has room for two more, placed after it, though that report is still the latest."""
    r = Router([worker("p0")])
    ended = [r.tracker.start("p0", "d0", new_tokens=4, seconds=0.01, blocks=1, prompt_tokens=4) for _ in range(2)]
    report = worker("d0", "decode", sequences=2, max_num_seqs=2, load_at=time.time())
    time.sleep(0.001)  # they end after it sampled them
    for placement in ended:
        r.tracker.prefilled(placement)
        r.tracker.finished(placement)
    assert r.predictor.has_batch_room(report)
    r.tracker.start("p0", "d0", new_tokens=4, seconds=0.01, blocks=1, prompt_tokens=4)
    assert r.predictor.has_batch_room(report)
    r.tracker.start("p0", "d0", new_tokens=4, seconds=0.01, blocks=1, prompt_tokens=4)
    assert not r.predictor.has_batch_room(report)


def test_slo_placement_falls_back_to_the_fastest_roomy_decode_worker_when_none_meets_tpot():
    decodes = [
        worker("d0", "decode", kv_blocks_free=900, running=50),
        worker("d1", "decode", kv_blocks_free=100, running=20),
        worker("d2", "decode", kv_blocks_free=2, running=1),  # fastest, but no room
    ]
    r = Router([worker("p0"), *decodes])
    placed = r.place(prompt(100), 16, tpot_slo_s=0.01)
    assert placed.decode.worker_id == "d1"
    assert placed.predicted_tpot_s > 0.01
    # With no room anywhere, the fastest of all.
    r2 = Router([worker("p0"), *(replace_free(w, 1) for w in decodes)])
    assert r2.place(prompt(100), 16, tpot_slo_s=0.01).decode.worker_id == "d2"


def test_colocated_placement_uses_one_worker_for_both_phases_without_transfer():
    r = Router(
        [
            worker("c0", "colocated", queued_prefill_tokens=3000, kv_bytes_per_token=10**6),
            worker("c1", "colocated", kv_bytes_per_token=10**6),
            worker("p9"),  # a stray prefill worker: colocated mode ignores it
        ]
    )
    placed = r.place(prompt(500), 16, 1.0)
    assert placed.prefill is None
    assert placed.decode.worker_id == "c1" and placed.prefill_worker.worker_id == "c1"
    assert placed.predicted_ttft_s == pytest.approx(PROFILE.prefill_s(500))


def test_colocated_placement_takes_the_fastest_worker_that_can_also_decode_the_request():
    """A colocated worker runs the decode too: the one with the lowest TTFT but too few free blocks, or a TPOT
    past the SLO, is passed over for one that can (an idle cluster then serves the request instead of shedding
    it for good, the same worker winning every retry)."""
    small = Router([worker("c-0", "colocated", kv_blocks_free=50), worker("c-1", "colocated")])  # equal TTFTs
    assert small.admit(prompt(2000), slo_s=(5.0, 0.5), explicit=False).decode.worker_id == "c-1"
    fast_prefill = replace(PROFILE, prefill_per_token_s=PROFILE.prefill_per_token_s / 2)
    fast_decode = replace(PROFILE, decode_fixed_s=PROFILE.decode_fixed_s / 3)
    r = Router([worker("a", "colocated", profile=fast_prefill), worker("b", "colocated", profile=fast_decode)])
    assert r.place(prompt(500), 16, 1.0).decode.worker_id == "a"  # both decode within a loose TPOT: TTFT decides
    tight = r.admit(prompt(500), slo_s=(5.0, fast_decode.decode_step_s(1) * 1.05))
    assert tight.decode.worker_id == "b" and tight.prefill is None


def test_placement_without_workers_of_both_roles_is_unavailable():
    with pytest.raises(UnavailableError):
        Router([worker("p0")]).place(prompt(10), 4, 1.0)
    with pytest.raises(UnavailableError):
        Router([worker("d0", "decode")]).place(prompt(10), 4, 1.0)


def test_round_robin_cycles_each_role_blind_to_load():
    r = Router(
        [
            worker("p1"),
            worker("p0", queued_prefill_tokens=10**6),
            worker("p2"),
            worker("d1", "decode"),
            worker("d0", "decode", running=500),
        ],
        policy="round-robin",
    )
    chosen = [r.place(prompt(50), 4, 1.0) for _ in range(6)]
    assert [p.prefill.worker_id for p in chosen] == ["p0", "p1", "p2", "p0", "p1", "p2"]
    assert [p.decode.worker_id for p in chosen] == ["d0", "d1", "d0", "d1", "d0", "d1"]


# --- Admission -----------------------------------------------------------------------------------------------


def test_free_blocks_keep_out_what_was_placed_after_the_report_sampled_them_first_token_back_or_not():
    """Between a request's first token and the decode worker's next report, the report shows its blocks free
    and nothing is pending any more: counting them free would admit what the decode worker then sheds."""
    tracker = LoadTracker()
    pred = Predictor(RouterConfig(), tracker)
    sampled = time.time() - 0.2
    placement = tracker.start("p0", "d0", new_tokens=100, seconds=0.1, blocks=90, prompt_tokens=100)
    tracker.prefilled(placement)
    assert pred.free_blocks(worker("d0", "decode", kv_blocks_free=100, load_at=sampled)) == 10
    assert pred.free_blocks(worker("d0", "decode", kv_blocks_free=10)) == 10  # a report after it: counted once


def test_a_finished_request_holds_no_blocks_even_on_a_worker_that_reported_before_it():
    """An idle decode worker samples no new load: a request placed after its last sample that has ended since
    (served, or failed before it reserved anything) must not keep its blocks off the worker's free count."""
    tracker = LoadTracker()
    pred = Predictor(RouterConfig(), tracker)
    sampled = time.time() - 0.2
    placement = tracker.start("p0", "d0", new_tokens=100, seconds=0.1, blocks=90, prompt_tokens=100)
    tracker.prefilled(placement)
    tracker.finished(placement)
    assert pred.free_blocks(worker("d0", "decode", kv_blocks_free=100, load_at=sampled)) == 100


def test_a_long_prompts_block_hashes_are_computed_off_the_event_loop(monkeypatch):
    """Every other stream's tokens wait while the loop hashes: a 128k-token prompt took ~11 ms there."""
    threads: list[bool] = []

    def recording(*args):  # type: ignore[no-untyped-def]
        threads.append(threading.current_thread() is threading.main_thread())
        return prefix_hashes(*args)

    monkeypatch.setattr(prefix_hash, "prefix_hashes", recording)
    r = Router([worker("p0"), worker("d0", "decode")])
    short, long = r.place(prompt(100), 16, 1.0), r.place(prompt(INLINE_HASH_TOKENS + 1), 16, 1.0)
    assert threads == [True, False]  # the loop runs on the main thread here
    assert long.block_hashes == prefix_hashes(prompt(INLINE_HASH_TOKENS + 1), BS)
    assert len(short.block_hashes) == 100 // BS
