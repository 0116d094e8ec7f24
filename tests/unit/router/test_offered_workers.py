"""What the idle cluster's offer is over once a worker leaves the registry (offered_workers.py): its last state,
in the role it last had, without the prefix cache it held."""

from __future__ import annotations

import pytest

from pdserve.errors import InvalidRequestError
from pdserve.protocol.prefix_hash import prefix_hashes
from pdserve.protocol.roles import Role
from services.router.gone_workers import GONE_AFTER_S, GoneWorkers
from tests.unit.router.router_builder import BS, Router, prompt, worker


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
