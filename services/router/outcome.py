"""How a request ended, as `pdserve_requests_total{outcome}` labels it, and whom it served what (`Caller`).

`finished`; `rejected`: shed by admission or a quota, or refused by a draining router (the caller's retry, on
another replica, serves it: a rolling restart fails nothing); `invalid`, `unauthenticated`, `denied`: the
caller's own; `cancelled`: by the caller; `deadline_exceeded`: the caller's own deadline (gRPC's) passed first, an
answer to the caller as a cancel is, kept apart so that a dashboard tells callers whose deadlines are too short
for the cluster's latency from callers who gave up; `failed`: anything else (the router's first-token and stall
bounds included: a worker stuck past them is the cluster's failure, which the request moves off or fails with).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from opentelemetry.metrics import Meter

from pdserve.config import RouterConfig
from pdserve.errors import (
    InvalidRequestError,
    OverloadedError,
    PermissionDeniedError,
    RouterDrainingError,
    UnauthenticatedError,
)
from pdserve.metrics import RouterMetrics
from pdserve.security.api_keys import OPEN_TENANT, KeyTable, Tenant
from pdserve.v1 import generate_pb2 as pb
from services.router.slo_attainment import slo_labels

# Outcomes of the caller's own doing: no failure of the cluster's; the request's span carries the outcome as a mark.
CALLER_ENDED = ("cancelled", "deadline_exceeded")


def outcome_of(error: BaseException, deadline_passed: bool = False) -> str:
    """The label of a request that ended with `error`; `deadline_passed`: its caller's deadline had passed by then
    (gRPC ends a handler whose deadline passed as it ends one whose caller cancelled)."""
    if isinstance(error, UnauthenticatedError):
        return "unauthenticated"
    if isinstance(error, PermissionDeniedError):
        return "denied"
    if isinstance(error, InvalidRequestError):
        return "invalid"
    if isinstance(error, OverloadedError | RouterDrainingError):
        return "rejected"
    if isinstance(error, TimeoutError):  # a worker's DEADLINE_EXCEEDED: its call carries the caller's deadline
        return "deadline_exceeded"
    if isinstance(error, asyncio.CancelledError | GeneratorExit):
        return "deadline_exceeded" if deadline_passed else "cancelled"
    return "failed"


def rejection_reason(error: BaseException) -> str:
    """Why a request counted `rejected` was refused, of pdserve.metrics.REJECTION_REASONS."""
    if isinstance(error, RouterDrainingError):
        return "draining"
    return error.reason if isinstance(error, OverloadedError) else "worker"


def tenant_labels(keys: KeyTable | None) -> list[str]:
    """The `tenant` label values the router can count now: its key table's tenants and "" (a caller without a valid
    key), or an open cluster's one tenant."""
    if keys is None:
        return [OPEN_TENANT]
    return ["", *sorted({tenant.name for tenant in keys.tenants})]


def router_metrics(
    meter: Meter, keys: KeyTable | None, config: RouterConfig, in_flight: Mapping[str, int]
) -> RouterMetrics:
    """The router's metrics, each closed set of label values exported from 0: its tenants', its SLOs'."""
    return RouterMetrics(meter, tenant_labels(keys), in_flight, slo_labels(config))


def log_level(error: BaseException) -> int:
    """A request's failure is a WARNING (an SRE is paged on them) only when it is the cluster's: ended by its
    caller's own deadline or input, it is INFO."""
    return logging.WARNING if outcome_of(error) == "failed" else logging.INFO


@dataclass
class Caller:
    """Who sent the request being accounted for, once known (its label on the request metrics and log line), and
    what it was served: counted as it reaches the caller, whichever attempt made it."""

    metrics: RouterMetrics
    tenant: Tenant | None = None
    prompt_tokens: int = 0  # the caller's prompt, however long a moved attempt's is
    finish_reason: str = ""  # the last message's, once it was relayed
    served: bool = False  # a message reached the caller
    time_remaining: Callable[[], float | None] = lambda: None  # of the caller's deadline; None: it set none
    ended_by: BaseException | None = None  # the error its outcome was last judged by

    def outcome(self, error: BaseException) -> str:
        """`outcome_of` the error, knowing whether this caller's deadline had passed (gRPC says 0 s left then)."""
        left = self.time_remaining()
        self.ended_by = error
        return outcome_of(error, deadline_passed=left is not None and left <= 0)

    def ended(self, outcome: str, e2e_s: float) -> None:
        """Counts the request's end (`outcome`, as `outcome` judged it); a rejected one also by why."""
        self.metrics.ended(outcome, self.label, e2e_s, self.finish_reason)
        if outcome == "rejected" and self.ended_by is not None:
            self.metrics.rejected(rejection_reason(self.ended_by), self.label)

    @property
    def label(self) -> str:
        return self.tenant.name if self.tenant else ""  # "": not authenticated

    def relayed(self, msg: pb.GenerateResponse) -> None:
        """Counts the prompt with the first message, each token as it goes: a retry's or migration's own prompt
        and a failed attempt's lost tokens are the cluster's cost, not what the caller was served."""
        if not self.served:
            self.served = True
            self.metrics.prompt_tokens.add(self.prompt_tokens, {"tenant": self.label})
        if msg.token_ids:
            self.metrics.generation_tokens.add(len(msg.token_ids), {"tenant": self.label})
        if msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            self.finish_reason = pb.FinishReason.Name(msg.finish_reason).removeprefix("FINISH_REASON_").lower()
