"""The embedded registry and prefix index: publish/remove/TTL, LRU bound, leading-block matches."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest

from pdserve.engine.cache_journal import PrefixCacheChanges
from pdserve.protocol.perf_profile import PerfProfile
from pdserve.protocol.prefix_hash import prefix_hashes
from pdserve.protocol.roles import Role
from pdserve.registry.base import WorkerState
from pdserve.registry.memory import InMemoryPrefixIndex, InMemoryRegistry

PROFILE = PerfProfile(0.01, 1e-3, 1e-8, 0.02, 0.005)


def state(worker_id: str, role: str = "prefill", **fields: object) -> WorkerState:
    return WorkerState(worker_id=worker_id, role=role, address=f"{worker_id}:1", **fields)  # type: ignore[arg-type]


def ids(workers: list[WorkerState]) -> list[str]:
    return sorted(w.worker_id for w in workers)


def test_publish_lists_workers_by_role_and_refreshes_in_place():
    reg = InMemoryRegistry(ttl_s=60)
    reg.publish(state("p0"))
    reg.publish(state("d0", "decode", running=1))
    reg.publish(state("c0", "colocated"))
    assert ids(reg.workers()) == ["c0", "d0", "p0"]
    assert ids(reg.workers("prefill")) == ["p0"]
    assert ids(reg.workers("decode")) == ["d0"]
    assert reg.workers("nothing") == []
    reg.publish(state("d0", "decode", running=7))
    (d0,) = reg.workers("decode")
    assert d0.running == 7


def test_remove_drops_a_worker_at_once_and_ignores_unknown_ids():
    reg = InMemoryRegistry(ttl_s=60)
    reg.publish(state("p0"))
    reg.publish(state("p1"))
    reg.remove("p0")
    reg.remove("never-there")
    assert ids(reg.workers()) == ["p1"]


def test_a_retired_worker_is_removed_and_listed_retired_until_its_id_publishes_again():
    reg = InMemoryRegistry(ttl_s=60)
    reg.publish(state("d0", "decode"))
    reg.publish(state("d1", "decode"))
    reg.retire("d1")
    assert ids(reg.workers()) == ["d0"]
    assert reg.retired() == {"d1"}
    reg.publish(state("d1", "decode"))  # the id handed out anew
    assert reg.retired() == set()


def test_a_worker_that_stops_publishing_expires_after_the_ttl():
    reg = InMemoryRegistry(ttl_s=0.15)
    beating = state("beating")
    reg.publish(state("quiet"))
    reg.publish(beating)
    assert ids(reg.workers()) == ["beating", "quiet"]
    deadline = time.monotonic() + 0.45
    while time.monotonic() < deadline:  # three TTLs of heartbeats from one worker only
        beating = replace(beating, running=beating.running + 1, updated_at=time.time())
        reg.publish(beating)
        time.sleep(0.03)
    assert ids(reg.workers()) == ["beating"]
    reg.publish(state("quiet"))  # a fresh heartbeat brings it back
    assert ids(reg.workers()) == ["beating", "quiet"]


def test_a_worker_is_live_for_the_ttl_from_when_it_was_heard_whatever_its_own_clock_says():
    """The supervisor hears workers on other Ray nodes: a worker's clock 30 s behind this one's (or ahead) says
    nothing of whether it is silent. Each is live for the TTL from its publish, on the registry's clock alone."""
    now = [100.0]
    reg = InMemoryRegistry(ttl_s=1.0, clock=lambda: now[0])
    reg.publish(state("behind", updated_at=time.time() - 30, load_at=time.time() - 30.2))
    reg.publish(state("ahead", updated_at=time.time() + 30))
    assert ids(reg.workers()) == ["ahead", "behind"]
    (behind,) = (w for w in reg.workers() if w.worker_id == "behind")
    assert behind.heard_at == 100.0 and behind.load_sampled_at == pytest.approx(99.8)  # its own clock's 0.2 s
    now[0] += 0.9
    reg.publish(state("ahead", updated_at=time.time() + 30))
    now[0] += 0.2
    assert ids(reg.workers()) == ["ahead"]  # "behind" silent past the TTL; "ahead" heard 0.2 s ago


def test_worker_state_json_round_trip_with_and_without_profile():
    w = state("w", "decode", profile=PROFILE, kv_blocks_free=12, speed_factor=1.25)
    assert WorkerState.from_json(w.to_json()) == w
    assert WorkerState.from_json(w.to_json().encode()) == w
    bare = state("b")
    assert WorkerState.from_json(bare.to_json()) == bare and bare.profile is None


def test_worker_state_json_from_a_newer_worker_ignores_fields_it_does_not_know():
    w = state("w", load_at=12.5)
    assert WorkerState.from_json(json.dumps(json.loads(w.to_json()) | {"added_in_a_later_release": 1})) == w


async def test_prefix_match_counts_leading_blocks_only():
    index = InMemoryPrefixIndex()
    hashes = prefix_hashes(list(range(160)), 16)  # 10 chained blocks
    index.record("a", hashes[:6])
    index.record("b", hashes[1:])  # everything but block 0: no hit at all
    index.record("c", [hashes[0], hashes[1], hashes[3]])  # a gap after block 1
    assert await index.match(["a", "b", "c", "nobody"], hashes) == {"a": 6, "b": 0, "c": 2, "nobody": 0}
    assert await index.match(["a"], hashes[:3]) == {"a": 3}
    assert await index.match(["a"], []) == {"a": 0}
    assert await index.match([], hashes) == {}
    other = prefix_hashes([999, *range(1, 160)], 16)  # first block differs: every chained key differs
    assert await index.match(["a", "c"], other) == {"a": 0, "c": 0}


async def test_prefix_index_is_an_lru_bounded_per_worker():
    index = InMemoryPrefixIndex(max_blocks_per_worker=4)
    a, b, c, d, e = (bytes([i]) * 16 for i in range(5))
    index.record("w", [a, b, c])  # a prompt's tail is older than its head: c, b, a
    index.record("w", [a])  # a used again
    index.record("w", [d, e])  # 5 blocks > 4: c, the oldest, goes
    assert await index.match(["w"], [a, b]) == {"w": 2}
    assert await index.match(["w"], [c]) == {"w": 0}
    assert await index.match(["w"], [d, e]) == {"w": 2}
    index.record("w", [c])  # evicts b, the oldest now
    assert await index.match(["w"], [b]) == {"w": 0}
    assert sum([(await index.match(["w"], [h]))["w"] for h in (a, b, c, d, e)]) == 4
    index.record("other", [a, b, c, d, e])  # bounded per worker, not shared
    assert await index.match(["w"], [a]) == {"w": 1}


async def test_a_workers_journal_removes_what_it_evicted_adds_what_it_keyed_and_a_whole_take_replaces_all():
    index = InMemoryPrefixIndex(max_blocks_per_worker=4)
    hashes = prefix_hashes(list(range(160)), 16)
    index.record("w", hashes[:6])  # what a router placed there (the LRU keeps 4: blocks 0-3, newest first)
    index.apply("w", PrefixCacheChanges(stored=[hashes[0], hashes[2], *hashes[6:8]], removed=[hashes[1]]))
    assert await index.match(["w"], hashes) == {"w": 1}  # block 1 evicted: a hit stops there, placed or not
    assert await index.match(["w"], hashes[6:]) == {"w": 2}  # keyed by the worker, never placed
    for i in range(10):  # placements of other prompts fill the LRU: the worker's own blocks stay
        index.record("w", prefix_hashes([1000 + i] * 64, 16))
    assert await index.match(["w"], hashes[6:]) == {"w": 2} and await index.match(["w"], hashes[2:3]) == {"w": 1}
    index.apply("w", PrefixCacheChanges(stored=hashes[:2], removed=[], whole=True))
    assert await index.match(["w"], hashes) == {"w": 2} and await index.match(["w"], hashes[6:]) == {"w": 0}
    assert await index.match(["w"], prefix_hashes([1009] * 64, 16)) == {"w": 0}  # a whole take drops placements


async def test_a_workers_new_process_replaces_its_predecessors_entry():
    index = InMemoryPrefixIndex()
    old, new, other = (WorkerState("p0", "prefill", "h:1", pid=pid).cache_key for pid in (10, 11, 12))
    index.record(old, [b"a" * 16])
    index.record(WorkerState("p01", "prefill", "h:2", pid=12).cache_key, [b"a" * 16])  # an id that starts alike
    index.record(new, [b"b" * 16])
    assert len(index._blocks) == 2 and old not in index._blocks  # nothing kept for a process that is gone
    assert await index.match([old, new, other], [b"a" * 16]) == {old: 0, new: 0, other: 0}


async def test_an_entry_nobody_recorded_into_for_its_ttl_goes():
    """A worker scaled away never records again under its id (ids are not reused): its entry goes after the TTL."""
    now = [0.0]
    index = InMemoryPrefixIndex(ttl_s=3600.0, clock=lambda: now[0])
    index.record("gone/1", [b"a" * 16])
    now[0] = 3000.0
    index.record("live/1", [b"a" * 16])
    now[0] = 3601.0
    index.record("live/1", [b"b" * 16])
    assert list(index._blocks) == ["live/1"]
    assert await index.match(["gone/1", "live/1"], [b"a" * 16]) == {"gone/1": 0, "live/1": 1}


def test_a_worker_past_its_ttl_is_dropped_when_another_publishes():
    now = [0.0]
    reg = InMemoryRegistry(ttl_s=60, clock=lambda: now[0])
    reg.publish(state("scaled-away"))
    now[0] += 61
    reg.publish(state("live"))
    assert list(reg._workers) == ["live"]  # not only hidden from views: gone


def test_desired_counts_are_replaced_whole_and_read_back_as_roles():
    reg = InMemoryRegistry()
    assert reg.desired_counts() == {}
    reg.set_desired_counts({"prefill": 2, "decode": 3})  # type: ignore[dict-item] (a role's string is accepted)
    assert reg.desired_counts() == {Role.PREFILL: 2, Role.DECODE: 3}
    reg.set_desired_counts({Role.COLOCATED: 4})
    assert reg.desired_counts() == {Role.COLOCATED: 4}


def test_merged_desired_counts_change_only_the_roles_given():
    reg = InMemoryRegistry()
    reg.set_desired_counts({Role.PREFILL: 1, Role.DECODE: 1})
    assert reg.merge_desired_counts({Role.PREFILL: 2})
    assert reg.merge_desired_counts({Role.DECODE: 3})  # a scale of the other role, as if at the same time
    assert reg.desired_counts() == {Role.PREFILL: 2, Role.DECODE: 3}


def test_a_merge_onto_no_counts_writes_nothing():
    reg = InMemoryRegistry()
    assert not reg.merge_desired_counts({Role.PREFILL: 2})
    assert reg.desired_counts() == {}
