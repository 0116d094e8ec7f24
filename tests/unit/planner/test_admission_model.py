"""The router's admission in the simulator: what it sheds, by the same rules and arithmetic as
services/router/admission.py, and what that does to goodput above a split's capacity."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdserve.planner.admission_model import AdmissionModel
from pdserve.planner.plan import SLO, simulate
from pdserve.planner.shape import Shape
from pdserve.planner.simulator import Simulator
from pdserve.planner.workload import SimRequest, synthetic
from tests.unit.planner.synthetic import PERF, synthetic_profile

ONE_TO_ONE = Shape(prefill=1, decode=1)


def burst(n: int, tokens: int = 512) -> list[SimRequest]:
    return [SimRequest(0.0, tokens, 4) for _ in range(n)]


def test_a_queue_whose_predicted_wait_leaves_too_little_of_the_ttft_slo_sheds_the_next_prompt() -> None:
    """SLO 400 ms, a 512-token prompt's own cost ~108 ms: 0.8 x 292 ms = 233 ms of queue may lie ahead, so a burst
    of five gets three prompts in (0, 107 and 214 ms ahead) and sheds two (321 ms ahead)."""
    sim = Simulator(synthetic_profile(), ONE_TO_ONE, AdmissionModel(ttft_s=0.4))
    result = sim.run(burst(5))
    assert (result.shed, result.rejected, len(result.ttft_s)) == (2, 2, 3)
    assert max(result.ttft_s) == pytest.approx(3 * PERF.prefill_s(512), rel=0.05)  # the last admitted still fits


def test_the_queue_bound_sheds_only_behind_a_non_empty_queue() -> None:
    """A prompt larger than the bound still runs on an empty worker (an idle cluster serves every valid one)."""
    sim = Simulator(synthetic_profile(), ONE_TO_ONE, AdmissionModel(ttft_s=100.0, queue_bound_tokens=600))
    result = sim.run(burst(4, tokens=700))
    assert (result.shed, len(result.ttft_s)) == (3, 1)


def test_at_a_light_load_admission_sheds_nothing_and_changes_nothing() -> None:
    profile, slo = synthetic_profile(), SLO(ttft_ms=400, tpot_ms=40)
    workload = synthetic(1.0, 512, 32, 150, seed=3)
    plain = simulate(profile, ONE_TO_ONE, workload, 1.0, slo)
    admitted = simulate(profile, ONE_TO_ONE, workload, 1.0, slo, AdmissionModel(ttft_s=0.4))
    assert admitted.shed == 0 and admitted == plain


def test_above_capacity_admission_keeps_goodput_near_capacity_where_queues_would_collapse_it() -> None:
    """At over twice a prefill worker's capacity, without shedding every request queues behind all the earlier
    ones (TTFT grows to seconds over the trace, goodput collapses); with the router's shedding about the excess is
    shed, the admitted ones meet the SLO, and goodput stays close to what the worker can prefill."""
    profile, slo = synthetic_profile(), SLO(ttft_ms=400, tpot_ms=40)
    workload = synthetic(1.0, 512, 8, 400, seed=4)
    capacity = 1 / PERF.prefill_s(512)  # ~9.3 prompts/s
    plain = simulate(profile, ONE_TO_ONE, workload, 20.0, slo)
    shed = simulate(profile, ONE_TO_ONE, workload, 20.0, slo, AdmissionModel(ttft_s=0.4))
    assert plain.shed == 0 and plain.goodput < 0.05 * capacity and plain.ttft_ms[1] > 10 * slo.ttft_ms, plain
    assert 0.4 < shed.shed < 0.65, shed  # about what the worker cannot take
    assert shed.ttft_ms[2] <= slo.ttft_ms and shed.goodput > 0.8 * capacity, shed


def test_a_prompt_longer_than_the_default_slo_allows_waits_only_a_tenth_of_the_default() -> None:
    """As the router treats a request that set no SLO: never less than its own cost, so an idle worker serves it,
    plus a tenth of the default for waiting (0.8 * 40 ms with the headroom), so a busy cluster does not starve it."""
    admission = AdmissionModel(ttft_s=0.4)
    assert not admission.sheds(queued_tokens=0, queued_s=0.0, prompt_tokens=4096, own_s=1.0)
    assert not admission.sheds(queued_tokens=16, queued_s=0.03, prompt_tokens=4096, own_s=1.0)
    assert admission.sheds(queued_tokens=16, queued_s=0.034, prompt_tokens=4096, own_s=1.0)
    assert not admission.sheds(queued_tokens=16, queued_s=0.034, prompt_tokens=16, own_s=0.01)


def test_a_decode_worker_busy_with_streams_adds_its_step_to_the_predicted_wait() -> None:
    """As the router predicts it: the hand-off waits for the decode step in flight. Behind 1-second decode steps
    a second prompt cannot meet a 400 ms SLO even on an idle prefill worker, and is shed; behind the usual steps
    of a few milliseconds it is admitted."""
    requests = [SimRequest(0.0, 16, 20), SimRequest(0.5, 16, 2)]
    slow = synthetic_profile(perf=replace(PERF, decode_fixed_s=1.0))
    assert Simulator(slow, ONE_TO_ONE, AdmissionModel(ttft_s=0.4)).run(requests).shed == 1
    assert Simulator(synthetic_profile(), ONE_TO_ONE, AdmissionModel(ttft_s=0.4)).run(requests).shed == 0


def test_the_simulated_router_holds_a_loose_slo_to_its_first_token_bound_as_the_router_does() -> None:
    """SLO 120 s: a prompt behind 10 s of queue is admitted under the default 60 s bound, shed under a 5 s one."""
    assert not AdmissionModel(ttft_s=120.0).sheds(queued_tokens=1000, queued_s=10.0, prompt_tokens=100, own_s=0.1)
    assert AdmissionModel(ttft_s=120.0, first_token_s=5.0).sheds(1000, 10.0, 100, 0.1)


def test_the_simulated_router_prices_a_hand_off_at_its_configured_speed_not_the_profiles() -> None:
    """The router predicts a prompt's KV transfer at its `transfer_gbps` with no latency (predictor.py) and sheds
    on that prediction; the profile's measured transfer is what a simulated hand-off then takes, not what
    admission sees. Three 512-token prompts at once: the router at 1 GB/s admits them all, one assuming 1 MB/s
    (0.5 s a hand-off, over the 400 ms SLO's room) sheds those behind the first; a profile measuring a 5 s
    transfer sheds none the router would not."""
    requests = burst(3)
    assert Simulator(synthetic_profile(), ONE_TO_ONE, AdmissionModel(ttft_s=0.4)).run(requests).shed == 0
    slow_router = AdmissionModel(ttft_s=0.4, transfer_gbps=0.001)
    assert Simulator(synthetic_profile(), ONE_TO_ONE, slow_router).run(requests).shed == 2
    slow_transfer = replace(synthetic_profile(), transfer_gbps=0.001, transfer_latency_s=5.0)
    assert Simulator(slow_transfer, ONE_TO_ONE, AdmissionModel(ttft_s=0.4)).run(requests).shed == 0


def test_plans_admission_flags_are_the_simulated_routers() -> None:
    from pdserve.cli import _parser
    from pdserve.planner.commands import _admission

    flags = ["--slo-ttft-ms", "400", "--slo-tpot-ms", "50", "--slo-headroom", "0.5", "--first-token-timeout-s", "9"]
    args = _parser().parse_args(
        ["plan", "--profile", "p.json", "--workers", "4", *flags, "--router-transfer-gbps", "0.25"]
    )
    assert _admission(args) == AdmissionModel(0.4, 0.5, AdmissionModel(0.4).queue_bound_tokens, 9.0, 0.25)
