"""The router's arithmetic on synthetic workers: perf model, predictions, placement, admission, SLO config."""

from __future__ import annotations

import math

import pytest

from pdserve.config import RouterConfig, SLOClass
from pdserve.engine.block_manager import prefix_hashes
from pdserve.errors import OverloadedError, UnavailableError
from pdserve.perf_model import PerfProfile, SpeedTracker
from pdserve.registry.base import WorkerState
from pdserve.registry.memory import InMemoryPrefixIndex, InMemoryRegistry
from services.router.admission import MAX_RETRY_MS, MIN_RETRY_MS, Admission
from services.router.load_tracker import LoadTracker
from services.router.placement import RoundRobinPlacement, SLOAwarePlacement
from services.router.predictor import Predictor

BS = 16
# 1 ms per prompt token, a 20 ms decode step plus 5 ms per sequence: round numbers to reason with.
PROFILE = PerfProfile(
    prefill_fixed_s=0.01,
    prefill_per_token_s=1e-3,
    prefill_per_token2_s=0.0,
    decode_fixed_s=0.02,
    decode_per_seq_s=0.005,
)


def worker(worker_id: str, role: str = "prefill", **fields: object) -> WorkerState:
    base: dict[str, object] = dict(
        address=f"{worker_id}.local:50051",
        block_size=BS,
        kv_blocks_total=4096,
        kv_blocks_free=4096,
        profile=PROFILE,
    )
    base.update(fields)
    return WorkerState(worker_id=worker_id, role=role, **base)  # type: ignore[arg-type]


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 30000 + 1 for i in range(n)]


class Router:
    """What the router wires together per process, on an in-memory registry."""

    def __init__(self, workers: list[WorkerState], policy: str = "slo", **config: object) -> None:
        self.config = RouterConfig(policy=policy, **config)  # type: ignore[arg-type]
        self.registry = InMemoryRegistry(ttl_s=600)
        for w in workers:
            self.registry.publish(w)
        self.index = InMemoryPrefixIndex()
        self.tracker = LoadTracker()
        self.predictor = Predictor(self.config, self.tracker)
        cls = SLOAwarePlacement if policy == "slo" else RoundRobinPlacement
        self.placement = cls(self.registry, self.index, self.predictor)
        self.admission = Admission(self.config, self.predictor)

    def admit(self, tokens: list[int], max_tokens: int = 16, priority: int = 0, slo_s: tuple[float, float] = (5, 1)):
        placed = self.placement.place(tokens, max_tokens, slo_s[1])
        self.admission.check(placed, len(tokens), priority, slo_s)
        return placed


# --- PerfProfile and SpeedTracker -----------------------------------------------------------------------------


def test_fit_recovers_exact_quadratic_prefill_and_linear_decode():
    truth = PerfProfile(0.004, 2.5e-4, 3e-7, 0.015, 0.0021)
    prefill = [(n, truth.prefill_s(n)) for n in (32, 128, 512)]
    decode = [(b, truth.decode_step_s(b)) for b in (1, 8, 32)]
    fitted = PerfProfile.fit(prefill, decode)
    for name, want in truth.to_dict().items():
        assert getattr(fitted, name) == pytest.approx(want, rel=1e-6, abs=1e-12), name


def test_fit_recovers_a_purely_linear_prefill_with_no_quadratic_term():
    truth = PerfProfile(0.002, 1e-4, 0.0, 0.01, 0.0)
    fitted = PerfProfile.fit(
        [(n, truth.prefill_s(n)) for n in (16, 64, 256, 1024)], [(b, truth.decode_step_s(b)) for b in (1, 4, 16)]
    )
    assert fitted.prefill_per_token_s == pytest.approx(1e-4, rel=1e-6)
    assert fitted.prefill_per_token2_s == pytest.approx(0.0, abs=1e-15)
    assert fitted.prefill_fixed_s == pytest.approx(0.002, rel=1e-6)
    assert fitted.decode_fixed_s == pytest.approx(0.01, rel=1e-6)
    assert fitted.decode_per_seq_s == pytest.approx(0.0, abs=1e-15)


@pytest.mark.parametrize(
    "prefill,decode",
    [
        ([(32, 0.05), (128, 0.04), (512, 0.03)], [(1, 0.01), (8, 0.009), (32, 0.008)]),  # faster with more work
        ([(32, 0.001), (128, 0.2), (512, 0.21)], [(1, 0.0), (8, 0.05), (32, 0.051)]),  # concave: a negative n^2
        ([(32, 0.0), (128, 0.0), (512, 0.0)], [(1, 0.0), (8, 0.0), (32, 0.0)]),  # all zero
    ],
)
def test_fit_never_yields_negative_coefficients_or_times(prefill, decode):
    fitted = PerfProfile.fit(prefill, decode)
    assert all(v >= 0 for v in fitted.to_dict().values()), fitted
    assert all(fitted.prefill_s(n) >= 0 for n in range(0, 4096, 7))
    assert all(fitted.decode_step_s(b) >= 0 for b in range(0, 128))


def test_fit_drops_a_negative_term_and_refits_the_rest():
    # Prefill time flat in tokens: the fit must keep the fixed part, not zero everything.
    fitted = PerfProfile.fit([(32, 0.05), (128, 0.05), (512, 0.05)], [(1, 0.02), (8, 0.02), (32, 0.02)])
    assert fitted.prefill_s(100) == pytest.approx(0.05, rel=1e-3)
    assert fitted.decode_step_s(4) == pytest.approx(0.02, rel=1e-3)


def test_profile_round_trips_through_a_dict():
    assert PerfProfile.from_dict(PROFILE.to_dict()) == PROFILE
    assert PerfProfile.from_dict({k: str(v) for k, v in PROFILE.to_dict().items()}) == PROFILE
    assert PROFILE.prefill_s(0) == 0.0


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


def test_speed_tracker_counts_both_phases_of_a_mixed_step_and_ignores_empty_ones():
    t = SpeedTracker(PROFILE, alpha=1.0)
    t.observe(64, 4, PROFILE.prefill_s(64) + PROFILE.decode_step_s(4))
    assert t.factor == pytest.approx(1.0)
    t.observe(0, 0, 5.0)  # nothing was predicted: nothing to learn
    assert t.factor == pytest.approx(1.0)
    t.observe(10, 0, 1e6)  # one pathological step moves it by a bounded amount
    assert t.factor == pytest.approx(4.0)


# --- Predictor -----------------------------------------------------------------------------------------------


def test_ttft_grows_with_the_reported_queue():
    pred = Predictor(RouterConfig(), LoadTracker())
    idle, busy = worker("p0"), worker("p1", queued_prefill_tokens=5000)
    assert pred.ttft_s(busy, 100, 0) == pytest.approx(pred.ttft_s(idle, 100, 0) + 5.0)
    slow = worker("p2", queued_prefill_tokens=5000, speed_factor=2.0)
    assert pred.ttft_s(slow, 100, 0) > pred.ttft_s(busy, 100, 0)


def test_ttft_grows_with_work_this_router_sent_but_the_heartbeat_does_not_show_yet():
    tracker = LoadTracker()
    pred = Predictor(RouterConfig(), tracker)
    w = worker("p0")
    before = pred.ttft_s(w, 100, 0)
    tracker.start("p0", "d0", tokens=3000, seconds=3.0, blocks=200)
    assert pred.ttft_s(w, 100, 0) == pytest.approx(before + 3.0)
    assert pred.queued_tokens(w) == 3000
    assert pred.ttft_s(worker("p1"), 100, 0) == pytest.approx(before)  # only the worker it went to
    tracker.prefilled("p0", "d0", tokens=3000, seconds=3.0, blocks=200)
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
    for _ in range(10):
        tracker.start("p0", "d1", tokens=10, seconds=0.01, blocks=1)
    assert pred.tpot_s(worker("d1", "decode")) == pytest.approx(PROFILE.decode_step_s(11))
    tracker.finished("d1")
    assert pred.tpot_s(worker("d1", "decode")) == pytest.approx(PROFILE.decode_step_s(10))


def test_free_blocks_subtract_blocks_about_to_be_reserved():
    tracker = LoadTracker()
    pred = Predictor(RouterConfig(), tracker)
    tracker.start("p0", "d0", tokens=100, seconds=0.1, blocks=90)
    assert pred.free_blocks(worker("d0", "decode", kv_blocks_free=100)) == 10
    tracker.prefilled("p0", "d0", tokens=100, seconds=0.1, blocks=90)
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
    placed = r.placement.place(prompt(100), 16, 1.0)
    assert placed.prefill is not None and placed.prefill.worker_id == "p2"
    assert placed.predicted_ttft_s == pytest.approx(r.predictor.ttft_s(placed.prefill, 100, 0))
    assert placed.cached_tokens == 0
    r.tracker.start("p2", "d0", tokens=2000, seconds=2.0, blocks=10)  # our own sends count too
    assert r.placement.place(prompt(100), 16, 1.0).prefill.worker_id == "p3"


def test_slo_placement_prefers_the_prefill_worker_holding_the_prompts_prefix():
    r = Router([worker("p0"), worker("p1", queued_prefill_tokens=200), worker("d0", "decode")])
    tokens = prompt(1024)
    first = r.placement.place(tokens, 16, 1.0)
    assert first.prefill.worker_id == "p0"  # less loaded, nobody has the prefix
    assert len(first.block_hashes) == (1024 - 1) // BS
    r.index.record("p1", first.block_hashes)  # what the router does after placing on p1
    second = r.placement.place(tokens, 16, 1.0)
    assert second.prefill.worker_id == "p1"
    assert second.cached_tokens == len(first.block_hashes) * BS
    assert second.predicted_ttft_s < first.predicted_ttft_s
    # A different prompt shares no leading block: back to the idle worker.
    assert r.placement.place(prompt(1024, seed=1), 16, 1.0).prefill.worker_id == "p0"


def test_slo_placement_ignores_a_prefix_hit_that_does_not_start_at_block_0():
    r = Router([worker("p0"), worker("p1", queued_prefill_tokens=200), worker("d0", "decode")])
    tokens = prompt(1024)
    hashes = prefix_hashes(tokens[:-1], BS)
    r.index.record("p1", hashes[1:])
    placed = r.placement.place(tokens, 16, 1.0)
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
    placed = r.placement.place(prompt(100), 16, tpot_slo_s=0.1)
    assert placed.blocks_needed == math.ceil((100 + 16) / BS)
    assert placed.decode.worker_id == "d2"
    assert placed.predicted_tpot_s == pytest.approx(PROFILE.decode_step_s(5))
    r.tracker.start("p0", "d2", tokens=100, seconds=0.1, blocks=750)  # d2's room is promised away
    assert r.placement.place(prompt(100), 16, tpot_slo_s=0.1).decode.worker_id == "d1"


def test_slo_placement_falls_back_to_the_fastest_roomy_decode_worker_when_none_meets_tpot():
    decodes = [
        worker("d0", "decode", kv_blocks_free=900, running=50),
        worker("d1", "decode", kv_blocks_free=100, running=20),
        worker("d2", "decode", kv_blocks_free=2, running=1),  # fastest, but no room
    ]
    r = Router([worker("p0"), *decodes])
    placed = r.placement.place(prompt(100), 16, tpot_slo_s=0.01)
    assert placed.decode.worker_id == "d1"
    assert placed.predicted_tpot_s > 0.01
    # With no room anywhere, the fastest of all.
    r2 = Router([worker("p0"), *(replace_free(w, 1) for w in decodes)])
    assert r2.placement.place(prompt(100), 16, tpot_slo_s=0.01).decode.worker_id == "d2"


def replace_free(w: WorkerState, free: int) -> WorkerState:
    return w.with_load({"kv_blocks_free": free})


def test_colocated_placement_uses_one_worker_for_both_phases_without_transfer():
    r = Router(
        [
            worker("c0", "colocated", queued_prefill_tokens=3000, kv_bytes_per_token=10**6),
            worker("c1", "colocated", kv_bytes_per_token=10**6),
            worker("p9"),  # a stray prefill worker: colocated mode ignores it
        ]
    )
    placed = r.placement.place(prompt(500), 16, 1.0)
    assert placed.prefill is None
    assert placed.decode.worker_id == "c1" and placed.prefill_worker.worker_id == "c1"
    assert placed.predicted_ttft_s == pytest.approx(PROFILE.prefill_s(500))


def test_placement_without_workers_of_both_roles_is_unavailable():
    with pytest.raises(UnavailableError):
        Router([worker("p0")]).placement.place(prompt(10), 4, 1.0)
    with pytest.raises(UnavailableError):
        Router([worker("d0", "decode")]).placement.place(prompt(10), 4, 1.0)


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
    chosen = [r.placement.place(prompt(50), 4, 1.0) for _ in range(6)]
    assert [p.prefill.worker_id for p in chosen] == ["p0", "p1", "p2", "p0", "p1", "p2"]
    assert [p.decode.worker_id for p in chosen] == ["d0", "d1", "d0", "d1", "d0", "d1"]


# --- Admission -----------------------------------------------------------------------------------------------


def shed(r: Router, tokens: list[int], match: str, **kw: object) -> OverloadedError:
    with pytest.raises(OverloadedError, match=match) as info:
        r.admit(tokens, **kw)  # type: ignore[arg-type]
    assert MIN_RETRY_MS <= info.value.retry_after_ms <= MAX_RETRY_MS
    assert 100 <= info.value.retry_after_ms <= 30_000
    return info.value


def test_admission_admits_when_every_prediction_fits():
    r = Router([worker("p0"), worker("d0", "decode")])
    placed = r.admit(prompt(100), slo_s=(1.0, 0.1))
    assert placed.prefill.worker_id == "p0" and placed.decode.worker_id == "d0"


def test_admission_sheds_when_predicted_ttft_exceeds_the_slo():
    r = Router([worker("p0", queued_prefill_tokens=8000), worker("d0", "decode")], max_queued_prefill_tokens=10**6)
    err = shed(r, prompt(100), "TTFT", slo_s=(1.0, 1.0))
    assert err.retry_after_ms >= 5000  # about how late it would be: 8.1 s predicted vs 1 s
    r.admit(prompt(100), slo_s=(10.0, 1.0))  # the same load meets a looser SLO


def test_admission_retry_hint_is_clamped():
    r = Router([worker("p0", queued_prefill_tokens=10**8), worker("d0", "decode")], max_queued_prefill_tokens=10**9)
    assert shed(r, prompt(100), "TTFT", slo_s=(1.0, 1.0)).retry_after_ms == MAX_RETRY_MS
    r2 = Router([worker("p0"), worker("d0", "decode")])
    assert shed(r2, prompt(100), "TTFT", slo_s=(0.105, 1.0)).retry_after_ms == MIN_RETRY_MS  # 5 ms late


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
    r.tracker.start("p0", "d0", tokens=750, seconds=0.75, blocks=50)
    shed(r, prompt(100), "queue full", slo_s=loose)
    r.admit(prompt(100), priority=1, slo_s=loose)


def test_admission_sheds_when_no_decode_worker_has_the_blocks():
    r = Router([worker("p0"), worker("d0", "decode", kv_blocks_free=7), worker("d1", "decode", kv_blocks_free=3)])
    shed(r, prompt(100), "free KV blocks", slo_s=(5.0, 1.0))  # 8 blocks needed
    r.admit(prompt(100), max_tokens=12, slo_s=(5.0, 1.0))  # 7 blocks fit


def test_admission_sheds_when_predicted_tpot_exceeds_the_slo():
    r = Router([worker("p0"), worker("d0", "decode", running=100), worker("d1", "decode", running=60)])
    shed(r, prompt(100), "TPOT", slo_s=(5.0, 0.1))
    r.admit(prompt(100), slo_s=(5.0, 0.5))  # d1: 20 + 5 * 61 ms = 325 ms


def test_admission_sheds_at_the_in_flight_limit():
    r = Router([worker("p0"), worker("d0", "decode")], max_in_flight=4)
    r.admission.in_flight = 3
    r.admit(prompt(10))
    r.admission.in_flight = 4
    shed(r, prompt(10), "in flight")
    r.admission.in_flight = 10
    shed(r, prompt(10), "in flight")


# --- RouterConfig --------------------------------------------------------------------------------------------


def test_slo_for_prefers_the_request_then_its_priority_class_then_the_default():
    cfg = RouterConfig(
        default_ttft_ms=5000,
        default_tpot_ms=500,
        slo_classes=(SLOClass(priority=5, ttft_ms=500, tpot_ms=50), SLOClass(priority=0, ttft_ms=2000, tpot_ms=200)),
    )
    assert cfg.slo_for(-1, 0, 0) == (5000, 500)  # below every class
    assert cfg.slo_for(0, 0, 0) == (2000, 200)
    assert cfg.slo_for(4, 0, 0) == (2000, 200)
    assert cfg.slo_for(5, 0, 0) == (500, 50)
    assert cfg.slo_for(9, 0, 0) == (500, 50)  # the highest class it reaches
    assert cfg.slo_for(9, 123, 0) == (123, 50)
    assert cfg.slo_for(0, 0, 7) == (2000, 7)
    assert cfg.slo_for(-3, 42, 4) == (42, 4)
    assert RouterConfig().slo_for(3, 0, 0) == (RouterConfig.default_ttft_ms, RouterConfig.default_tpot_ms)


def test_queue_bound_by_priority():
    cfg = RouterConfig(max_queued_prefill_tokens=10_000, low_priority_reserve=0.2)
    assert cfg.queue_bound(1) == 10_000
    assert cfg.queue_bound(0) == pytest.approx(8_000)
    assert cfg.queue_bound(-1) == pytest.approx(6_000)
    assert RouterConfig(low_priority_reserve=0.75).queue_bound(-1) == 0


def test_router_config_from_toml_file(tmp_path):
    path = tmp_path / "router.toml"
    path.write_text(
        """
[router]
default_ttft_ms = 1500
max_in_flight = 7
policy = "round-robin"

[[router.slo_classes]]
priority = 1
ttft_ms = 300
tpot_ms = 30

[[router.slo_classes]]
priority = 0
ttft_ms = 900.5
tpot_ms = 90

[other]
ignored = true
"""
    )
    cfg = RouterConfig.from_file(str(path), max_in_flight=None, transfer_gbps=10.0)
    assert cfg.default_ttft_ms == 1500 and cfg.default_tpot_ms == RouterConfig.default_tpot_ms
    assert cfg.max_in_flight == 7  # a None override leaves the file's value
    assert cfg.transfer_gbps == 10.0
    assert cfg.policy == "round-robin"
    assert cfg.slo_classes == (SLOClass(1, 300, 30), SLOClass(0, 900.5, 90))
    assert cfg.slo_for(0, 0, 0) == (900.5, 90) and cfg.slo_for(2, 0, 0) == (300, 30)
    assert RouterConfig.from_file(str(path), max_in_flight=3).max_in_flight == 3

    empty = tmp_path / "empty.toml"
    empty.write_text("")
    assert RouterConfig.from_file(str(empty)) == RouterConfig()

    bad = tmp_path / "bad.toml"
    bad.write_text('[router]\npolicy = "random"\n')
    with pytest.raises(ValueError, match="policy"):
        RouterConfig.from_file(str(bad))
