"""Per-key limits: requests per second, tokens per minute (prompt + max_tokens, charged at admission) and
concurrent streams. Over a limit is RESOURCE_EXHAUSTED with a retry hint, because waiting fixes it; a request
larger than its key's whole minute of tokens is INVALID_ARGUMENT, because no wait does.

All in-memory and per router: with several routers each enforces the limits on what it serves.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType

from pdserve.errors import InvalidRequestError, OverloadedError
from pdserve.security.api_keys import Tenant

CONCURRENCY_RETRY_MS = 1000  # when a stream ends is unknown; a second is a short wait for a typical one


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


class _KeyState:
    def __init__(self, tenant: Tenant, clock: Callable[[], float]) -> None:
        rps, tpm = tenant.requests_per_second, tenant.tokens_per_minute
        self.requests = TokenBucket(rps, max(1.0, rps), clock=clock) if rps > 0 else None
        self.tokens = TokenBucket(tpm / 60, tpm, clock=clock) if tpm > 0 else None
        self.streams = 0


class Quotas:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._states: dict[Tenant, _KeyState] = {}

    def session(self, tenant: Tenant) -> QuotaSession:
        """Takes one request and one concurrent stream of `tenant`'s key now, or raises OverloadedError."""
        state = self._states.get(tenant)
        if state is None:
            state = self._states[tenant] = _KeyState(tenant, self._clock)
        return QuotaSession(tenant, state)


class QuotaSession:
    """One request's hold on its key's limits, from arrival to the end of its stream (a context manager)."""

    def __init__(self, tenant: Tenant, state: _KeyState) -> None:
        self.tenant, self._state, self._tokens, self._admitted = tenant, state, 0, False
        if tenant.max_concurrent and state.streams >= tenant.max_concurrent:
            raise OverloadedError(
                f"API key {tenant.key_name!r} has {state.streams} streams open (max_concurrent "
                f"{tenant.max_concurrent})",
                CONCURRENCY_RETRY_MS,
            )
        wait_s = state.requests.take(1) if state.requests else 0.0
        if wait_s:
            raise OverloadedError(
                f"API key {tenant.key_name!r} is over its requests_per_second ({tenant.requests_per_second:g})",
                _ms(wait_s),
            )
        state.streams += 1

    def charge_tokens(self, tokens: int) -> None:
        """Prompt + max_tokens of the request against the key's tokens_per_minute."""
        bucket = self._state.tokens
        if bucket is None:
            return
        if tokens > bucket.capacity:
            raise InvalidRequestError(
                "sampling.max_tokens",
                f"the prompt plus max_tokens is {tokens} tokens, more than this API key's tokens_per_minute "
                f"({self.tenant.tokens_per_minute:g}) allows in one request",
            )
        wait_s = bucket.take(tokens)
        if wait_s:
            raise OverloadedError(
                f"API key {self.tenant.key_name!r} is over its tokens_per_minute ({self.tenant.tokens_per_minute:g})",
                _ms(wait_s),
            )
        self._tokens = tokens

    def __enter__(self) -> QuotaSession:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        """The stream slot goes back; tokens charged to a request that was never admitted go back too."""
        self._state.streams -= 1
        if self._state.tokens and exc is not None and not self._admitted:
            self._state.tokens.give_back(self._tokens)

    def admitted(self) -> None:
        """Called once the request is admitted: its tokens stay spent however the stream ends."""
        self._admitted = True


def _ms(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))
