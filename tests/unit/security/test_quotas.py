"""Per-key limits in one router's memory, on a fake clock: a request over a rate waits as long as the hint says,
then passes."""

from __future__ import annotations

import pytest

from pdserve.errors import InvalidRequestError, OverloadedError
from pdserve.security.api_keys import Tenant
from pdserve.security.quotas import LocalQuotas


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_request_rate_refuses_with_a_hint_that_is_enough() -> None:
    clock = Clock()
    quotas, t = LocalQuotas(clock), Tenant("a", "k", requests_per_second=2)
    for _ in range(2):
        async with quotas.session(t):
            pass
    with pytest.raises(OverloadedError) as caught:
        async with quotas.session(t):
            pass
    assert caught.value.retry_after_ms == 500
    clock.now += caught.value.retry_after_ms / 1000
    async with quotas.session(t):
        pass


async def test_concurrency_counts_open_sessions_only() -> None:
    quotas, t = LocalQuotas(Clock()), Tenant("a", "k", max_concurrent=1)
    async with quotas.session(t):
        with pytest.raises(OverloadedError, match="max_concurrent") as caught:
            async with quotas.session(t):
                pass
        assert caught.value.retry_after_ms == 1000
    async with quotas.session(t):  # the first one closed
        pass


async def test_tokens_per_minute_charges_admitted_requests_and_refunds_refused_ones() -> None:
    clock = Clock()
    quotas, t = LocalQuotas(clock), Tenant("a", "k", tokens_per_minute=600)
    with pytest.raises(InvalidRequestError, match="^sampling.max_tokens"):
        async with quotas.session(t) as s:
            await s.charge_tokens(601)  # more than a whole minute: no wait helps
    with pytest.raises(RuntimeError):
        async with quotas.session(t) as s:
            await s.charge_tokens(500)
            raise RuntimeError("shed by admission")  # never admitted: the tokens go back
    async with quotas.session(t) as s:
        await s.charge_tokens(500)
        s.admitted()
    with pytest.raises(OverloadedError) as caught:
        async with quotas.session(t) as s:
            await s.charge_tokens(200)
    assert caught.value.retry_after_ms == 10_000  # 100 tokens short at 10 a second
    clock.now += 10
    async with quotas.session(t) as s:
        await s.charge_tokens(200)


async def test_an_open_tenant_is_never_limited() -> None:
    quotas, t = LocalQuotas(Clock()), Tenant("anonymous")
    for _ in range(1000):
        async with quotas.session(t) as s:
            await s.charge_tokens(10**9)
