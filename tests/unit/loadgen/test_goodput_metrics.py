"""The metric definitions on hand-made streams: TTFT, TPOT, ITL, E2EL, goodput and SLO attainment."""

from __future__ import annotations

import numpy as np
import pytest

from loadgen import metrics
from loadgen.metrics import GoodputSLO
from loadgen.record import RequestRecord


def stream(times: list[float], tokens: list[int], status: str = "OK", output_len: int | None = None) -> RequestRecord:
    record = RequestRecord("r", input_len=10, output_len=output_len or sum(tokens), scheduled_s=0.0, status=status)
    record.message_times_s, record.message_tokens = times, tokens
    return record


def test_one_token_per_message():
    r = stream([0.5, 0.6, 0.7, 0.9], [1, 1, 1, 1])
    assert metrics.ttft_s(r) == 0.5
    assert metrics.e2el_s(r) == 0.9
    assert metrics.tpot_s(r) == pytest.approx(0.4 / 3)
    assert metrics.itls_s(r) == pytest.approx([0.1, 0.1, 0.2])


def test_a_message_of_several_tokens_is_one_itl_as_vllm_counts_it():
    # A first message with no tokens (headers only) does not count as the first token; a closing message
    # without tokens ends E2EL but adds no ITL. A message of three tokens after 0.3 s is one wait of 0.3 s for
    # its reader (TPOT is the per-token figure).
    r = stream([0.1, 0.5, 0.6, 0.9, 1.0], [0, 2, 1, 3, 0])
    assert metrics.ttft_s(r) == 0.5
    assert metrics.e2el_s(r) == 1.0
    assert r.output_tokens == 6
    assert metrics.tpot_s(r) == pytest.approx(0.5 / 5)
    assert metrics.itls_s(r) == pytest.approx([0.1, 0.3])


def test_per_token_itl_spreads_each_chunks_gap_over_its_tokens_as_sglang_does():
    r = stream([0.1, 0.5, 0.6, 0.9, 1.0], [0, 2, 1, 3, 0])
    assert metrics.token_itls_s(r) == pytest.approx([0.1, 0.1, 0.1, 0.1])  # 0.1 over 1 token, 0.3 over 3
    s = metrics.summarize([r, stream([0.2, 0.6], [1, 1])], 1.0, GoodputSLO())
    assert s["token_itl_requests"] == 2
    assert s["mean_token_itl_ms"] == pytest.approx(np.mean([100, 100, 100, 100, 400]))
    assert s["mean_itl_ms"] == pytest.approx(np.mean([100, 300, 400]))  # per chunk, as vLLM's


def test_per_token_itl_is_unknown_where_the_chunks_do_not_say_their_tokens():
    """An OpenAI stream: one token counted per chunk; a usage total of more tokens means chunks carried several."""
    merged = stream([0.1, 0.2, 0.3], [1, 1, 1])
    merged.reported_tokens = 5
    assert metrics.token_itls_s(merged) is None
    assert metrics.summarize([merged], 1.0, GoodputSLO())["token_itl_requests"] == 0
    merged.reported_tokens = 3
    assert metrics.token_itls_s(merged) == pytest.approx([0.1, 0.1])


def test_time_held_back_by_the_concurrency_bound_is_in_no_latency():
    r = stream([0.5, 0.6, 0.9], [1, 1, 1])
    r.wait_s = 0.25
    assert (metrics.ttft_s(r), metrics.e2el_s(r), metrics.tpot_s(r)) == pytest.approx((0.5, 0.9, 0.2))
    assert metrics.is_good(r, GoodputSLO(ttft_ms=600))


def test_single_token_has_no_tpot_and_meets_any_tpot_bound():
    r = stream([0.2], [1])
    assert metrics.tpot_s(r) is None
    assert metrics.itls_s(r) == []
    assert metrics.is_good(r, GoodputSLO(tpot_ms=1.0))


def test_goodput_needs_every_bound_met():
    r = stream([0.25, 0.375, 0.5], [1, 1, 1])  # TTFT 250 ms, TPOT 125 ms, E2EL 500 ms (exact in binary)
    assert metrics.is_good(r, GoodputSLO())
    assert metrics.is_good(r, GoodputSLO(ttft_ms=250, tpot_ms=125, e2el_ms=500))  # bounds are inclusive
    assert not metrics.is_good(r, GoodputSLO(ttft_ms=249))
    assert not metrics.is_good(r, GoodputSLO(ttft_ms=1000, tpot_ms=124))
    assert not metrics.is_good(r, GoodputSLO(e2el_ms=499))
    assert not metrics.is_good(stream([0.1, 0.2], [1, 1], status="UNAVAILABLE"), GoodputSLO(ttft_ms=1000))


def test_summary_counts_goodput_and_attainment():
    records = [
        stream([0.1, 0.2, 0.3], [1, 1, 1]),  # good: TTFT 100, TPOT 100
        stream([0.4, 0.5], [1, 1]),  # TTFT 400: misses the TTFT bound
        stream([0.1, 0.5], [1, 1]),  # TPOT 400: misses the TPOT bound
        stream([0.05, 0.1, 0.15, 0.2], [1, 1, 1, 1]),  # good
        stream([], [], status="RESOURCE_EXHAUSTED", output_len=8),
        stream([0.1], [1], status="UNAVAILABLE", output_len=8),  # broke mid-stream: failed, not counted
        stream([], [], status="DEADLINE_EXCEEDED", output_len=8),
        stream([], [], status="UNAVAILABLE", output_len=8),
    ]
    s = metrics.summarize(records, duration_s=2.0, slo=GoodputSLO(ttft_ms=200, tpot_ms=150))
    assert s["completed"] == 4
    assert s["rejected"] == 1
    assert s["failed"] == 4  # as vLLM counts: every request that did not complete
    assert s["failed_by_code"] == {"RESOURCE_EXHAUSTED": 1, "UNAVAILABLE": 2, "DEADLINE_EXCEEDED": 1}
    assert s["short_outputs"] == 0
    assert s["total_input_tokens"] == 40
    assert s["total_output_tokens"] == 3 + 2 + 2 + 4
    assert s["request_throughput"] == 2.0
    assert s["request_goodput"] == 1.0  # 2 good requests in 2 s
    assert s["slo_attainment"] == 2 / 8  # of every request sent, rejected and failed included
    assert s["output_throughput"] == 11 / 2
    assert s["total_token_throughput"] == (40 + 11) / 2


def test_summary_statistics_are_numpy_over_the_requests():
    records = [stream([t, t + 0.01 * (i + 1), t + 0.03 * (i + 1)], [1, 1, 1]) for i, t in enumerate([0.1, 0.2, 0.7])]
    s = metrics.summarize(records, duration_s=1.0, slo=GoodputSLO())
    ttft = np.array([100.0, 200.0, 700.0])
    tpot = np.array([15.0, 30.0, 45.0])
    itl = np.array([10.0, 20.0, 20.0, 40.0, 30.0, 60.0])
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        assert s[f"mean_{name}_ms"] == pytest.approx(values.mean())
        assert s[f"median_{name}_ms"] == pytest.approx(np.median(values))
        assert s[f"std_{name}_ms"] == pytest.approx(values.std())
        assert s[f"p90_{name}_ms"] == pytest.approx(np.percentile(values, 90))
        assert s[f"p99_{name}_ms"] == pytest.approx(np.percentile(values, 99))
    assert s["mean_e2el_ms"] == pytest.approx(np.mean([130.0, 260.0, 790.0]))
    assert s["request_goodput"] is None and s["slo_attainment"] is None  # no bounds asked


def test_summary_of_nothing_completed_has_no_latencies_not_zeros():
    """0 ms read as infinitely fast: `loadgen compare` showed such a run's TTFT as 0.00x its baseline's."""
    s = metrics.summarize([stream([], [], status="RESOURCE_EXHAUSTED")], 1.0, GoodputSLO(ttft_ms=1))
    assert s["completed"] == 0 and s["request_goodput"] == 0.0
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert [s[f"{stat}_{name}_ms"] for stat in ("mean", "median", "std", "p90", "p99")] == [None] * 5


def test_time_to_reject_is_summarized_over_the_shed_requests_only():
    shed = [stream([], [], status="RESOURCE_EXHAUSTED") for _ in range(3)]
    for record, error_s in zip(shed, (0.002, 0.004, 0.009), strict=True):
        record.error_s = error_s
    broken = stream([], [], status="UNAVAILABLE")
    broken.error_s = 5.0
    s = metrics.summarize([*shed, broken, stream([0.1], [1])], 1.0, GoodputSLO())
    assert s["median_time_to_reject_ms"] == pytest.approx(4.0)
    assert s["mean_time_to_reject_ms"] == pytest.approx(5.0)
    assert metrics.summarize([stream([0.1], [1])], 1.0, GoodputSLO())["p99_time_to_reject_ms"] is None


def test_goodput_flag_parsing():
    assert GoodputSLO.parse(["ttft:500", "tpot:50"]) == GoodputSLO(ttft_ms=500.0, tpot_ms=50.0)
    assert GoodputSLO.parse(["e2el:2000.5"]).as_dict() == {"e2el_ms": 2000.5}
    assert not GoodputSLO.parse([]).bounded
    for bad in (["ttft=500"], ["itl:5"], ["tpot:0"], ["tpot:x"]):
        with pytest.raises(ValueError):
            GoodputSLO.parse(bad)


def test_a_request_completed_with_fewer_tokens_than_asked_is_counted_short():
    records = [stream([0.1, 0.2], [1, 1], output_len=64), stream([0.1, 0.2], [1, 1], output_len=2)]
    s = metrics.summarize(records, duration_s=1.0, slo=GoodputSLO(tpot_ms=10))
    assert (s["completed"], s["short_outputs"]) == (2, 1)


def sweep(attainments: dict[float | str, float | None], interrupted: float | None = None) -> list[dict]:
    return [
        {"request_rate": rate, "slo_attainment": a, "interrupted": rate == interrupted}
        for rate, a in attainments.items()
    ]


def test_distserve_goodput_is_the_highest_rate_swept_whose_attainment_reaches_the_target():
    assert metrics.distserve_goodput(sweep({1.0: 1.0, 2.0: 0.9, 4.0: 0.6}), 0.9) == 2.0  # the target is inclusive
    assert metrics.distserve_goodput(sweep({4.0: 0.95, 1.0: 0.8, 2.0: 0.99}), 0.9) == 4.0  # highest, in any order
    assert metrics.distserve_goodput(sweep({1.0: 0.8, 2.0: 0.5}), 0.9) is None  # none met
    assert metrics.distserve_goodput(sweep({1.0: 0.95, "inf": 1.0}), 0.9) == 1.0  # all at once names no rate
    assert metrics.distserve_goodput(sweep({1.0: 0.95, 2.0: 1.0}, interrupted=2.0), 0.9) == 1.0
    assert metrics.distserve_goodput(sweep({1.0: None}), 0.9) is None  # no SLO bounds: no attainment
