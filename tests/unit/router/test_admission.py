"""Admission's answers: admitted, RESOURCE_EXHAUSTED with a retry hint, or INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from pdserve.config import RouterConfig
from pdserve.errors import InvalidRequestError, OverloadedError
from pdserve.protocol.prefix_hash import prefix_hashes
from pdserve.protocol.roles import Role
from pdserve.security.quotas import Choices
from services.router.admission import MAX_RETRY_MS, MIN_RETRY_MS, SLOTarget
from services.router.load_tracker import LoadTracker
from services.router.predictor import Predictor
from tests.unit.round_profile import PROFILE
from tests.unit.router.router_builder import BS, Router, prompt, shed, worker


def test_admission_admits_when_every_prediction_fits():
    r = Router([worker("p0"), worker("d0", "decode")])
    placed = r.admit(prompt(100), slo_s=(1.0, 0.1))
    assert placed.prefill.worker_id == "p0" and placed.decode.worker_id == "d0"


def test_admission_sheds_when_predicted_ttft_exceeds_the_slo():
    r = Router([worker("p0", queued_prefill_tokens=8000), worker("d0", "decode")], max_queued_prefill_tokens=10**6)
    err = shed(r, prompt(100), "TTFT", slo_s=(1.0, 1.0))
    assert err.retry_after_ms >= 5000  # about how late it would be: 8.1 s predicted vs 1 s
    r.admit(prompt(100), slo_s=(12.0, 1.0))  # the same load meets a looser SLO (8 s queue <= 0.8 * 11.89 s)


def test_a_loose_slo_is_still_held_to_the_first_token_bound_and_an_idle_cost_past_it_is_invalid():
    """The router cancels a request with no first token past its bound (and blames the prefill worker): one
    predicted to wait longer is shed instead, whatever the SLO it asked for."""
    r = Router([worker("p0", queued_prefill_tokens=8000), worker("d0", "decode")], max_queued_prefill_tokens=10**6)
    r.admit(prompt(100), slo_s=(120.0, 1.0))  # 8.1 s predicted, within the default 60 s bound
    bounded = Router(
        [worker("p0", queued_prefill_tokens=8000), worker("d0", "decode")],
        max_queued_prefill_tokens=10**6,
        first_token_timeout_s=5.0,
    )
    err = shed(bounded, prompt(100), "first-token bound of 5000 ms", slo_s=(120.0, 1.0))
    assert err.retry_after_ms >= 3000  # about 8.1 s predicted against 0.8 * 4.9 s of room
    with pytest.raises(InvalidRequestError, match="past the router's first-token bound of 5000 ms") as info:
        bounded.admit(prompt(6000), slo_s=(120.0, 1.0))  # ~6 s on an idle worker: no retry helps
    assert info.value.field == "prompt"


def test_admission_retry_hint_is_clamped():
    r = Router([worker("p0", queued_prefill_tokens=10**8), worker("d0", "decode")], max_queued_prefill_tokens=10**9)
    assert shed(r, prompt(100), "TTFT", slo_s=(1.0, 1.0)).retry_after_ms == MAX_RETRY_MS
    # Own cost 110 ms, SLO 250 ms: the queue may fill 0.8 * 140 = 112 ms of it; 117 queued is 5 ms too many.
    r2 = Router([worker("p0", queued_prefill_tokens=117), worker("d0", "decode")])
    assert shed(r2, prompt(100), "TTFT", slo_s=(0.25, 1.0)).retry_after_ms == MIN_RETRY_MS


def test_a_full_queues_retry_hint_is_when_the_overflow_has_drained():
    """32000 tokens queued, bound 32768 (priority 1): a 1000-token prompt fits once 232 of them are done, not
    the whole queue; a prompt past the bound on its own waits for all of it."""
    r = Router([worker("p0", queued_prefill_tokens=32000), worker("d0", "decode")])
    whole_queue_ms = r.predictor.queue_s(r.registry.workers(Role.PREFILL)[0]) * 1e3
    hint = shed(r, prompt(1000), "queue full", priority=1, slo_s=(120.0, 1.0)).retry_after_ms
    assert hint == pytest.approx(whole_queue_ms * 232 / 32000, abs=1)
    past = Router([worker("p0", queued_prefill_tokens=1000), worker("d0", "decode")], max_queued_prefill_tokens=2000)
    queue_ms = past.predictor.queue_s(past.registry.workers(Role.PREFILL)[0]) * 1e3
    assert shed(past, prompt(3000), "queue full", priority=1, slo_s=(120.0, 1.0)).retry_after_ms == int(queue_ms)


def test_admission_queue_bound_sheds_low_priority_first():
    # Bound 10000 tokens; priority 0 may fill 80 %, priority < 0 60 %, priority > 0 all of it.
    r = Router(
        [worker("p0", queued_prefill_tokens=7950), worker("d0", "decode")],
        max_queued_prefill_tokens=10_000,
        low_priority_reserve=0.2,
    )
    loose = (1000.0, 1.0)
    shed(r, prompt(100), "queue full", priority=0, slo_s=loose)
    shed(r, prompt(100), "queue full", priority=-1, slo_s=loose)
    r.admit(prompt(100), priority=1, slo_s=loose)
    r.admit(prompt(40), priority=0, slo_s=loose)  # 7990 fits under 8000


def test_admission_queue_bound_counts_router_local_pending_tokens():
    r = Router([worker("p0"), worker("d0", "decode")], max_queued_prefill_tokens=1000)
    loose = (1000.0, 1.0)
    r.admit(prompt(100), slo_s=loose)
    r.tracker.start("p0", "d0", new_tokens=750, seconds=0.75, blocks=50, prompt_tokens=750)
    shed(r, prompt(100), "queue full", slo_s=loose)
    r.admit(prompt(100), priority=1, slo_s=loose)


def test_the_queue_bound_counts_only_the_tokens_a_prompt_adds_past_its_cached_prefix():
    """A long shared prefix (a system prompt) the prefill worker holds costs its queue nothing."""
    r = Router([worker("p0", queued_prefill_tokens=600), worker("d0", "decode")], max_queued_prefill_tokens=1000)
    loose = (1000.0, 1.0)
    tokens = prompt(1024)
    shed(r, tokens, "queue full: 600 \\+ 1024 tokens", slo_s=loose)
    r.index.record(worker("p0").cache_key, r.place(tokens, 16, 1.0).block_hashes)
    placed = r.admit(tokens, slo_s=loose)
    assert placed.cached_tokens == 1008  # all but the last token's block: 16 new tokens


def test_admission_sheds_when_no_decode_worker_has_the_blocks():
    def cluster() -> Router:
        return Router(
            [worker("p0"), worker("d0", "decode", kv_blocks_free=7), worker("d1", "decode", kv_blocks_free=3)]
        )

    shed(cluster(), prompt(100), "free KV blocks", slo_s=(5.0, 1.0))  # 8 blocks needed, 4096 in total
    cluster().admit(prompt(100), max_tokens=12, slo_s=(5.0, 1.0))  # 7 blocks fit


def test_admission_sheds_when_every_decode_worker_has_a_full_batch():
    """RESOURCE_EXHAUSTED with a retry hint: a sequence ending frees a place, so a later retry can pass."""
    r = Router([worker("p0"), worker("d0", "decode", sequences=2, max_num_seqs=2)])
    shed(r, prompt(100), r"room in its batch now \(max_num_seqs 2\)", slo_s=(5.0, 1.0))
    Router([worker("p0"), worker("d0", "decode", sequences=1, max_num_seqs=2)]).admit(prompt(100), slo_s=(5.0, 1.0))


def test_a_stream_waiting_to_move_has_the_next_free_place_before_a_new_request():
    r = Router([worker("p0"), worker("d0", "decode", sequences=1, max_num_seqs=2)])
    r.tracker.moving = 1
    shed(r, prompt(100), "room in its batch", slo_s=(5.0, 1.0))
    r.tracker.moving = 0
    r.admit(prompt(100), slo_s=(5.0, 1.0))


def test_placement_leaves_a_moving_stream_its_place_where_another_worker_has_room_and_takes_it_for_the_stream():
    def cluster(d1_sequences: int) -> Router:
        return Router(
            [
                worker("p0"),
                worker("d0", "decode", sequences=3, max_num_seqs=4, kv_blocks_free=4000),  # one place, more blocks
                worker("d1", "decode", sequences=d1_sequences, max_num_seqs=4, kv_blocks_free=3000),
            ]
        )

    r = cluster(d1_sequences=0)
    r.tracker.moving = 1
    assert r.admit(prompt(100), slo_s=(5.0, 1.0)).decode.worker_id == "d1"  # not d0, where admission would shed
    full = cluster(d1_sequences=4)
    full.tracker.moving = 1  # the moving stream's own placement: d0's one place is the one it waits for
    assert full.place(prompt(100), 16, 5.0).decode.worker_id == "d0"


def test_admission_sheds_when_predicted_tpot_exceeds_the_slo():
    r = Router([worker("p0"), worker("d0", "decode", running=100), worker("d1", "decode", running=60)])
    shed(r, prompt(100), "TPOT", slo_s=(5.0, 0.1))
    r.admit(prompt(100), slo_s=(5.0, 0.5))  # d1: 20 + 5 * 61 ms = 325 ms
    # Within the SLO but past the headroom's share of it: 300 ms added to an idle 25 ms step > 0.8 * (360 - 25) ms.
    err = shed(r, prompt(100), "TPOT", slo_s=(5.0, 0.36))
    assert "325.0 ms" in str(err) and "adds 300.0 ms" in str(err) and "past the 268.0 ms" in str(err), err


def test_admission_sheds_at_the_in_flight_limit():
    r = Router([worker("p0"), worker("d0", "decode")], max_in_flight=4)
    r.admission.in_flight = 3
    r.admit(prompt(10))
    r.admission.in_flight = 4
    shed(r, prompt(10), "in flight")
    r.admission.in_flight = 10
    shed(r, prompt(10), "in flight")


# --- Admission: own cost vs queueing ---------------------------------------------------------------------------


def test_prediction_splits_into_own_cost_and_queueing():
    r = Router([worker("p0", queued_prefill_tokens=300, kv_bytes_per_token=10**6), worker("d0", "decode")])
    placed = r.place(prompt(200), 16, 1.0)
    assert placed.own_ttft_s == pytest.approx(0.01 + 0.2 + 0.2)  # prefill 210 ms + 200 tokens at 1 GB/s
    assert placed.queue_s == pytest.approx(0.3)
    assert placed.predicted_ttft_s == pytest.approx(placed.own_ttft_s + placed.queue_s)
    assert placed.offer.ttft_s == pytest.approx(placed.own_ttft_s)
    assert placed.offer.tpot_s == pytest.approx(PROFILE.decode_step_s(1))
    assert placed.offer.kv_blocks == 4096


def test_offer_is_the_best_idle_worker_even_when_placement_picks_another():
    r = Router([worker("p0", speed_factor=3.0), worker("p1", queued_prefill_tokens=5000), worker("d0", "decode")])
    placed = r.place(prompt(500), 16, 1.0)
    assert placed.prefill.worker_id == "p0"  # 1.53 s on a slow idle worker beats 5.51 s behind a queue
    assert placed.offer.ttft_s == pytest.approx(PROFILE.prefill_s(500))  # p1, were it idle


def test_the_margin_applies_to_the_queue_not_to_the_own_cost():
    # Own 510 ms against a 600 ms SLO: the old rule (predicted <= 0.8 * SLO) refused it even when idle.
    r = Router([worker("p0"), worker("d0", "decode")])
    assert r.admit(prompt(500), slo_s=(0.6, 1.0)).predicted_ttft_s == pytest.approx(0.51)
    # The queue may add 0.8 * 90 = 72 ms: 70 queued tokens fit, 80 do not.
    Router([worker("p0", queued_prefill_tokens=70), worker("d0", "decode")]).admit(prompt(500), slo_s=(0.6, 1.0))
    late = Router([worker("p0", queued_prefill_tokens=80), worker("d0", "decode")])
    err = shed(late, prompt(500), "TTFT", slo_s=(0.6, 1.0))
    # Predicted 590 ms, within the SLO: the message names the queue's share it is past, not the SLO.
    assert "590 ms" in str(err) and "exceeds" not in str(err), err
    assert "80 ms queued is past the 72 ms of queueing that the SLO of 600 ms leaves beyond" in str(err), err


def test_explicit_ttft_slo_below_the_idle_cost_is_invalid_naming_the_offer():
    r = Router([worker("p0", queued_prefill_tokens=10_000), worker("p1", speed_factor=2.0), worker("d0", "decode")])
    with pytest.raises(InvalidRequestError, match="smallest this cluster can offer is 510 ms") as info:
        r.admit(prompt(500), slo_s=(0.3, 1.0))  # p0 idle would take 510 ms, p1 1020 ms
    assert info.value.field == "slo.ttft_ms"
    assert "300 ms" in str(info.value)
    with pytest.raises(OverloadedError):  # meets it idle, not behind p0's queue
        r.admit(prompt(500), slo_s=(0.6, 1.0))


def test_an_slo_the_idle_profile_meets_is_never_invalid_while_workers_are_slowed_ejected_or_draining():
    """INVALID_ARGUMENT promises no retry succeeds: it is judged on every registered worker at its profiled speed.
    A worker slowed by contention (its speed factor, the router's calibration), ejected for a while or draining
    leaves a request its idle profile meets RESOURCE_EXHAUSTED, with a retry hint."""
    slo = (0.6, 1.0)  # 510 ms idle for 500 tokens
    slowed = Router([worker("p0", speed_factor=2.0), worker("d0", "decode", speed_factor=2.0)])
    err = shed(slowed, prompt(500), "TTFT", slo_s=slo)
    assert err.retry_after_ms >= MIN_RETRY_MS
    # Its own cost now (1020 ms) is past the 600 ms alone: said so, not "past -336 ms of queueing".
    assert "own 1020 ms at its current speed leaves no room for queueing within the SLO of 600 ms" in str(err), err
    err = shed(slowed, prompt(100), "TPOT", slo_s=(5.0, 0.03))  # 25 ms idle, 50 ms now
    assert "idle step's 50.0 ms at its current speed leaves no room within the SLO of 30.0 ms" in str(err), err
    calibrated = Router([worker("p0"), worker("d0", "decode")])
    for _ in range(10):
        calibrated.predictor.calibration.observe("p0", 0.5, 2.0, 1.0)
    shed(calibrated, prompt(500), "TTFT", slo_s=slo)
    ejected = Router([worker("fast"), worker("slow", speed_factor=3.0), worker("d0", "decode")])
    ejected.placement.ejections.eject(
        next(w for w in ejected.registry.workers(Role.PREFILL) if w.worker_id == "fast"), "its call failed"
    )
    shed(ejected, prompt(500), "TTFT", slo_s=slo)
    draining = Router([worker("fast", draining=True), worker("slow", speed_factor=3.0), worker("d0", "decode")])
    shed(draining, prompt(500), "TTFT", slo_s=slo)
    with pytest.raises(InvalidRequestError, match="slo.ttft_ms"):  # below the profile: no retry can help
        draining.admit(prompt(500), slo_s=(0.3, 1.0))


def test_explicit_ttft_slo_uses_the_prefix_cache_in_the_offer():
    r = Router([worker("p0"), worker("d0", "decode")])
    tokens = prompt(1024)
    with pytest.raises(InvalidRequestError, match="slo.ttft_ms"):
        r.admit(tokens, slo_s=(0.5, 1.0))
    r.index.record(worker("p0").cache_key, prefix_hashes(tokens[:-1], BS))
    assert r.admit(tokens, slo_s=(0.5, 1.0)).own_ttft_s < 0.05


def test_explicit_tpot_slo_below_an_idle_decode_step_is_invalid():
    r = Router([worker("p0"), worker("d0", "decode", running=100), worker("d1", "decode", running=60)])
    with pytest.raises(InvalidRequestError, match="offer is 25 ms") as info:
        r.admit(prompt(100), slo_s=(5.0, 0.02))  # one sequence alone steps in 20 + 5 ms
    assert info.value.field == "slo.tpot_ms"
    shed(r, prompt(100), "TPOT", slo_s=(5.0, 0.1))  # meets it alone, not in these batches


def test_a_long_context_request_or_batch_is_held_to_its_tpot_slo():
    """A decode step's cost grows with the context it reads (smollm2 on a CPU: 8 x 6000 tokens took 25x 8 x 64):
    a TPOT SLO only a short request meets idle is INVALID_ARGUMENT for a long one (no retry shortens its context),
    and a worker whose batch holds long contexts sheds what its batch size alone would admit."""
    deep = replace(PROFILE, decode_per_context_token_s=1e-5)  # 6000 tokens: 60 ms a step
    idle = Router([worker("p0"), worker("d0", "decode", profile=deep)])
    with pytest.raises(InvalidRequestError, match="offer is 86 ms") as info:  # 20 + 5 + 60.08 ms
        idle.admit(prompt(6000), slo_s=(30.0, 0.05))
    assert info.value.field == "slo.tpot_ms"
    idle.admit(prompt(100), slo_s=(30.0, 0.05))  # 26 ms
    idle.admit(prompt(6000), slo_s=(30.0, 0.1))  # its context is its own cost, which no load adds to
    busy = Router([worker("p0"), worker("d0", "decode", profile=deep, running=4, kv_blocks_free=4096 - 4 * 375)])
    shed(busy, prompt(100), "TPOT", slo_s=(30.0, 0.1))  # 45 ms by its batch's size, 286 ms with its context
    old = Router([worker("p0"), worker("d0", "decode", running=4, kv_blocks_free=4096 - 4 * 375)])
    old.admit(prompt(100), slo_s=(30.0, 0.1))  # a worker that did not measure the context: by batch size alone


def test_default_tpot_slo_never_sheds_what_one_idle_step_costs():
    r = Router([worker("p0"), worker("d0", "decode")])
    r.admit(prompt(100), slo_s=(5.0, 0.001), explicit=False)


def test_more_kv_blocks_than_any_worker_holds_is_invalid_fewer_is_retryable():
    r = Router([worker("p0"), worker("d0", "decode", kv_blocks_total=10, kv_blocks_free=10)])
    with pytest.raises(InvalidRequestError, match="11 KV blocks.*10 in total") as info:
        r.admit(prompt(100), max_tokens=70, slo_s=(5.0, 1.0))  # 170 tokens: 11 blocks
    assert info.value.field == "sampling.max_tokens"
    busy = Router([worker("p0"), worker("d0", "decode", kv_blocks_total=10, kv_blocks_free=4)])
    shed(busy, prompt(100), "free KV blocks", max_tokens=40, slo_s=(5.0, 1.0))  # 9 blocks: later, maybe


def test_a_tpot_slo_only_a_decode_worker_too_small_for_the_request_meets_is_invalid():
    """The offer's TPOT counts only decode workers whose KV holds the request: a fast one too small for it and a
    big one too slow for its SLO make a request no retry can serve, not a RESOURCE_EXHAUSTED."""
    fast = replace(PROFILE, decode_fixed_s=PROFILE.decode_fixed_s / 3)
    r = Router(
        [
            worker("p0"),
            worker("d-fast", "decode", profile=fast, kv_blocks_total=100, kv_blocks_free=100),
            worker("d-big", "decode"),
        ]
    )
    slo = (30.0, fast.decode_step_s(1) * 1.05)  # 126 blocks, more than d-fast holds
    with pytest.raises(InvalidRequestError, match="slo.tpot_ms"):
        r.admit(prompt(2000), slo_s=slo)
    assert r.admit(prompt(1000), slo_s=slo).decode.worker_id == "d-fast"  # 64 blocks: d-fast holds it


def test_a_ttft_slo_only_a_prefill_worker_too_small_for_the_prompt_meets_is_invalid():
    """The offer's TTFT counts only prefill workers whose KV holds the prompt (one too small refuses it): a fast
    small one and a slow big one make an SLO between them invalid, not shed on an idle cluster for ever."""
    fast = replace(PROFILE, prefill_per_token_s=PROFILE.prefill_per_token_s / 4)
    small = worker("p-fast", profile=fast, kv_blocks_total=10, kv_blocks_free=10)  # 160 tokens
    r = Router([small, worker("p-big"), worker("d0", "decode")])
    slo = ((fast.prefill_s(500) + PROFILE.prefill_s(500)) / 2, 1.0)
    with pytest.raises(InvalidRequestError, match="slo.ttft_ms"):
        r.admit(prompt(500), slo_s=slo)
    bound = Router([small, worker("p-big"), worker("d0", "decode")], first_token_timeout_s=slo[0])
    with pytest.raises(InvalidRequestError, match="first-token bound") as info:
        bound.admit(prompt(500), explicit=False)
    assert info.value.field == "prompt"
    assert r.admit(prompt(100), slo_s=slo).prefill.worker_id == "p-fast"  # 7 blocks: it holds those


def test_choices_are_judged_against_what_every_decode_worker_holds_together():
    """n choices stream at once, each placed on its own: two workers of 2 batch places hold 4 (and a worker's
    KV bounds it as its batch cap does)."""
    r = Router([worker("p0"), *(worker(f"d{i}", "decode", max_num_seqs=2) for i in range(2))])
    slo = SLOTarget(5.0, 1.0)
    placed = r.place(prompt(100), 16, 1.0)
    r.admission.check_feasible(placed, 100, slo, choices=Choices(4))
    with pytest.raises(InvalidRequestError, match="hold 4 such requests") as info:
        r.admission.check_feasible(placed, 100, slo, choices=Choices(5))
    assert info.value.field == "n"
    kv = Router([worker("p0"), worker("d0", "decode", kv_blocks_total=50, kv_blocks_free=50)])
    placed = kv.place(prompt(100), 60, 1.0)  # 10 blocks a choice
    kv.admission.check_feasible(placed, 100, slo, choices=Choices(5))
    with pytest.raises(InvalidRequestError, match="hold 5 such requests"):
        kv.admission.check_feasible(placed, 100, slo, choices=Choices(6))


def test_invalid_wins_over_overloaded():
    r = Router([worker("p0", queued_prefill_tokens=10**6), worker("d0", "decode")], max_in_flight=1)
    r.admission.in_flight = 5
    with pytest.raises(InvalidRequestError, match="slo.ttft_ms"):
        r.admit(prompt(500), slo_s=(0.1, 1.0))


# --- What the router learns itself -----------------------------------------------------------------------------


def test_a_stale_heartbeat_does_not_count_prompts_this_router_saw_prefilled_since():
    tracker = LoadTracker()
    pred = Predictor(RouterConfig(), tracker)
    placement = tracker.start("p0", "d0", new_tokens=512, seconds=0.52, blocks=33, prompt_tokens=512)
    time.sleep(0.01)
    stale = worker("p0", queued_prefill_tokens=512, updated_at=time.time() - 1.0)  # taken mid-prefill
    assert pred.queued_tokens(stale) == 512
    tracker.prefilled(placement)  # its first token came back since
    assert pred.queued_tokens(stale) == 0 and pred.queue_s(stale) == 0.0
    fresh = worker("p0", queued_prefill_tokens=300)  # reported after: all of it still queues
    assert pred.queued_tokens(fresh) == 300


def test_a_prefill_that_ends_between_sampling_and_reporting_a_queue_is_not_counted_twice():
    """The report is sent after its load was sampled: what ended in between is in it, and must come off."""
    tracker = LoadTracker()
    pred = Predictor(RouterConfig(), tracker)
    placement = tracker.start("p0", "d0", new_tokens=40, seconds=0.04, blocks=3, prompt_tokens=40)
    time.sleep(0.02)  # the report's sampling (10 ms before it was sent, below) after the placement
    sampled = time.time()
    tracker.prefilled(placement)
    late = worker("p0", queued_prefill_tokens=40, load_at=sampled, updated_at=time.time() + 0.01)
    assert pred.queued_tokens(late) == 0
    unknown = worker("p0", queued_prefill_tokens=40, updated_at=time.time() + 0.01)  # an older worker's report
    assert pred.queued_tokens(unknown) == 40


def test_the_queue_bound_never_sheds_a_prompt_for_its_own_size():
    r = Router([worker("p0"), worker("d0", "decode")], max_queued_prefill_tokens=1000)
    r.admit(prompt(1500), slo_s=(1000.0, 1.0))  # alone in an empty queue
    r.tracker.start("p0", "d0", new_tokens=10, seconds=0.01, blocks=1, prompt_tokens=10)
    shed(r, prompt(1500), "queue full", slo_s=(1000.0, 1.0))  # behind anything: a retry can succeed


def test_a_prompt_the_prefix_cache_held_leaves_no_phantom_queue_in_a_stale_report():
    """The router counted only the uncached tail of a prompt it predicted the prefix cache held, but the worker's
    queue shows what its cache really held (here nothing: evicted since): once the first token is back, a report
    sampled while it waited must count none of it, or an idle worker sheds the next prompt for a queue it lacks."""
    tracker = LoadTracker()
    pred = Predictor(RouterConfig(), tracker)
    placement = tracker.start("p0", "d0", new_tokens=1, seconds=0.001, blocks=4, prompt_tokens=49)
    time.sleep(0.01)
    while_waiting = worker("p0", queued_prefill_tokens=49, queued_prefill_prompts=1, load_at=time.time())
    assert pred.queued_tokens(while_waiting) == 49
    tracker.prefilled(placement)
    assert pred.queued_tokens(while_waiting) == 0
    tracker.finished(placement)
    assert tracker.decoding["d0"] == 0 and tracker.pending_blocks["d0"] == 0
