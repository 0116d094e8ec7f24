"""The router prices a prompt's wait as the prefill worker orders it (engine/short_first.py): a prompt that fits one
step waits for the short prompts queued and the chunk in flight, a longer one for the whole queue."""

from __future__ import annotations

import time

import pytest

from pdserve.config import RouterConfig
from pdserve.registry.base import WorkerState
from services.router.load_tracker import LoadTracker
from services.router.predictor import Predictor
from tests.unit.round_profile import PROFILE
from tests.unit.router.router_builder import Router, prompt, shed, worker

# A 3000-token prompt part-way (2488 left) and two 100-token ones queued; of it, a short prompt waits for the two
# and the long prompt's 512-token chunk in flight.
REPORT = dict(
    queued_prefill_prompts=3,
    queued_prefill_tokens=2488 + 200,
    queued_prefill_token_squares=2 * 100**2,
    queued_short_prefill_prompts=3,
    queued_short_prefill_tokens=512 + 200,
    queued_short_prefill_token_squares=2 * 100**2,
)


def test_a_short_prompt_is_priced_behind_the_short_prompts_and_the_chunk_in_flight_a_long_one_behind_all() -> None:
    pred = Predictor(RouterConfig(), LoadTracker())
    w = worker("p0", short_prompt_tokens=512, **REPORT)
    assert pred.queue_s(w, 100) == pytest.approx(PROFILE.prefill_s(512) + 2 * PROFILE.prefill_s(100))
    assert pred.queue_s(w, 512) == pred.queue_s(w, 100)  # fits one step
    whole = 3 * PROFILE.prefill_fixed_s + (2488 + 200) * PROFILE.prefill_per_token_s
    assert pred.queue_s(w, 513) == pytest.approx(whole)
    assert pred.queue_s(w) == pytest.approx(whole)  # any prompt: the whole queue (a retry hint's)
    assert pred.ttft_s(w, 100, 0) == pytest.approx(pred.own_ttft_s(w, 100, 0) + pred.queue_s(w, 100))


def test_admission_serves_a_short_prompt_behind_a_long_ones_chunk_that_it_sheds_behind_all_of_the_long_one() -> None:
    """A 1.5 s TTFT SLO: 0.73 s of short work queued on a worker that lets it ahead, 2.71 s on one that does not."""
    ordered = Router([worker("p0", short_prompt_tokens=512, **REPORT), worker("d0", "decode")])
    placed = ordered.admit(prompt(100), slo_s=(1.5, 1.0))
    assert placed.prefill_queue_s == pytest.approx(PROFILE.prefill_s(512) + 2 * PROFILE.prefill_s(100))
    in_order = Router([worker("p0", **REPORT), worker("d0", "decode")])
    shed(in_order, prompt(100), "queue", slo_s=(1.5, 1.0))


def test_a_chunk_in_flight_that_the_worker_timed_counts_its_seconds_as_measured() -> None:
    pred = Predictor(RouterConfig(), LoadTracker())
    shorts = dict(
        queued_short_prefill_prompts=2, queued_short_prefill_tokens=200, queued_short_prefill_token_squares=2 * 100**2
    )
    w = worker("p0", short_prompt_tokens=512, prefill_chunk_s=1.5, speed_factor=2.0, **{**REPORT, **shorts})
    assert pred.queue_s(w, 100) == pytest.approx(2 * 2 * PROFILE.prefill_s(100) + 1.5)
    assert pred.queue_s(w, 1000) == pytest.approx(
        2 * (3 * PROFILE.prefill_fixed_s + 2688 * PROFILE.prefill_per_token_s)
    )


def test_a_worker_that_takes_prompts_in_order_has_every_prompt_priced_behind_all_its_queue() -> None:
    pred = Predictor(RouterConfig(), LoadTracker())
    w = worker("p0", **REPORT)  # short_prompt_tokens 0: in order, or a worker too old to say
    assert pred.queue_s(w, 100) == pytest.approx(pred.queue_s(w, 3000))


def test_our_own_prompts_not_yet_reported_count_for_a_short_prompt_as_the_short_ones_and_one_chunk() -> None:
    """A long prompt of ours counts one chunk (its share of its seconds) until a report sampled after it was placed,
    which shows the chunk it has in flight, if any; a short one counts until its first token is back."""
    tracker = LoadTracker()
    pred = Predictor(RouterConfig(), tracker)
    before = worker("p0", short_prompt_tokens=500)
    time.sleep(0.01)
    tracker.start("p0", "d0", new_tokens=3000, seconds=3.0, blocks=200, prompt_tokens=3000)
    tracker.start("p0", "d0", new_tokens=100, seconds=0.1, blocks=8, prompt_tokens=100)
    assert pred.queue_s(before, 100) == pytest.approx(0.1 + 3.0 * 500 / 3000)
    assert pred.queue_s(before, 1000) == pytest.approx(3.1)
    time.sleep(0.01)
    after = worker("p0", short_prompt_tokens=500)  # its report shows neither: the local count is the least
    assert pred.queue_s(after, 100) == pytest.approx(0.1)


def test_our_short_prompt_prefilled_since_the_report_comes_off_the_short_part_and_a_long_one_does_not() -> None:
    tracker = LoadTracker()
    pred = Predictor(RouterConfig(), tracker)
    long = tracker.start("p0", "d0", new_tokens=3000, seconds=3.0, blocks=200, prompt_tokens=3000)
    short = tracker.start("p0", "d0", new_tokens=100, seconds=0.1, blocks=8, prompt_tokens=100)
    time.sleep(0.01)  # the report sampled with both of ours in it
    w = worker("p0", short_prompt_tokens=512, load_at=time.time(), **REPORT)
    before = pred.queue_s(w, 100)
    tracker.prefilled(long)
    assert pred.queue_s(w, 100) == pytest.approx(before)
    tracker.prefilled(short)
    assert pred.queue_s(w, 100) == pytest.approx(PROFILE.prefill_s(512) + PROFILE.prefill_s(100))


def test_a_long_prompt_on_a_stretched_worker_is_priced_its_stretch_as_load_and_a_short_one_is_not() -> None:
    """A worker whose long prompts took 1.5x their own chunks' time under the short prompts that went ahead: a
    3000-token prompt's queue counts half its own compute more; its own cost and what an idle worker offers do not
    move, nor a short prompt's price, nor any prompt's where prompts run in order."""
    pred = Predictor(RouterConfig(), LoadTracker())
    plain = worker("p0", short_prompt_tokens=512, **REPORT)
    stretched = worker("p0", short_prompt_tokens=512, prefill_stretch=1.5, **REPORT)
    own = pred.prefill_s(stretched, 3000)
    assert pred.queue_s(stretched, 3000) == pytest.approx(pred.queue_s(plain, 3000) + 0.5 * own)
    assert pred.ttft_s(stretched, 3000, 0) == pytest.approx(pred.ttft_s(plain, 3000, 0) + 0.5 * own)
    assert pred.own_ttft_s(stretched, 3000, 0) == pred.own_ttft_s(plain, 3000, 0)
    assert pred.offer_ttft_s(stretched, 3000, 0) == pred.offer_ttft_s(plain, 3000, 0)
    assert pred.queue_s(stretched, 512) == pred.queue_s(plain, 512)  # fits one step: it is what goes ahead
    assert pred.queue_s(stretched) == pred.queue_s(plain)  # the whole queue, as a retry hint prices it
    in_order = worker("p0", prefill_stretch=1.5, **REPORT)  # short_prompt_tokens 0
    assert pred.queue_s(in_order, 3000) == pred.queue_s(worker("p0", **REPORT), 3000)


def test_admission_sheds_a_long_prompt_that_its_stretch_takes_past_its_slo_as_overloaded_with_a_retry_hint() -> None:
    """An idle worker, a 3000-token prompt (3.01 s of its own) and a 5 s SLO: admitted unstretched; stretched 2x, the
    short prompts that will pass push it past its SLO, which a retry may meet once they have: RESOURCE_EXHAUSTED,
    never INVALID_ARGUMENT (no idle worker is too slow for it)."""
    plain = Router([worker("p0", short_prompt_tokens=512), worker("d0", "decode")])
    assert plain.admit(prompt(3000), slo_s=(5.0, 1.0)).queue_s == 0
    stretched = Router([worker("p0", short_prompt_tokens=512, prefill_stretch=2.0), worker("d0", "decode")])
    shed(stretched, prompt(3000), "predicted TTFT", slo_s=(5.0, 1.0))
    assert stretched.admit(prompt(500), slo_s=(5.0, 1.0)).queue_s == 0


def test_a_worker_entry_without_the_stretch_reads_as_none_and_one_with_it_carries_it() -> None:
    """A worker of an earlier build writes no prefill_stretch: 1.0, no stretch. An entry with it carries it; a router
    of an earlier build ignores a field it does not know (WorkerState.from_json)."""
    state = worker("p0", short_prompt_tokens=512, prefill_stretch=1.7)
    assert WorkerState.from_json(state.to_json()) == state
    old = worker("p1").to_json().replace(', "prefill_stretch": 1.0', "")
    assert "prefill_stretch" not in old and WorkerState.from_json(old).prefill_stretch == 1.0
