"""KV claims keep the first refused request's place: a later one, larger or smaller, neither replaces nor renews it;
a claimant holds one claim however its retries are placed, and its admission anywhere ends it."""

from __future__ import annotations

from services.router import kv_claims
from services.router.kv_claims import CLAIM_MIN_S, Claim, KVClaims


def test_the_first_claim_holds_against_later_refusals_and_only_its_own_retry_renews_it(clock):
    claims = KVClaims()
    claims.claim("d0", 50, retry_after_s=0.1, after_s=0.0)
    claims.claim("d0", 80, retry_after_s=0.1, after_s=0.0)  # larger, but later
    assert claims.held_from("d0", 40) == 50 and claims.held_from("d0", 50) == claims.held_from("d0", 80) == 0
    clock[0] += CLAIM_MIN_S * 0.9
    claims.claim("d0", 80, retry_after_s=0.1, after_s=0.0)  # does not renew it
    clock[0] += CLAIM_MIN_S * 0.2
    assert claims.held_from("d0", 10) == 0  # lapsed
    claims.claim("d0", 80, retry_after_s=0.1, after_s=0.0)  # now the first
    clock[0] += CLAIM_MIN_S * 0.9
    claims.claim("d0", 80, retry_after_s=0.1, after_s=0.0)  # its retry
    clock[0] += CLAIM_MIN_S * 0.9
    assert claims.held_from("d0", 10) == 80


def test_a_claim_lasts_a_few_retry_hints_and_ends_with_the_claimants_admission_not_a_smaller_ones(clock):
    claims = KVClaims()
    claims.claim("d0", 50, retry_after_s=2.0, after_s=0.0)
    clock[0] += 2.0 * kv_claims.CLAIM_RETRY_HINTS - 0.1
    assert claims.held_from("d0", 10) == 50 and claims.held_from("d1", 10) == 0
    claims.admitted(10)
    assert claims.held_from("d0", 10) == 50
    claims.admitted(50)  # on whichever worker
    assert claims.held_from("d0", 10) == 0


def test_a_claimants_refusals_elsewhere_renew_its_one_claim_and_add_none(clock):
    claims = KVClaims()
    claims.claim("d0", 50, retry_after_s=0.1, after_s=0.0)
    clock[0] += CLAIM_MIN_S * 0.9
    claims.claim("d1", 50, retry_after_s=0.1, after_s=0.0)  # its retry, placed on d1 and refused there
    claims.claim("d2", 50, retry_after_s=0.1, after_s=0.0)
    assert [claims.held_from(w, 10) for w in ("d0", "d1", "d2")] == [50, 0, 0]
    clock[0] += CLAIM_MIN_S * 0.9
    assert claims.held_from("d0", 10) == 50  # renewed by the refusals on d1 and d2
    claims.claim("d1", 30, retry_after_s=0.1, after_s=0.0)  # another request's: a claim of its own, where none is
    assert claims.held_from("d1", 10) == 30


def test_a_request_claims_only_once_requests_its_size_were_refused_past_its_ttft_slo(clock):
    """A claim holds blocks back from every smaller request, so a request that may still get in within its SLO
    makes none; one refused past it does, and an admission of its size in between starts its wait afresh."""
    claims = KVClaims()
    for _ in range(4):  # retries 0.6 s apart, within a claim's lapse: 1.8 s in all
        claims.claim("d0", 50, retry_after_s=0.1, after_s=2.0)
        assert claims.held_from("d0", 10) == 0
        clock[0] += 0.6
    claims.claim("d0", 50, retry_after_s=0.1, after_s=2.0)  # 2.4 s since its first refusal
    assert claims.held_from("d0", 10) == 50
    claims.admitted(50)
    claims.claim("d0", 50, retry_after_s=0.1, after_s=2.0)
    assert claims.held_from("d0", 10) == 0
    clock[0] += CLAIM_MIN_S + 0.1  # it stopped retrying: its wait lapsed with it
    claims.claim("d0", 50, retry_after_s=0.1, after_s=2.0)
    clock[0] += 0.5
    claims.claim("d0", 50, retry_after_s=0.1, after_s=2.0)
    assert claims.held_from("d0", 10) == 0


def test_a_lone_routers_claims_keep_no_changes_for_a_shared_store(clock):
    """Only shared_claims.py takes them: a router without one would keep an id for every worker ever claimed."""
    claims = KVClaims()
    claims.claim("d0", 50, retry_after_s=0.1, after_s=0.0)
    claims.admitted(50)
    assert claims.take_changes() == {}
    claims.shared = True
    claims.claim("d0", 50, retry_after_s=0.1, after_s=0.0)
    assert claims.take_changes() == {"d0": Claim(50, clock[0] + CLAIM_MIN_S, clock[0])}


def refused(claims: KVClaims, clock: list[float], blocks: int, seconds: float, slo_s: float) -> None:
    """A request of `blocks` refused on d0 every 0.5 s (its retry hint) for `seconds`."""
    end = clock[0] + seconds
    while clock[0] < end:
        claims.claim("d0", blocks, retry_after_s=0.5, after_s=slo_s)
        clock[0] += 0.5
    claims.claim("d0", blocks, retry_after_s=0.5, after_s=slo_s)


def test_a_claimant_whose_claim_a_larger_admission_ended_claims_again_at_once(clock):
    """The soak review's starved request: a larger request got in and ended its claim, and it then waited out a new
    SLO before it could claim again, for as long as larger ones kept overtaking it (131 s, never served)."""
    claims = KVClaims()
    refused(claims, clock, 80, 5.0, slo_s=5.0)
    assert claims.held_from("d0", 10) == 80
    claims.admitted(120)  # a larger request's
    assert claims.held_from("d0", 10) == 0
    clock[0] += 0.5
    claims.claim("d0", 80, retry_after_s=0.5, after_s=5.0)  # its next refusal
    assert claims.held_from("d0", 10) == 80
    claims.admitted(80)  # its own admission: its place goes too
    clock[0] += 0.5
    claims.claim("d0", 80, retry_after_s=0.5, after_s=5.0)  # another request its size starts waiting
    assert claims.held_from("d0", 10) == 0


def test_the_claimant_refused_first_takes_the_worker_from_a_later_one(clock):
    """Starved requests get in in the order they came: a small one that passed its SLO under the overload and
    claimed first gives way to a large one refused before it (the soak review saw small claims shut large ones
    out)."""
    claims = KVClaims()
    claims.claim("d0", 80, retry_after_s=0.5, after_s=5.0)  # the large one, first refused at 1000
    holders = []
    for _ in range(11):  # then both, every 0.5 s: a small one with a 1 s SLO, first refused at 1000.5
        clock[0] += 0.5
        claims.claim("d0", 12, retry_after_s=0.5, after_s=1.0)
        claims.claim("d0", 80, retry_after_s=0.5, after_s=5.0)
        holders.append(claims.held_from("d0", 2))
    # The small one claims at 1001.5; the large one, past its SLO at 1005 and refused before it, takes the worker.
    assert holders == [0, 0, 12, 12, 12, 12, 12, 12, 12, 80, 80], holders
