"""While a rollout runs two builds, a request reaches only workers that serve it as asked: one needing a feature
(an output constraint) only workers that list it, and a prefill and a decode worker are paired only where their KV
transfer versions agree (a decode worker refuses a header of another version, losing every hand-off on the pair).
A worker too old to say lists no feature and speaks version 3."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.protocol.compatibility import KV_WIRE_VERSION, OUTPUT_CONSTRAINT, WORKER_FEATURES, needed_features
from pdserve.protocol.output_constraint import OutputConstraint
from pdserve.protocol.sampling import SamplingParams
from pdserve.registry.base import WorkerState
from services.router.placement import NoWorkersError, Placement, UnpairedError
from services.router.request import RoutedRequest
from tests.unit.router.router_builder import Router, prompt, worker

NEW = {"features": WORKER_FEATURES, "kv_wire_version": KV_WIRE_VERSION}
CONSTRAINED = SamplingParams(max_tokens=8, constraint=OutputConstraint("regex", "[0-9]+"))


def place(r: Router, needs: frozenset[str] = frozenset()) -> Placement:
    return asyncio.run(r.placement.place(prompt(40), 8, 1.0, needs))


def test_the_registry_entry_carries_them_and_an_old_one_reads_as_saying_nothing():
    state = worker("d0", "decode", **NEW)
    assert WorkerState.from_json(state.to_json()) == state
    old = worker("d1", "decode").to_json().replace(', "features": []', "").replace(', "kv_wire_version": 0', "")
    assert "features" not in old and "kv_wire_version" not in old
    assert (WorkerState.from_json(old).features, WorkerState.from_json(old).kv_wire_version) == ((), 0)


def test_a_request_needing_a_feature_goes_only_to_workers_that_list_it():
    assert needed_features(CONSTRAINED) == {OUTPUT_CONSTRAINT} and not needed_features(SamplingParams())
    r = Router([worker("p-old"), worker("p-new", **NEW), worker("d-old", "decode"), worker("d-new", "decode", **NEW)])
    for _ in range(4):
        placed = place(r, needed_features(CONSTRAINED))
        assert (placed.prefill_worker.worker_id, placed.decode.worker_id) == ("p-new", "d-new")
    old = Router([worker("p-old"), worker("d-new", "decode", **NEW)])
    with pytest.raises(NoWorkersError, match=f"no live worker honours {OUTPUT_CONSTRAINT} yet"):
        place(old, needed_features(CONSTRAINED))
    assert place(old).prefill_worker.worker_id == "p-old"  # a request needing nothing goes anywhere


def test_a_pair_agrees_on_its_kv_transfer_version():
    """A worker too old to say speaks 3, as every build did since the header's MAC: a 4 is never paired with it."""
    r = Router([worker("p-unsaid"), worker("d4", "decode", kv_wire_version=4), worker("d-unsaid", "decode")])
    assert {place(r).decode.worker_id for _ in range(4)} == {"d-unsaid"}
    r = Router([worker("p3", kv_wire_version=3), worker("d4", "decode", kv_wire_version=4)])
    with pytest.raises(UnpairedError, match="share weights, block size and KV transfer version"):
        place(r)
    r = Router([worker("p4", kv_wire_version=4), worker("d3", "decode"), worker("d4", "decode", kv_wire_version=4)])
    assert {place(r).decode.worker_id for _ in range(4)} == {"d4"}


def test_a_rollouts_two_versions_share_the_traffic_by_load():
    """Four old pairs and one new: each request goes to the group whose prefill worker answers first, not all of
    them to the one new pair."""

    def cluster(old_queued: int, new_queued: int) -> Router:
        old = [worker(f"p{i}", queued_prefill_tokens=old_queued) for i in range(4)]
        old += [worker(f"d{i}", "decode") for i in range(4)]
        new = [worker("p-new", kv_wire_version=4, queued_prefill_tokens=new_queued)]
        return Router([*old, *new, worker("d-new", "decode", kv_wire_version=4)])

    placed = place(cluster(old_queued=0, new_queued=20_000))
    assert placed.prefill_worker.worker_id != "p-new" and placed.decode.worker_id != "d-new"
    placed = place(cluster(old_queued=20_000, new_queued=0))
    assert (placed.prefill_worker.worker_id, placed.decode.worker_id) == ("p-new", "d-new")


def test_the_lifecycle_places_a_constrained_request_by_what_it_needs():
    r = Router([worker("p-new", **NEW), worker("d-old", "decode"), worker("d-new", "decode", **NEW)])
    request = RoutedRequest("r", prompt(40), CONSTRAINED, 0.0, 0.0, 0)
    placed, _ = asyncio.run(r.lifecycle().place(request))
    assert placed.decode.worker_id == "d-new"


def test_what_an_idle_cluster_offers_a_constrained_request_is_over_the_workers_that_serve_it():
    """An SLO below the offer is refused as never servable: a faster worker that would not serve the request as
    asked (an older build) must not make the offer look better than the cluster can do."""
    fast_old = worker("d-old", "decode", kv_blocks_total=10_000, kv_blocks_free=10_000)
    r = Router([worker("p-new", **NEW), fast_old, worker("d-new", "decode", **NEW)])
    assert place(r, needed_features(CONSTRAINED)).offer.kv_blocks == 4096  # d-new's, not d-old's 10,000
    assert place(r).offer.kv_blocks == 10_000
