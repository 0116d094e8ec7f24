"""Per-key limits: requests per second (charged first, before the request's body is parsed: a key over its rate
costs the router no parse), tokens per minute (prompt + max_tokens, charged at admission, kept once the first
message is out) and concurrent streams. Over a limit is RESOURCE_EXHAUSTED with a retry hint, because waiting
fixes it; a request larger than its key's whole minute of tokens is INVALID_ARGUMENT, because no wait does, and so
is one asking for more choices (the HTTP API's `n`, each a request of its own) than the key lets in at once.

One interface, two stores: `LocalQuotas` keeps the limits in this router's memory (the embedded one-router
cluster, and the fallback of the other), `RedisQuotas` (redis_quotas.py) shares them between every router of a
cluster. A `QuotaSession` runs the same steps on either, so the errors are the same whichever store answered.
"""

from __future__ import annotations

import asyncio
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import TracebackType

from pdserve.errors import InvalidRequestError, OverloadedError, PermissionDeniedError, UnauthenticatedError
from pdserve.security.api_keys import Tenant

CONCURRENCY_RETRY_MS = 1000  # when a stream ends is unknown; a second is a short wait for a typical one
Release = Callable[[], None]  # gives back what a store took; never waits (a shared store's runs in the background)
# An admitted request ended by its caller (its hang-up, its deadline) or for its own fault (an output its constraint
# could not be held to, its key revoked), however late, keeps its tokens spent: no failure of the cluster's.
CALLERS_ENDS = (
    asyncio.CancelledError,
    GeneratorExit,
    TimeoutError,
    InvalidRequestError,
    UnauthenticatedError,
    PermissionDeniedError,
)


def _nothing() -> None:
    return None


def _once(release: Release) -> Release:
    """`release`, doing its work the first time only: a charge two parties may give back."""
    pending = [release]

    def give_back() -> None:
        if pending:
            pending.pop()()

    return give_back


@dataclass
class Choices:
    """The `n` choices of one request, each a request with a session of its own, started one after another (the
    HTTP API's `n`). They are n streams, n requests and n times the tokens at once, which the key's limits must all
    let in. The first choice charges the tokens of all n, so they get in together or not at all (a bucket that let
    in some and refused the next would leave the caller an error for tokens spent); a later one charges nothing.
    What an admitted choice was charged stays spent however the request ends, as any admitted request's does, but
    for a later choice shed before the caller got anything (`refund`, which its front end calls). A batch of
    prompts (the HTTP API's `prompt` as a list) has each prompt's n choices, n being all of them here: the first
    charges `tokens`, what its front end summed over every choice's prompt and max_tokens, as the prompts differ."""

    n: int = 1
    prompts: int = 1
    tokens: int = 0  # a batch's prompt plus max_tokens over all its choices (0: n times the first's)
    charged: bool = False  # the first choice has charged for all n
    refund: Release = _nothing  # gives the first choice's charge back (once, whoever calls it first)
    admitted: bool = False  # the first choice was admitted: the request is in, and a drain since lets the rest in
    # What ended the first choice to fail: the others, cancelled for it or never started, are counted as it is.
    failure: BaseException | None = None

    @property
    def param(self) -> str:
        """The request's parameter that asked for them all."""
        return "prompt" if self.prompts > 1 else "n"

    def __str__(self) -> str:
        each = f" ({self.prompts} prompts, n={self.n // self.prompts} each)" if self.prompts > 1 else ""
        return f"{self.n} choices{each}"


class Quotas(ABC):
    """Where the limits are counted. Each call takes what the request needs and returns how to give it back, or
    raises OverloadedError (nothing taken)."""

    def session(self, tenant: Tenant, choices: Choices | None = None) -> QuotaSession:
        return QuotaSession(self, tenant, choices or Choices())

    async def charge_request(self, tenant: Tenant) -> None:
        """One request of the key's requests_per_second, and of its tenant's where the key file limits the tenant."""
        for holder in tenant.holders:
            await self.take_request(holder)

    @abstractmethod
    async def take_request(self, tenant: Tenant) -> None:
        """One of the key's requests_per_second, never given back: whatever answers the request after this (its
        body not parsing, the key's streams or tokens, the cluster's load) answers a request the key made."""

    @abstractmethod
    async def open_stream(self, tenant: Tenant) -> Release:
        """One concurrent stream of `tenant`'s key. Taken once the request is parsed, not before as its request is:
        a slot is held until the handler that took it gives it back, and gRPC runs no handler for a call whose
        caller left before its message was in, whose slot would never come back."""

    @abstractmethod
    async def take_tokens(self, tenant: Tenant, tokens: int) -> Release:
        """`tokens` of the key's tokens_per_minute (a size the key's whole minute holds)."""

    @abstractmethod
    def keep_only(self, tenants: Iterable[Tenant]) -> None:
        """The keys a reload of --api-keys left, with their caps as they are now: a kept key's counters carry
        on (a reload must not give it a fresh burst, nor forget its open streams), a removed key's go."""

    @abstractmethod
    async def close(self) -> None:
        """Stops what the store runs in the background."""


class QuotaSession:
    """One request's hold on its key's limits, from its parse to the end of its stream (an async context manager:
    entering takes the stream, or raises OverloadedError); its request was taken before (`Quotas.take_request`)."""

    def __init__(self, quotas: Quotas, tenant: Tenant, choices: Choices) -> None:
        self.tenant = tenant
        self._quotas = quotas
        self._choices = choices
        self._stream: Release = _nothing
        self._tokens: Release = _nothing
        self._admitted = False
        self._delivered = False

    async def __aenter__(self) -> QuotaSession:
        for holder in self.tenant.holders:
            self._check_choices(holder)
        streams: list[Release] = []
        try:
            for holder in self.tenant.holders:  # the key's stream, then its tenant's
                streams.append(await self._quotas.open_stream(holder))
        except BaseException:
            _all(streams)()
            raise
        self._stream = _all(streams)
        return self

    def _check_choices(self, holder: Tenant) -> None:
        """More choices than the key's (or its tenant's) concurrent streams, or burst of requests, never all get in."""
        choices = self._choices
        n = choices.n
        if holder.max_concurrent and n > holder.max_concurrent:
            raise InvalidRequestError(
                choices.param, f"{choices} are {n} streams at once; {holder.who} allows {holder.max_concurrent}"
            )
        if holder.requests_per_second and n > request_bucket_size(holder):
            raise InvalidRequestError(
                choices.param,
                f"{choices} are {n} requests at once; {holder.who} allows a burst of "
                f"{request_bucket_size(holder):g} (requests_per_second {holder.requests_per_second:g})",
            )

    async def charge_tokens(self, tokens: int) -> None:
        """Prompt + max_tokens of the request against the key's tokens_per_minute, and its tenant's (for all its
        choices, by the first)."""
        holders = [h for h in self.tenant.holders if h.tokens_per_minute]
        if not holders or self._choices.charged:
            return
        choices = self._choices
        total = choices.tokens or tokens * choices.n
        for holder in holders:
            _check_tokens(holder, choices, tokens, total)
        taken: list[Release] = []
        try:
            for holder in holders:
                taken.append(await self._quotas.take_tokens(holder, total))
        except BaseException:
            _all(taken)()
            raise
        self._tokens = choices.refund = _once(_all(taken))
        self._choices.charged = True

    def admitted(self) -> None:
        """Called once the request is admitted: from then only the cluster's failure gives its tokens back."""
        self._admitted = self._choices.admitted = True

    @property
    def choices(self) -> Choices:
        """The request's choices (the HTTP API's n, for each prompt of a batch), each a request of its own."""
        return self._choices

    @property
    def later_choice(self) -> bool:
        """A later choice of a request whose first choice was admitted."""
        return self._choices.admitted

    def delivered(self) -> None:
        """Called with the first message its caller gets: its tokens stay spent however the stream ends."""
        self._delivered = True

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """The stream slot goes back. The tokens go back when the request was refused, or failed before its
        caller got a message (every worker it was placed on refused or lost it: a retry the caller was told could
        succeed must not find them spent), unless its caller ended it or it failed for the caller's own fault
        (CALLERS_ENDS): a non-streamed answer whose constraint failed after 4000 tokens got them all back, so a key
        could have the cluster generate without end within its tokens_per_minute."""
        self._stream()
        if exc is None or self._delivered:
            return
        if not self._admitted or not isinstance(exc, CALLERS_ENDS):
            self._tokens()


def _check_tokens(holder: Tenant, choices: Choices, tokens: int, total: int) -> None:
    """A request (or its choices together) past the holder's whole tokens_per_minute never gets in."""
    tpm = holder.tokens_per_minute
    if tokens > tpm:
        raise InvalidRequestError(
            "sampling.max_tokens",
            f"the prompt plus max_tokens is {tokens} tokens, more than {holder.who} allows in one request "
            f"(tokens_per_minute {tpm:g})",
        )
    if total > tpm:
        each = "" if choices.tokens else f" of {tokens} tokens"
        raise InvalidRequestError(
            choices.param,
            f"{choices}{each} (prompt plus max_tokens) are {total}, more than {holder.who} allows in a minute "
            f"(tokens_per_minute {tpm:g})",
        )


def _all(releases: list[Release]) -> Release:
    def release() -> None:
        for give_back in releases:
            give_back()

    return release


def too_many_streams(tenant: Tenant, open_streams: int) -> OverloadedError:
    return OverloadedError(
        f"{tenant.who} has {open_streams} streams open (max_concurrent {tenant.max_concurrent})",
        CONCURRENCY_RETRY_MS,
        reason="quota",
    )


def over_request_rate(tenant: Tenant, wait_s: float) -> OverloadedError:
    return OverloadedError(
        f"{tenant.who} is over its requests_per_second ({tenant.requests_per_second:g})",
        _ms(wait_s),
        reason="quota",
    )


def over_token_rate(tenant: Tenant, wait_s: float) -> OverloadedError:
    return OverloadedError(
        f"{tenant.who} is over its tokens_per_minute ({tenant.tokens_per_minute:g})",
        _ms(wait_s),
        reason="quota",
    )


def request_bucket_size(tenant: Tenant) -> float:
    """A key may send a burst of one second's requests (at least one) at once."""
    return max(1.0, tenant.requests_per_second)


@dataclass
class TokenBucket:
    """`rate` per second, holding at most `capacity`; a request takes `cost` or is told when it could."""

    rate: float
    capacity: float
    level: float = field(init=False)
    at: float = field(init=False)
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self.level, self.at = self.capacity, self.clock()

    def take(self, cost: float) -> float:
        """0 when taken, else the seconds until `cost` would be there (nothing taken)."""
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
        self.at = now
        if self.level >= cost:
            self.level -= cost
            return 0.0
        return (cost - self.level) / self.rate

    def give_back(self, cost: float) -> None:
        self.level = min(self.capacity, self.level + cost)

    def retune(self, rate: float, capacity: float) -> None:
        """New caps from now on: what it held until now was filled at the old rate."""
        self.take(0)
        self.rate, self.capacity = rate, capacity
        self.level = min(capacity, self.level)


class _KeyState:
    def __init__(self, tenant: Tenant, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.requests: TokenBucket | None = None
        self.tokens: TokenBucket | None = None
        self.retune(tenant)
        self.streams = 0

    def retune(self, tenant: Tenant) -> None:
        """The key's caps as `tenant` has them; a bucket it had keeps its level (a limit gone drops its bucket)."""
        rps, tpm = tenant.requests_per_second, tenant.tokens_per_minute
        self.requests = self._bucket(self.requests, rps, request_bucket_size(tenant))
        self.tokens = self._bucket(self.tokens, tpm / 60, tpm)

    def _bucket(self, bucket: TokenBucket | None, rate: float, capacity: float) -> TokenBucket | None:
        if rate <= 0:
            return None
        if bucket is None:
            return TokenBucket(rate, capacity, clock=self._clock)
        bucket.retune(rate, capacity)
        return bucket

    def close_stream(self) -> None:
        self.streams -= 1


class LocalQuotas(Quotas):
    """In this router's memory: with several routers, each enforces the limits on what it serves."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._states: dict[str, _KeyState] = {}  # by key name: a reload that changes a key's caps keeps its counts
        self._kept: set[str] | None = None  # the key names of the last reload (None: none yet, every key counts)

    def _state(self, tenant: Tenant) -> _KeyState:
        state = self._states.get(tenant.key_name)
        if state is None:
            state = _KeyState(tenant, self._clock)
            if self._kept is None or tenant.key_name in self._kept:  # a removed key's request in flight leaves none
                self._states[tenant.key_name] = state
        return state

    def keep_only(self, tenants: Iterable[Tenant]) -> None:
        """A stream still open on a removed key gives its slot back to that key's old state, which nothing holds."""
        by_name = {t.key_name: t for t in tenants}
        self._kept = set(by_name)
        for name in list(self._states):
            if name in by_name:
                self._states[name].retune(by_name[name])
            else:
                del self._states[name]

    async def take_request(self, tenant: Tenant) -> None:
        self.take_request_now(tenant)

    async def open_stream(self, tenant: Tenant) -> Release:
        return self.open_stream_now(tenant)

    async def take_tokens(self, tenant: Tenant, tokens: int) -> Release:
        return self.take_tokens_now(tenant, tokens)

    async def close(self) -> None:
        """Nothing runs in the background."""

    def take_request_now(self, tenant: Tenant) -> None:
        """As `take_request`, without a wait: what a shared store falls back on."""
        bucket = self._state(tenant).requests
        wait_s = bucket.take(1) if bucket else 0.0
        if wait_s:
            raise over_request_rate(tenant, wait_s)

    def open_stream_now(self, tenant: Tenant) -> Release:
        """As `open_stream`, without a wait: what a shared store falls back on."""
        state = self._state(tenant)
        if tenant.max_concurrent and state.streams >= tenant.max_concurrent:
            raise too_many_streams(tenant, state.streams)
        state.streams += 1
        return state.close_stream

    def count_stream(self, tenant: Tenant) -> Release:
        """A stream a shared store admitted, counted here too: a fallback to these limits then sees it."""
        state = self._state(tenant)
        state.streams += 1
        return state.close_stream

    def take_tokens_now(self, tenant: Tenant, tokens: int) -> Release:
        """As `take_tokens`, without a wait."""
        bucket = self._state(tenant).tokens
        if bucket is None:
            return _nothing
        wait_s = bucket.take(tokens)
        if wait_s:
            raise over_token_rate(tenant, wait_s)
        return lambda: bucket.give_back(tokens)


def _ms(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))
