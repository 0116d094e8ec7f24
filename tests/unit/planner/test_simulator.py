"""The simulator against what queueing theory and the profile say it must give."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from pdserve.planner import serving_latency
from pdserve.planner.admission_model import AdmissionModel
from pdserve.planner.plan import SLO, simulate
from pdserve.planner.serving_latency import at
from pdserve.planner.shape import Shape
from pdserve.planner.simulator import Simulator
from pdserve.planner.workload import SimRequest, synthetic
from tests.unit.planner.synthetic import PERF, synthetic_profile


def test_a_lone_request_costs_its_prefill_its_transfer_and_its_decode_steps() -> None:
    """The first token reaches the caller once the decode worker has the KV, as the hand-off returns it."""
    profile = synthetic_profile()
    result = Simulator(profile, Shape(prefill=1, decode=1)).run([SimRequest(0.0, 256, 11)])
    assert result.ttft_s == [pytest.approx(PERF.prefill_s(256) + profile.transfer_s(256))]
    # each of the 10 decode steps reads the prompt and what it generated so far
    steps = [PERF.decode_step_s(1) + 1e-7 * (256 + k) for k in range(1, 11)]
    assert result.tpot_s == [pytest.approx(sum(steps) / 10)]


def test_utilisation_is_the_offered_load_below_saturation() -> None:
    """Utilisation law: busy share = rate x service time / servers, for prefill alone (no batching at low load)."""
    profile, rate, n = synthetic_profile(), 2.0, 400
    requests = synthetic(rate, 512, 8, n, seed=1).at_rate(rate)
    result = Simulator(profile, Shape(prefill=2, decode=1)).run(requests)
    offered = (n / result.span_s) * PERF.prefill_s(512) / 2
    assert result.prefill_busy == pytest.approx(offered, rel=0.1)
    assert 0 < result.prefill_busy < 1 and 0 < result.decode_busy < 1


def test_attainment_falls_as_rate_rises_and_goodput_saturates() -> None:
    profile, slo = synthetic_profile(), SLO(ttft_ms=400, tpot_ms=40)
    workload = synthetic(1.0, 512, 32, 150, seed=2)
    outcomes = [simulate(profile, Shape(prefill=1, decode=1), workload, r, slo) for r in (1, 4, 8, 12, 20)]
    attainment = [o.attainment for o in outcomes]
    assert attainment == sorted(attainment, reverse=True)
    assert attainment[0] > 0.95 and attainment[-1] < 0.5
    capacity = 1 / PERF.prefill_s(512)  # one prefill worker: ~8.8 prompts/s at most
    assert max(o.goodput for o in outcomes) <= capacity * 1.05


def test_kv_capacity_bounds_the_decode_batch() -> None:
    """Two sequences' KV fit; a third waits for one to finish, so its TPOT clock starts late."""
    profile = synthetic_profile(kv_capacity_tokens=2 * (100 + 50))
    requests = [SimRequest(0.0, 100, 50) for _ in range(3)]
    result = Simulator(profile, Shape(prefill=1, decode=1)).run(requests)
    assert result.rejected == 0
    assert max(result.tpot_s) > 1.5 * min(result.tpot_s)
    too_big = Simulator(profile, Shape(prefill=1, decode=1)).run([SimRequest(0.0, 400, 1)])
    assert too_big.rejected == 1


def test_colocated_prefill_slows_the_decodes_in_its_steps() -> None:
    """The interference disaggregation removes: long prompts arriving during a decode stretch its TPOT."""
    profile = synthetic_profile()
    requests = [SimRequest(0.0, 64, 200)] + [SimRequest(0.05 + 0.2 * i, 2048, 2) for i in range(5)]
    colocated = Simulator(profile, Shape(colocated=1)).run(requests)
    split = Simulator(profile, Shape(prefill=1, decode=1)).run(requests)
    assert colocated.tpot_s[0] > 1.5 * split.tpot_s[0]


def test_the_hand_off_never_waits_for_the_prefill_workers_next_step() -> None:
    """The first token's output names the blocks and their release is queued, not awaited: a prompt queued behind
    the first one starts its chunks at once, yet the first token comes as soon as the first prompt's KV is sent."""
    profile = synthetic_profile()
    requests = [SimRequest(0.0, 256, 2), SimRequest(0.001, 1024, 2)]
    result = Simulator(profile, Shape(prefill=1, decode=1)).run(requests)
    assert result.ttft_s[0] == pytest.approx(PERF.prefill_s(256) + profile.transfer_s(256))
    alone = Simulator(profile, Shape(prefill=1, decode=1)).run(requests[:1])
    assert result.ttft_s[0] == pytest.approx(alone.ttft_s[0])


def test_the_reserve_and_the_commit_wait_for_the_decode_steps_in_flight() -> None:
    """A decode step costs 1 s here. A request arriving during the first one is reserved at its end; its KV
    lands during the second, and is committed (its first token sent) at that one's end."""
    slow_decode = replace(PERF, decode_fixed_s=1.0)
    profile = synthetic_profile(perf=slow_decode)
    requests = [SimRequest(0.0, 16, 5), SimRequest(0.2, 16, 2)]
    result = Simulator(profile, Shape(prefill=1, decode=1)).run(requests)
    decoding_from = slow_decode.prefill_s(16) + profile.transfer_s(16)
    two_steps = 2 * slow_decode.decode_step_s(1)
    assert result.ttft_s[1] == pytest.approx(decoding_from + two_steps - 0.2, rel=1e-4)


def test_the_serving_latency_delays_every_first_token_but_holds_no_worker() -> None:
    profile, latency = synthetic_profile(), 0.05
    requests = synthetic(4.0, 512, 8, 60, seed=3).at_rate(4.0)
    base = Simulator(profile, Shape(prefill=1, decode=1)).run(requests)
    late = Simulator(replace(profile, serving_latency_s=latency), Shape(prefill=1, decode=1)).run(requests)
    assert late.ttft_s == pytest.approx([t + latency for t in base.ttft_s])
    assert late.tpot_s == pytest.approx(base.tpot_s)
    assert late.prefill_busy * late.span_s == pytest.approx(base.prefill_busy * base.span_s)


def test_each_request_draws_its_serving_latency_from_the_calibrations_spread() -> None:
    """Requests 1 s apart never queue: each TTFT is its service plus its serving latency. With the spread (p5 to p95
    2-38 ms, median 20 ms) the p90 sits about p90 - median above the median's prediction, the median about on it;
    the same trace gives the same draws every time, and without the spread every request gets the median."""
    spread = [0.002 * j for j in range(1, 20)]
    median = replace(synthetic_profile(), serving_latency_s=0.020, serving_latency_quantiles_s=[])
    drawn = replace(median, serving_latency_quantiles_s=spread)
    requests, shape = [SimRequest(float(i), 256, 4) for i in range(400)], Shape(prefill=1, decode=1)
    base = Simulator(synthetic_profile(), shape).run(requests).ttft_s
    flat = Simulator(median, shape).run(requests)
    assert flat.ttft_s == pytest.approx([t + 0.020 for t in base])
    first, again = (Simulator(drawn, shape).run(requests) for _ in range(2))
    assert first == again
    p50, p90 = np.percentile(first.ttft_s, [50, 90]) - np.percentile(flat.ttft_s, [50, 90])
    assert p50 == pytest.approx(0.0, abs=0.002) and p90 == pytest.approx(at(spread, 0.9) - 0.020, abs=0.002)
    assert first.tpot_s == pytest.approx(flat.tpot_s)


def test_the_draw_is_the_inverse_cdf_between_the_quantiles() -> None:
    """k cut points at 1/(k+1) ... k/(k+1), linear between them, the outermost beyond; the calibration's quantiles
    of its residuals are never below 0."""
    assert [at([0.01, 0.02, 0.04], u) for u in (0.0, 0.25, 0.375, 0.5, 0.75, 1.0)] == pytest.approx(
        [0.01, 0.01, 0.015, 0.02, 0.04, 0.04]
    )
    assert at([0.007], 0.9) == 0.007
    quantiles = serving_latency.spread([-0.004, *(0.001 * k for k in range(100))])
    assert len(quantiles) == 19 and quantiles[0] >= 0 and quantiles == sorted(quantiles)
    assert quantiles[9] == pytest.approx(0.049, abs=0.001) and quantiles[17] == pytest.approx(0.089, abs=0.001)


def test_a_later_chunk_pays_for_the_context_it_reads_and_every_step_for_the_engine() -> None:
    """A 1024-token prompt runs as two 512-token chunks; the second reads the first's 512 tokens back."""
    per_context, overhead = 2e-8, 0.003
    profile = synthetic_profile(prefill_per_context_token_s=per_context, step_overhead_s=overhead)
    result = Simulator(profile, Shape(colocated=1)).run([SimRequest(0.0, 1024, 1)])
    chunks = 2 * PERF.prefill_s(512) + per_context * 512 * 512
    assert result.ttft_s == [pytest.approx(chunks + 2 * overhead)]


def test_engines_sharing_too_few_cores_step_slower() -> None:
    """Three colocated workers with a thread each on two cores: the three steps share them, each at 2/3."""
    profile = synthetic_profile(shared_cores=2, meta={"threads": 1})
    requests = [SimRequest(0.0, 256, 1) for _ in range(3)]
    result = Simulator(profile, Shape(colocated=3)).run(requests)
    assert result.ttft_s == pytest.approx([1.5 * PERF.prefill_s(256)] * 3)
    own_cores = Simulator(replace(profile, shared_cores=0), Shape(colocated=3)).run(requests)
    assert own_cores.ttft_s == pytest.approx([PERF.prefill_s(256)] * 3)


def test_a_step_slows_while_another_shares_its_core_and_speeds_up_when_it_ends() -> None:
    """One core, two workers: the first step runs alone for half its work, then at half speed beside the
    second, which finishes its last half alone again (processor sharing, as the kernel shares a core)."""
    profile = synthetic_profile(shared_cores=1, meta={"threads": 1})
    step = PERF.prefill_s(256)
    result = Simulator(profile, Shape(colocated=2)).run([SimRequest(0.0, 256, 1), SimRequest(step / 2, 256, 1)])
    assert result.ttft_s == pytest.approx([1.5 * step, 1.5 * step])
    assert result.busy_s == pytest.approx(3 * step)  # each step's wall time, start to end


def test_the_serving_stacks_cpu_and_the_hosts_background_slow_the_steps_as_the_rate_rises() -> None:
    """On one core, a request's engine step shares it with the router's and client's work at the offered
    rate and with what else keeps the host busy."""
    requests = [SimRequest(float(i), 256, 1) for i in range(5)]  # 1 request/s, each alone on its worker
    step = PERF.prefill_s(256)
    base = synthetic_profile(shared_cores=1, meta={"threads": 1})
    serving = Simulator(replace(base, serving_cpu_s=0.5), Shape(colocated=1)).run(requests)
    assert serving.ttft_s == pytest.approx([1.5 * step] * 5)  # 0.5 cores of serving at 1 request/s
    busy_host = Simulator(replace(base, serving_cpu_s=0.5, background_cores=1.0), Shape(colocated=1)).run(requests)
    assert busy_host.ttft_s == pytest.approx([2.5 * step] * 5)


def test_the_workers_rpc_loops_lengthen_their_engines_steps() -> None:
    """Per prompt handed off on the prefill worker (once, with its last chunk); per token on the decode one."""
    per_prompt, per_token = 0.004, 0.001
    profile = synthetic_profile(prefill_loop_s=per_prompt, decode_loop_per_token_s=per_token)
    base = Simulator(synthetic_profile(), Shape(prefill=1, decode=1)).run([SimRequest(0.0, 1024, 11)])
    loops = Simulator(profile, Shape(prefill=1, decode=1)).run([SimRequest(0.0, 1024, 11)])
    assert loops.ttft_s[0] == pytest.approx(base.ttft_s[0] + per_prompt)
    assert loops.tpot_s[0] == pytest.approx(base.tpot_s[0] + per_token)


def test_prompts_arriving_during_a_decode_step_spread_over_the_prefill_workers() -> None:
    """In a split a prompt reaches its prefill worker only once the decode worker's step in flight ends, but the
    router counts it from its placement: two prompts arriving during that step go to the two prefill workers."""
    slow_decode = replace(PERF, decode_fixed_s=1.0)
    sim = Simulator(synthetic_profile(perf=slow_decode), Shape(prefill=2, decode=1))
    sim.run([SimRequest(0.0, 16, 5), SimRequest(0.2, 512, 2), SimRequest(0.201, 512, 2)])
    busy = [w.busy_s for w in sim.prefillers]
    assert busy == pytest.approx([slow_decode.prefill_s(16) + slow_decode.prefill_s(512), slow_decode.prefill_s(512)])


def test_a_prompt_counts_on_its_prefill_worker_until_its_first_token_is_out() -> None:
    """As the router's tracker counts it: a split's prefill ends a KV transfer (slow here) before its first
    token, so a prompt arriving meanwhile goes to the other prefill worker."""
    sim = Simulator(synthetic_profile(transfer_latency_s=0.5), Shape(prefill=2, decode=1))
    sim.run([SimRequest(0.0, 512, 2), SimRequest(0.2, 512, 2)])  # the first prefill ends at ~0.11 s
    assert [w.busy_s for w in sim.prefillers] == pytest.approx([PERF.prefill_s(512)] * 2)


def test_max_num_seqs_caps_what_a_colocated_engine_admits_counting_prompts_in_prefill() -> None:
    """The engine's scheduler admits a new prompt only while its sequences, those part-way through a chunked
    prefill too, are under `max_num_seqs`: with a cap of 2 the third prompt starts once the first finishes."""
    profile = synthetic_profile(max_num_seqs=2)
    result = Simulator(profile, Shape(colocated=1)).run([SimRequest(0.0, 1024, 50) for _ in range(3)])
    first_done = result.ttft_s[0] + 49 * result.tpot_s[0]
    assert result.ttft_s[1] < first_done < result.ttft_s[2]


def test_a_decode_worker_takes_no_hand_off_past_max_num_seqs_placed_on_it() -> None:
    """As the worker refuses a reservation past its cap (and the router sheds first): of five simultaneous
    requests, a cap of 2 serves two per decode worker and fails the rest; those served decode alike."""
    profile = synthetic_profile(max_num_seqs=2)
    requests = [SimRequest(0.0, 128, 50) for _ in range(5)]
    one = Simulator(profile, Shape(prefill=1, decode=1)).run(requests)
    assert (len(one.ttft_s), one.rejected, one.shed) == (2, 3, 0)
    assert max(one.tpot_s) < 1.1 * min(one.tpot_s)
    assert Simulator(profile, Shape(prefill=1, decode=2)).run(requests).rejected == 1
    routed = Simulator(profile, Shape(prefill=1, decode=1), AdmissionModel(ttft_s=100.0)).run(requests)
    assert (routed.rejected, routed.shed) == (3, 3)
