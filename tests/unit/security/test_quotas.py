"""Per-key limits in one router's memory, on a fake clock: a request over a rate waits as long as the hint says,
then passes."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.errors import InvalidRequestError, OverloadedError, UnavailableError
from pdserve.security.api_keys import Tenant
from pdserve.security.quotas import Choices, LocalQuotas
from tests.unit.hand_clock import HandClock


async def test_request_rate_refuses_with_a_hint_that_is_enough() -> None:
    clock = HandClock(0.0)
    quotas, t = LocalQuotas(clock), Tenant("a", "k", requests_per_second=2)
    for _ in range(2):
        await quotas.take_request(t)
    with pytest.raises(OverloadedError, match="requests_per_second") as caught:
        await quotas.take_request(t)
    assert caught.value.retry_after_ms == 500
    async with quotas.session(t):  # a stream is no request: it takes none of the rate
        pass
    clock.now += caught.value.retry_after_ms / 1000
    await quotas.take_request(t)


async def test_concurrency_counts_open_sessions_only() -> None:
    quotas, t = LocalQuotas(HandClock(0.0)), Tenant("a", "k", max_concurrent=1)
    async with quotas.session(t):
        with pytest.raises(OverloadedError, match="max_concurrent") as caught:
            async with quotas.session(t):
                pass
        assert caught.value.retry_after_ms == 1000
    async with quotas.session(t):  # the first one closed
        pass


async def test_tokens_per_minute_charges_admitted_requests_and_refunds_refused_ones() -> None:
    clock = HandClock(0.0)
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
    quotas, t = LocalQuotas(HandClock(0.0)), Tenant("anonymous")
    for _ in range(1000):
        await quotas.take_request(t)
        async with quotas.session(t) as s:
            await s.charge_tokens(10**9)


async def test_more_choices_than_a_key_lets_in_at_once_are_invalid_naming_n() -> None:
    """n choices are n streams, n requests and n times the tokens at once: past a limit no wait lifts, INVALID_ARGUMENT
    before anything is taken; at the limit, let in."""
    quotas = LocalQuotas(HandClock(0.0))
    for tenant, n in [
        (Tenant("a", "streams", max_concurrent=2), 3),
        (Tenant("a", "burst", requests_per_second=2), 3),  # a burst of one second's requests
        (Tenant("a", "slow", requests_per_second=0.5), 2),  # a burst of one
    ]:
        with pytest.raises(InvalidRequestError, match=f"^n: {n} choices") as caught:
            async with quotas.session(tenant, Choices(n)):
                pass
        assert caught.value.field == "n"
        async with quotas.session(tenant, Choices(n - 1)):  # nothing was taken by the refusal
            pass
    tokens = Tenant("a", "tokens", tokens_per_minute=600)
    with pytest.raises(InvalidRequestError, match="^n: 3 choices of 250 tokens") as caught:
        async with quotas.session(tokens, Choices(3)) as s:
            await s.charge_tokens(250)
    async with quotas.session(tokens, Choices(2)) as s:
        await s.charge_tokens(250)
        await s.charge_tokens(250)  # the other choice's
        s.admitted()


async def test_the_first_choice_charges_for_all_and_nothing_charged_comes_back_once_admitted() -> None:
    """n choices get the key's tokens together or not at all: the first charges n times its tokens, later ones
    nothing. Once admitted, the charge stays however the request ends: choices cancelled because another failed
    gave their tokens back, which let a caller make a choice fail on purpose (an id too long for the last choice,
    a refused third) and stream the others for free, round after round."""
    clock = HandClock(0.0)
    quotas, t = LocalQuotas(clock), Tenant("a", "k", tokens_per_minute=900)
    async with quotas.session(t) as other:  # another request of the key: 800 left
        await other.charge_tokens(100)
        other.admitted()
    with pytest.raises(OverloadedError, match="tokens"):  # 3 x 300 > 800: refused before any choice runs
        async with quotas.session(t, Choices(3)) as s:
            await s.charge_tokens(300)
    choices = Choices(2)
    for _ in range(2):  # the first charges 600, the second nothing: 200 left
        async with quotas.session(t, choices) as s:
            await s.charge_tokens(300)
            s.admitted()
    with pytest.raises(asyncio.CancelledError):  # admitted, then cancelled (another failed, or the caller left)
        async with quotas.session(t, Choices(2)) as s:
            await s.charge_tokens(100)
            s.admitted()
            raise asyncio.CancelledError
    with pytest.raises(OverloadedError, match="tokens"):  # nothing left: the cancelled pair kept its charge
        async with quotas.session(t) as s:
            await s.charge_tokens(1)


async def test_tokens_come_back_when_the_cluster_fails_a_request_before_its_first_message() -> None:
    """Every worker refused or lost it: the caller was told a retry may succeed (RESOURCE_EXHAUSTED, UNAVAILABLE),
    which its spent tokens would refuse. Once a message went out, or when the caller itself gave up, they stay."""
    quotas, t = LocalQuotas(HandClock(0.0)), Tenant("a", "k", tokens_per_minute=600)
    for failure in (OverloadedError("decode worker d0: its batch is full"), UnavailableError("lost")):
        with pytest.raises(type(failure)):
            async with quotas.session(t) as s:
                await s.charge_tokens(500)
                s.admitted()
                raise failure
    for caller_ended in (asyncio.CancelledError(), TimeoutError("deadline")):
        with pytest.raises(type(caller_ended)):
            async with quotas.session(t) as s:
                await s.charge_tokens(300)
                s.admitted()
                raise caller_ended
        with pytest.raises(OverloadedError, match="tokens"):  # its 300 stayed spent
            async with quotas.session(t) as s:
                await s.charge_tokens(400)
        quotas, t = LocalQuotas(HandClock(0.0)), Tenant("a", "k", tokens_per_minute=600)
    with pytest.raises(UnavailableError):
        async with quotas.session(t) as s:
            await s.charge_tokens(300)
            s.admitted()
            s.delivered()
            raise UnavailableError("lost after its first message")
    with pytest.raises(OverloadedError, match="tokens"):
        async with quotas.session(t) as s:
            await s.charge_tokens(400)


async def test_a_reload_keeps_a_kept_keys_counts_under_its_new_caps_and_forgets_a_removed_key() -> None:
    clock = HandClock(0.0)
    quotas = LocalQuotas(clock)
    kept, gone = (
        Tenant("a", "kept", requests_per_second=1, max_concurrent=1),
        Tenant("b", "gone", requests_per_second=1),
    )
    retuned = Tenant("a", "kept", requests_per_second=2, max_concurrent=2)
    await quotas.take_request(gone)
    await quotas.take_request(kept)
    async with quotas.session(kept):  # its burst spent and its one stream open across the reload
        quotas.keep_only([retuned])
        with pytest.raises(OverloadedError, match="requests_per_second"):
            await quotas.take_request(retuned)
        clock.now += 0.5  # the new rate refills one request in half a second; the open stream is one of two
        await quotas.take_request(retuned)
        async with quotas.session(retuned):
            pass
    quotas.keep_only([kept, gone])  # `gone` comes back: nothing of its spent burst was kept
    await quotas.take_request(gone)
