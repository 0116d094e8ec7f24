"""KV claims through admission and placement: a request refused for KV room past its TTFT SLO claims its blocks on
its decode worker, which smaller new requests then leave to it (services/router/kv_claims.py)."""

from __future__ import annotations

import asyncio

from pdserve.config import RouterConfig
from services.router.kv_claims import CLAIM_MIN_S
from tests.unit.router.router_builder import Router, prompt, replace_free, shed, worker


def starved(r: Router, tokens: list[int], clock: list[float]) -> None:
    """Refused for room, retried every 0.9 s past its 5 s TTFT SLO: it claims its blocks at the last refusal."""
    for _ in range(7):
        shed(r, tokens, "51 free KV blocks now$", slo_s=(5.0, 1.0))
        clock[0] += 0.9
    clock[0] -= 0.9


def test_a_request_refused_for_kv_room_claims_the_blocks_that_free_up_before_smaller_ones_take_them(clock):
    """The small requests that keep coming would otherwise take every block a large one waits for: refused past its
    TTFT SLO, it claims them. Until then they get in; once the large one's retry gets its blocks, the claim ends."""
    d0 = worker("d0", "decode", kv_blocks_free=40)
    r = Router([worker("p0"), d0])
    large, small = prompt(800), prompt(16)  # 51 blocks with 16 new tokens, 2 blocks
    shed(r, large, "51 free KV blocks now$", slo_s=(5.0, 1.0))
    assert r.admit(small, slo_s=(5.0, 1.0)).decode.worker_id == "d0"  # it may still get in within its SLO
    starved(r, large, clock)
    shed(r, small, "2 free KV blocks now that an earlier, larger request did not get", slo_s=(5.0, 1.0))
    shed(r, large, "51 free KV blocks now$", slo_s=(5.0, 1.0))  # its retry renews the claim
    r.registry.publish(replace_free(d0, 60))  # streams there ended
    assert r.admit(large, slo_s=(5.0, 1.0)).decode.worker_id == "d0"
    r.registry.publish(replace_free(d0, 9))  # what the large one left
    assert r.admit(small, slo_s=(5.0, 1.0)).decode.worker_id == "d0"  # the claim ended with its admission


def test_with_kv_claims_off_a_starved_request_claims_nothing(clock, tmp_path):
    """An operator who prefers small requests' latency to a bound on large ones' wait ([router] kv_claims = false)."""
    r = Router([worker("p0"), worker("d0", "decode", kv_blocks_free=40)], kv_claims=False)
    starved(r, prompt(800), clock)
    assert r.admit(prompt(16), slo_s=(5.0, 1.0)).decode.worker_id == "d0"
    (path := tmp_path / "router.toml").write_text("[router]\nkv_claims = false\n")
    assert RouterConfig.from_file(str(path)).kv_claims is False


def test_placement_takes_a_small_request_where_no_claim_holds_the_room_and_a_claim_lapses(clock):
    d0, d1 = worker("d0", "decode", kv_blocks_free=40), worker("d1", "decode", kv_blocks_free=3)
    r = Router([worker("p0"), d0, d1])
    large, small = prompt(800), prompt(16)
    starved(r, large, clock)  # placed on d0: the most free blocks
    assert r.admit(small, slo_s=(5.0, 1.0)).decode.worker_id == "d1"  # d0's 40 are claimed
    clock[0] += CLAIM_MIN_S * 100  # far past a few retry hints: the large one did not come back
    assert r.admit(small, slo_s=(5.0, 1.0)).decode.worker_id == "d0"


def test_no_claim_is_made_where_the_claimant_could_never_fit_nor_kept_once_it_was_served_elsewhere(clock):
    """A worker too small for the large request (it fits only on one draining for a rolling update) gets no claim
    that would shut small requests out for nothing; nor does one the claimant's retry was no longer placed on
    once it was served on another."""
    small_only = worker("d0", "decode", kv_blocks_total=40, kv_blocks_free=40)
    r = Router([worker("p0"), small_only, worker("d1", "decode", draining=True)])
    large, small = prompt(800), prompt(16)
    starved(r, large, clock)
    assert r.admit(small, slo_s=(5.0, 1.0)).decode.worker_id == "d0"
    d0, d1 = worker("d0", "decode", kv_blocks_free=40), worker("d1", "decode", kv_blocks_free=30)
    r = Router([worker("p0"), d0, d1])
    starved(r, large, clock)  # claims d0, the most free blocks
    r.registry.publish(replace_free(d1, 60))
    assert r.admit(large, slo_s=(5.0, 1.0)).decode.worker_id == "d1"
    r.registry.publish(replace_free(d1, 1))
    assert r.admit(small, slo_s=(5.0, 1.0)).decode.worker_id == "d0"


def test_a_claimant_placed_round_robin_holds_one_claim_and_retries_and_moves_never_wait_on_it(clock):
    decodes = [worker(f"d{i}", "decode", kv_blocks_free=40) for i in range(3)]
    r = Router([worker("p0"), *decodes], policy="round-robin")
    large, small = prompt(800), prompt(16)
    starved(r, large, clock)  # placed on d0, d1, d2 in turn: it claims where its SLO passed, d0
    for _ in range(3):
        shed(r, large, "51 free KV blocks now$", slo_s=(5.0, 1.0))
    assert [r.predictor.claims.held_from(w.worker_id, 2) for w in decodes] == [51, 0, 0]
    r = Router([worker("p0"), worker("d0", "decode", kv_blocks_free=42), worker("d1", "decode", kv_blocks_free=40)])
    starved(r, large, clock)  # claims d0: the most free blocks
    retry = asyncio.run(r.placement.place(small, 16, 1.0, must_hold=True))  # a retry's or a moving stream's
    assert (retry.decode.worker_id, r.place(small, 16, 1.0).decode.worker_id) == ("d0", "d1")


def test_a_colocated_worker_is_claimed_as_a_decode_worker_is(clock):
    c0, c1 = worker("c0", "colocated", kv_blocks_free=40), worker("c1", "colocated", kv_blocks_free=3)
    r = Router([c0, c1])
    large, small = prompt(800), prompt(16)
    starved(r, large, clock)
    assert r.admit(small, slo_s=(5.0, 1.0)).decode.worker_id == "c1"
