"""How a request ended, as `pdserve_requests_total{outcome}` labels it.

`finished`; `rejected`: shed by admission or a quota, or refused by a draining router (the caller's retry, on
another replica, serves it: a rolling restart fails nothing); `invalid`, `unauthenticated`, `denied`: the
caller's own; `cancelled`: by the caller, or its deadline passed; `failed`: anything else.
"""

from __future__ import annotations

import asyncio
import logging

from pdserve.errors import (
    InvalidRequestError,
    OverloadedError,
    PermissionDeniedError,
    RouterDrainingError,
    UnauthenticatedError,
)


def outcome_of(error: BaseException) -> str:
    """The label of a request that ended with `error`."""
    if isinstance(error, UnauthenticatedError):
        return "unauthenticated"
    if isinstance(error, PermissionDeniedError):
        return "denied"
    if isinstance(error, InvalidRequestError):
        return "invalid"
    if isinstance(error, OverloadedError | RouterDrainingError):
        return "rejected"
    if isinstance(error, asyncio.CancelledError | GeneratorExit | TimeoutError):
        return "cancelled"
    return "failed"


def log_level(error: BaseException) -> int:
    """A request's failure is a WARNING (an SRE is paged on them) only when it is the cluster's: ended by its
    caller's own deadline or input, it is INFO."""
    return logging.WARNING if outcome_of(error) == "failed" else logging.INFO
