"""The worker performance profile: least-squares fits and the live speed correction."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pdserve.engine.profiling import SpeedTracker
from pdserve.protocol.perf_profile import PerfProfile, QueuedPrefill, attention_squares, kv_transfer_s
from pdserve.registry.base import WorkerState
from tests.unit.round_profile import PROFILE
from tests.unit.router.router_builder import worker


def test_fit_recovers_exact_quadratic_prefill_and_linear_decode():
    truth = PerfProfile(0.004, 2.5e-4, 3e-7, 0.015, 0.0021)
    prefill = [(n, 0, truth.prefill_s(n)) for n in (32, 128, 512)]
    decode = [(b, 64, truth.decode_step_s(b)) for b in (1, 8, 32)]
    fitted = PerfProfile.fit(prefill, decode)
    for name, want in truth.to_dict().items():
        assert getattr(fitted, name) == pytest.approx(want, rel=1e-6, abs=1e-12), name


def test_fit_recovers_the_decode_steps_cost_per_context_token():
    """A step at a deep context costs more than the batch line at a short one says (a CPU's 8 x 6000 tokens took
    25x its 8 x 64): the fit takes it apart from the per-sequence cost."""
    truth = replace(PROFILE, decode_per_context_token_s=2e-6)
    shapes = ((1, 64), (8, 64), (32, 64), (1, 2048), (8, 2048))
    decode = [(b, c, truth.decode_step_s(b, b * c)) for b, c in shapes]
    fitted = PerfProfile.fit([(n, 0, truth.prefill_s(n)) for n in (32, 128, 512)], decode)
    for name, want in truth.to_dict().items():
        assert getattr(fitted, name) == pytest.approx(want, rel=1e-6, abs=1e-12), name


def test_a_profile_of_a_build_without_the_context_term_parses_and_prices_by_batch_alone():
    """An older worker's registry entry: no decode_per_context_token_s. It parses, and its step costs what that
    build's router predicted, whatever context the batch holds."""
    entry = {k: v for k, v in PROFILE.to_dict().items() if k != "decode_per_context_token_s"}
    old = PerfProfile.from_dict(entry)
    assert old.decode_per_context_token_s == 0.0
    assert old.decode_step_s(8, 8 * 6000) == old.decode_step_s(8) == pytest.approx(0.02 + 8 * 0.005)
    state = worker("d0", "decode", profile=None).to_json().replace('"profile": null', f'"profile": {json.dumps(entry)}')
    assert WorkerState.from_json(state).profile == old


def test_fit_recovers_a_purely_linear_prefill_with_no_quadratic_term():
    truth = PerfProfile(0.002, 1e-4, 0.0, 0.01, 0.0)
    fitted = PerfProfile.fit(
        [(n, 0, truth.prefill_s(n)) for n in (16, 64, 256, 1024)], [(b, 64, truth.decode_step_s(b)) for b in (1, 4, 16)]
    )
    assert fitted.prefill_per_token_s == pytest.approx(1e-4, rel=1e-6)
    assert fitted.prefill_per_token2_s == pytest.approx(0.0, abs=1e-15)
    assert fitted.prefill_fixed_s == pytest.approx(0.002, rel=1e-6)
    assert fitted.decode_fixed_s == pytest.approx(0.01, rel=1e-6)
    assert fitted.decode_per_seq_s == pytest.approx(0.0, abs=1e-15)


@pytest.mark.parametrize(
    "prefill,decode",
    [
        (
            [(32, 0, 0.05), (128, 0, 0.04), (512, 0, 0.03)],
            [(1, 64, 0.01), (8, 64, 0.009), (32, 64, 0.008)],
        ),  # faster with more
        ([(32, 0, 0.001), (128, 0, 0.2), (512, 0, 0.21)], [(1, 64, 0.0), (8, 64, 0.05), (32, 64, 0.051)]),  # concave
        ([(32, 0, 0.0), (128, 0, 0.0), (512, 0, 0.0)], [(1, 64, 0.0), (8, 64, 0.0), (32, 64, 0.0)]),  # all zero
        ([(32, 0, 0.01)], [(1, 64, 0.02), (8, 64, 0.03), (8, 2048, 0.025)]),  # shorter with more context
    ],
)
def test_fit_never_yields_negative_coefficients_or_times(prefill, decode):
    fitted = PerfProfile.fit(prefill, decode)
    assert all(v >= 0 for v in fitted.to_dict().values()), fitted
    assert all(fitted.prefill_s(n) >= 0 for n in range(0, 4096, 7))
    assert all(fitted.decode_step_s(b, c) >= 0 for b in range(0, 128) for c in (0, 64 * b, 4096 * b))


def test_fit_drops_a_negative_term_and_refits_the_rest():
    # Prefill time flat in tokens: the fit must keep the fixed part, not zero everything.
    fitted = PerfProfile.fit(
        [(32, 0, 0.05), (128, 0, 0.05), (512, 0, 0.05)], [(1, 64, 0.02), (8, 64, 0.02), (32, 64, 0.02)]
    )
    assert fitted.prefill_s(100) == pytest.approx(0.05, rel=1e-3)
    assert fitted.decode_step_s(4) == pytest.approx(0.02, rel=1e-3)


def test_profile_round_trips_through_a_dict():
    assert PerfProfile.from_dict(PROFILE.to_dict()) == PROFILE
    assert PerfProfile.from_dict({k: str(v) for k, v in PROFILE.to_dict().items()}) == PROFILE
    assert PROFILE.prefill_s(0) == 0.0


def test_a_prompt_after_a_cached_prefix_pays_for_reading_it():
    """Each new token attends to the cached ones too: a chunk after 3584 cached tokens took 3.2 s here against 1.06 s
    for the same 512 tokens alone (smollm2-135m, 2 CPU cores), priced 1.03 s as new tokens alone."""
    profile = PerfProfile(0.02, 1.5e-3, 5e-7, 0.06, 4e-3)
    assert profile.prefill_s(100, cached=3000) - profile.prefill_s(100) == pytest.approx(5e-7 * 2 * 100 * 3000)
    chunks = [profile.prefill_s(min(512, 3873 - done), cached=done) for done in range(0, 3873, 512)]
    assert sum(chunks) == pytest.approx(profile.prefill_s(3873) + 7 * 0.02)  # the same attention, chunked


def test_speed_tracker_moves_toward_the_measured_over_predicted_ratio():
    slow = SpeedTracker(PROFILE, alpha=0.5)
    predicted = PROFILE.prefill_s(100)
    slow.observe(100, 0, 2 * predicted)
    assert slow.factor == pytest.approx(1.5)
    for _ in range(30):
        slow.observe(100, 0, 2 * predicted)
    assert slow.factor == pytest.approx(2.0, rel=1e-3)

    fast = SpeedTracker(PROFILE, alpha=0.5)
    for _ in range(30):
        fast.observe(0, 8, 0.5 * PROFILE.decode_step_s(8))
    assert fast.factor == pytest.approx(0.5, rel=1e-3)


def test_a_profile_measured_on_a_loaded_host_is_corrected_to_the_speed_the_worker_runs_at():
    """Profiled while other processes held the cores, 10x slow: the live steps bring the price to what they take."""
    t = SpeedTracker(PROFILE, alpha=0.5)
    for _ in range(40):
        t.observe(100, 0, PROFILE.prefill_s(100) / 10)
    assert t.factor == pytest.approx(0.1, rel=1e-3)


def test_speed_tracker_prices_the_context_a_decode_step_reads():
    """A long-context batch's step at its profiled cost is no slower than predicted: were its context left out,
    the worker's speed factor would rise (here to 1.55) and the router, which prices the context too, count it
    twice."""
    deep = replace(PROFILE, decode_per_context_token_s=1e-6)
    t = SpeedTracker(deep, alpha=1.0)
    t.observe(0, 8, deep.decode_step_s(8, 8 * 4096), decode_context=8 * 4096)
    assert t.factor == pytest.approx(1.0)


def test_speed_tracker_counts_both_phases_of_a_mixed_step_and_ignores_empty_ones():
    t = SpeedTracker(PROFILE, alpha=1.0)
    t.observe(64, 4, PROFILE.prefill_s(64) + PROFILE.decode_step_s(4))
    assert t.factor == pytest.approx(1.0)
    t.observe(0, 0, 5.0)  # nothing was predicted: nothing to learn
    assert t.factor == pytest.approx(1.0)
    t.observe(10, 0, 1e6)  # one pathological step moves it by a bounded amount
    assert t.factor == pytest.approx(4.0)


@pytest.mark.parametrize(
    ("queue", "out", "left"),
    [
        (QueuedPrefill(3, 300, 30_000), QueuedPrefill(1, 100, 10_000), QueuedPrefill(2, 200, 20_000)),  # exact
        (QueuedPrefill(3, 300, 50_000), QueuedPrefill(2, 100, 0), QueuedPrefill(1, 200, 50_000)),
        # every prompt it held was ours: nothing left, though it counted more of them than we predicted (a prefix
        # evicted since we placed them), which would price an idle worker busy
        (QueuedPrefill(2, 300, 50_000), QueuedPrefill(2, 200, 0), QueuedPrefill()),
        # another router's 4 x 1024 tokens, and ours: 2048 of which 1984 were cached, 64 new
        (
            QueuedPrefill(5, 4160, 4 * 1024**2 + attention_squares(64, 1984)),
            QueuedPrefill(1, 64, attention_squares(64, 1984)),
            QueuedPrefill(4, 4096, 4 * 1024**2),
        ),
        # another router's 512 tokens after 3584 cached keep their reads of the prefix, with ours out or none
        (
            QueuedPrefill(2, 612, attention_squares(512, 3584) + 100**2),
            QueuedPrefill(1, 100, 100**2),
            QueuedPrefill(1, 512, attention_squares(512, 3584)),
        ),
        (
            QueuedPrefill(1, 512, attention_squares(512, 3584)),
            QueuedPrefill(),
            QueuedPrefill(1, 512, attention_squares(512, 3584)),
        ),
        (
            QueuedPrefill(4, 1000, 250_000),
            QueuedPrefill(1, 100, 240_000),
            QueuedPrefill(3, 900, 270_000),
        ),  # equal thirds at least
        (QueuedPrefill(1, 100, 10_000), QueuedPrefill(1, 200, 40_000), QueuedPrefill()),
    ],
)
def test_a_queue_less_an_estimate_of_its_part_is_a_queue_that_can_be(
    queue: QueuedPrefill, out: QueuedPrefill, left: QueuedPrefill
) -> None:
    """Tokens need a prompt, and n tokens in p prompts square to at least n²/p (equal prompts, nothing cached); at
    most, with a cached prefix before them, to anything."""
    assert queue.minus(out) == left


def test_a_step_whose_prompt_chunks_read_cached_tokens_is_priced_with_those_reads() -> None:
    """A chunk after a cached prefix at its profiled cost is a worker on profile: priced as new tokens alone it read
    as up to 4x slow, and the router refused every request with an SLO on an idle cluster (a review). Observed, a
    worker whose every prompt follows a cached prefix (a chat's turns) is corrected from its start-up profile too
    (it was never, while such steps went unobserved)."""
    host = PerfProfile(0.02, 1.5e-3, 5e-7, 0.06, 4e-3)
    t = SpeedTracker(host, alpha=1.0)
    t.observe(512, 0, host.prefill_s(512, cached=3584), prefill_squares=attention_squares(512, 3584))
    assert t.factor == pytest.approx(1.0)
    for _ in range(40):  # a profile measured on a loaded host, 3x slow: every step a chat's next turn
        t.observe(512, 0, host.prefill_s(512, cached=3584) / 3, prefill_squares=attention_squares(512, 3584))
    assert t.factor == pytest.approx(1 / 3)
    two = attention_squares(64, 1000) + attention_squares(32, 200)  # two prompts' chunks in one step: one call's fixed
    t = SpeedTracker(host, alpha=1.0)
    t.observe(96, 0, host.prefill_s(64, cached=1000) + host.prefill_s(32, cached=200) - 0.02, prefill_squares=two)
    assert t.factor == pytest.approx(1.0)


def test_a_kv_transfer_is_its_latency_plus_its_bytes_at_decimal_gigabytes_per_second():
    """One formula for the router's prediction and the planner's simulation: 1000 tokens of 1 MB each take 1 s at
    1 GB/s (1e9 bytes, not 2**30), after the latency; at 0 GB/s (bytes too cheap to measure) the latency alone."""
    assert kv_transfer_s(1000, 1_000_000, 1.0) == pytest.approx(1.0)
    assert kv_transfer_s(1000, 1_000_000, 10.0, latency_s=0.002) == pytest.approx(0.102)
    assert kv_transfer_s(1000, 1_000_000, 0.0, latency_s=0.002) == 0.002
    assert kv_transfer_s(1000, 0, 1.0) == 0.0  # a worker that reports no KV size: nothing predicted
