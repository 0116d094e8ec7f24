"""What the idle cluster's offer is over once a worker leaves the registry (offered_workers.py): its last state,
in the role it last had, without the prefix cache it held."""

from __future__ import annotations

import pytest

from pdserve.errors import InvalidRequestError
from pdserve.protocol.prefix_hash import prefix_hashes
from pdserve.protocol.roles import Role
from pdserve.security.quotas import Choices
from services.router.admission import SLOTarget
from services.router.gone_workers import GONE_AFTER_S, GoneWorkers
from tests.unit.router.router_builder import BS, Router, prompt, shed, worker


def test_a_worker_is_offered_in_the_role_it_last_had():
    r = Router([worker("x", kv_blocks_total=9999), worker("d0", "decode")])
    assert [w.worker_id for w in r.placement.offered.workers(Role.PREFILL)] == ["x"]
    r.registry.publish(worker("x", "decode"))  # the same id, now a decode worker
    assert {w.worker_id for w in r.placement.offered.workers(Role.DECODE)} == {"d0", "x"}
    assert r.placement.offered.workers(Role.PREFILL) == []
    assert GoneWorkers(r.registry, [r.placement.offered]).sweep(now=GONE_AFTER_S) == set()  # still registered


def test_a_gone_workers_prefix_cache_is_not_offered():
    """Its restart starts with an empty cache: offered with the hits it had, an SLO only those hits meet was shed
    (a retry hint) while it was gone, then refused as never servable once it was back."""
    r = Router([worker("p0"), worker("p-gone"), worker("d0", "decode")])
    tokens = prompt(1024)
    r.index.record(worker("p-gone").cache_key, prefix_hashes(tokens[:-1], BS))
    assert r.admit(tokens, slo_s=(0.5, 1.0)).prefill.worker_id == "p-gone"  # the hits meet it
    r.registry.remove("p-gone")
    with pytest.raises(InvalidRequestError, match="slo.ttft_ms"):
        r.admit(tokens, slo_s=(0.5, 1.0))


def test_what_only_a_worker_gone_from_the_registry_serves_is_shed_until_it_is_forgotten_then_invalid():
    """A worker that died leaves the registry until its restart serves (its supervisor unlists it). A soak found n=2
    answered 400 (never) for the ~10 s of each such restart; the same request succeeded once it was back."""
    r = Router([worker("p0"), *(worker(f"d{i}", "decode", max_num_seqs=2) for i in range(2))])
    gone = GoneWorkers(r.registry, [r.placement.offered])
    slo = SLOTarget(5.0, 1.0)
    r.admission.check_feasible(r.place(prompt(100), 16, 1.0), 100, slo, choices=Choices(4))  # seen: both hold 2
    r.registry.publish(worker("d-small", "decode", kv_blocks_total=10, kv_blocks_free=10))
    r.admit(prompt(100), max_tokens=200, slo_s=(5.0, 1.0))  # 19 blocks: d0 or d1
    for worker_id in ("d0", "d1"):
        r.registry.remove(worker_id)
    assert gone.sweep(now=0.0) == set()
    r.admission.check_feasible(r.place(prompt(100), 16, 1.0), 100, slo, choices=Choices(4))
    shed(r, prompt(100), "free KV blocks", max_tokens=200, slo_s=(5.0, 1.0))
    assert gone.sweep(now=GONE_AFTER_S) == {"d0", "d1"}  # gone for good
    with pytest.raises(InvalidRequestError, match="hold 1 such requests") as info:
        r.admission.check_feasible(r.place(prompt(100), 16, 1.0), 100, slo, choices=Choices(4))
    assert info.value.field == "n"
    with pytest.raises(InvalidRequestError, match="10 in total"):
        r.admit(prompt(100), max_tokens=200, slo_s=(5.0, 1.0))


def test_what_only_a_retired_worker_served_is_invalid_at_once_and_its_id_counts_again_once_handed_out_anew():
    """A scale-down retires its worker's id: it will not come back, so what only it could serve is never servable
    from then on, not shed with a retry hint for the minutes a router remembers a gone worker."""
    r = Router(
        [worker("p0"), worker("d-big", "decode"), worker("d-small", "decode", kv_blocks_total=10, kv_blocks_free=10)]
    )
    r.admit(prompt(100), max_tokens=200, slo_s=(5.0, 1.0))  # 19 blocks: d-big only
    r.registry.retire("d-big")
    with pytest.raises(InvalidRequestError, match="10 in total"):
        r.admit(prompt(100), max_tokens=200, slo_s=(5.0, 1.0))
    r.registry.publish(worker("d-big", "decode"))  # the id handed out again: a new worker, then it dies
    r.registry.remove("d-big")
    shed(r, prompt(100), "free KV blocks", max_tokens=200, slo_s=(5.0, 1.0))
