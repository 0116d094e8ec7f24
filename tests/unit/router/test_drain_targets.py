"""Which workers `pdserve drain` reaches, and that no router places a request on a draining worker."""

from __future__ import annotations

import pytest

from pdserve.errors import InvalidRequestError
from pdserve.registry.memory import InMemoryRegistry
from services.router.drain import drain_targets
from tests.unit.router.router_builder import Router, prompt, worker


def registry() -> InMemoryRegistry:
    r = InMemoryRegistry(ttl_s=600)
    r.publish(worker("prefill-0", address="10.0.0.1:50061"))
    r.publish(worker("decode-0", "decode", address="10.0.0.1:50071"))
    r.publish(worker("decode-1", "decode", address="10.0.0.2:50061"))
    r.publish(worker("decode-2", "decode", address="[fd00::7]:50061"))  # an IPv6 pod's, as addresses join it
    return r


def test_by_id_or_by_host() -> None:
    assert [w.worker_id for w in drain_targets(registry(), ["decode-1", "decode-1"], "")] == ["decode-1"]
    assert sorted(w.worker_id for w in drain_targets(registry(), [], "10.0.0.1")) == ["decode-0", "prefill-0"]
    assert drain_targets(registry(), [], "10.0.0.9") == []  # nothing on that host: nothing to drain
    for host in ("fd00::7", "[fd00::7]"):  # a pod's $POD_IP, or the literal as an address writes it
        assert [w.worker_id for w in drain_targets(registry(), [], host)] == ["decode-2"]


@pytest.mark.parametrize(("ids", "host"), [(["decode-7"], ""), ([], ""), (["decode-0"], "10.0.0.1")])
def test_unknown_ids_or_not_exactly_one_selector_name_the_field(ids: list[str], host: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        drain_targets(registry(), ids, host)
    assert e.value.field == "worker_ids"


def test_placement_skips_draining_workers() -> None:
    router = Router([worker("p0"), worker("p1", draining=True), worker("d0", "decode"), worker("d1", "decode")])
    router.registry.publish(worker("d0", "decode", draining=True))
    for i in range(8):
        placed = router.place(prompt(64, seed=i), 16, 1.0)
        assert (placed.prefill_worker.worker_id, placed.decode.worker_id) == ("p0", "d1")
