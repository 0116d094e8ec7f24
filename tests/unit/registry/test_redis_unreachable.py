"""The Redis registry and prefix index against a Redis that never answers: a listener that accepts
connections and reads nothing, as a stopped or partitioned server looks. No call may wait past its budget."""

from __future__ import annotations

import logging
import math
import time

import pytest

from pdserve.cluster.router_process import registry_for
from pdserve.config import ClusterConfig, RouterConfig
from pdserve.registry.redis import RedisRegistry
from pdserve.registry.redis_prefix import RedisPrefixIndex
from pdserve.throttled_log import Throttled
from tests.redis_server import silent

pytestmark = pytest.mark.timeout(60)


silent_url = pytest.fixture(silent)


async def test_a_router_view_starts_empty_within_its_timeout_and_answers_without_io(silent_url):
    registry = RedisRegistry(silent_url, refresh_s=0.05, timeout_s=0.1)
    start = time.monotonic()
    await registry.start()
    try:
        assert time.monotonic() - start < 1.0, "start() waited on a Redis that never answers"
        assert not await registry.refresh()
        start = time.monotonic()
        for _ in range(1000):
            assert registry.workers() == [] and registry.workers("prefill") == []
        assert time.monotonic() - start < 5.0  # 2000 reads that asked Redis would wait 200 s at the least
    finally:
        await registry.close()


async def test_prefix_match_gives_no_hits_within_its_budget_and_then_skips_redis(silent_url, caplog):
    index = RedisPrefixIndex(silent_url, match_budget_s=0.05, record_timeout_s=0.2, retry_s=30, log_every_s=30)
    hashes = [b"a" * 16, b"b" * 16]
    with caplog.at_level(logging.WARNING, logger="pdserve.registry.redis_prefix"):
        start = time.monotonic()
        assert await index.match(["p0", "p1"], hashes) == {"p0": 0, "p1": 0}
        first = time.monotonic() - start
        start = time.monotonic()
        for _ in range(50):  # within retry_s: Redis is not asked again, so no request pays the budget
            assert await index.match(["p0"], hashes) == {"p0": 0}
        assert time.monotonic() - start < 1.25  # half of what 50 matches that each paid the budget would take
        start = time.monotonic()
        for i in range(10):
            index.record(f"p{i}", hashes)  # returns at once: the write runs in the background
        assert time.monotonic() - start < 1.0  # half of what ten writes that each waited their timeout would take
        await index.close()  # the writes end within record_timeout_s, failed
    assert first < 0.5, f"match took {first:.2f} s against a budget of 0.05 s"
    messages = [r.getMessage() for r in caplog.records]
    assert sum("placing without prefix hits" in m for m in messages) == 1
    assert sum("prefix index not updated" in m for m in messages) == 1  # ten failures, one line


async def test_pending_prefix_writes_are_bounded(silent_url):
    index = RedisPrefixIndex(silent_url, record_timeout_s=0.3, max_pending_writes=4)
    for i in range(20):
        index.record(f"p{i}", [b"x" * 16])
    assert len(index._writes) == 4
    await index.close()
    assert not index._writes


def test_throttled_warnings_say_how_many_were_held_back(caplog):
    throttled = Throttled(interval_s=0.2, logger=logging.getLogger("tests.throttled"))
    with caplog.at_level(logging.WARNING, logger="tests.throttled"):
        for _ in range(5):
            throttled.warning("lost %s", "x")
        time.sleep(0.25)
        throttled.warning("lost %s", "y")
    assert [r.getMessage() for r in caplog.records] == ["lost x", "lost y (and 4 more since the last report)"]


@pytest.mark.parametrize("name", ["registry_max_view_age_s", "prefix_match_budget_s", "quota_budget_s"])
def test_router_config_refuses_a_registry_limit_that_is_not_positive(name):
    zero_means_no_limit = name == "registry_max_view_age_s"
    for bad in (-1.0, math.nan) if zero_means_no_limit else (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match=name):
            RouterConfig(**{name: bad})
    assert getattr(RouterConfig(**{name: 2.5}), name) == 2.5


def test_by_default_a_router_keeps_its_last_registry_view_however_long_redis_is_out():
    """Dropping it after 15 s took every worker out of every router at once, alive or not (an HA review: a Redis
    pod rescheduled made the whole cluster UNAVAILABLE); the workers that fail a call are ejected one by one."""
    assert RouterConfig().registry_max_view_age_s == 0.0
    registry, _ = registry_for(ClusterConfig(redis_url="redis://127.0.0.1:1/0"))
    assert isinstance(registry, RedisRegistry) and registry.max_view_age_s == math.inf
    limited = ClusterConfig(redis_url="redis://127.0.0.1:1/0", router=RouterConfig(registry_max_view_age_s=30.0))
    assert registry_for(limited)[0].max_view_age_s == 30.0  # type: ignore[attr-defined]
