"""One log line per Admin call, granted or refused: which call, whose key (its name, never the key), from where, how
it ended and what it asked. Drains, scales and status reads change or expose the whole cluster, and a refused call is
what a stolen or misused key looks like; without these lines neither could be traced to a key or a caller."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from pdserve.errors import InvalidRequestError, MissingKeyError, PermissionDeniedError, UnauthenticatedError
from pdserve.security.api_keys import Tenant

log = logging.getLogger(__name__)
MAX_ARGUMENT_CHARS = 200  # a long worker_ids list is cut: the line stays a line
REFUSALS = (UnauthenticatedError, PermissionDeniedError, InvalidRequestError)


class AdminCall:
    """One call's line; the handler names its caller once the key is known."""

    def __init__(self, call: str, peer: str, arguments: str) -> None:
        self.call, self.peer = call, peer
        self.arguments = arguments if len(arguments) <= MAX_ARGUMENT_CHARS else arguments[:MAX_ARGUMENT_CHARS] + "..."
        self.key, self.tenant = "", ""

    def caller(self, tenant: Tenant) -> Tenant:
        self.key, self.tenant = tenant.key_name or "(open cluster)", tenant.name
        return tenant


@contextmanager
def audited(call: str, context: grpc.aio.ServicerContext, arguments: str) -> Iterator[AdminCall]:
    """Logs the call as it ends: INFO granted, WARNING refused (no key, an unknown key, a right it lacks, bad
    arguments), failed or cancelled; the exception goes on to its caller as before."""
    entry = AdminCall(call, context.peer(), arguments)
    try:
        yield entry
    except BaseException as e:
        if isinstance(e, MissingKeyError):
            entry.key = "(none)"
        elif isinstance(e, UnauthenticatedError):
            entry.key = "(unknown key)"
        if isinstance(e, asyncio.CancelledError):
            outcome = "cancelled"
        else:
            outcome = f"{'refused' if isinstance(e, REFUSALS) else 'failed'}: {type(e).__name__}: {e}"
        _log(logging.WARNING, entry, outcome)
        raise
    _log(logging.INFO, entry, "granted")


def _log(level: int, entry: AdminCall, outcome: str) -> None:
    extra = {"admin_call": entry.call, "key_name": entry.key, "tenant": entry.tenant, "peer": entry.peer}
    log.log(
        level,
        "admin %s by key %s from %s: %s (%s)",
        entry.call,
        entry.key or "(none)",
        entry.peer,
        outcome,
        entry.arguments or "no arguments",
        extra=extra | {"admin_outcome": outcome.partition(":")[0], "arguments": entry.arguments},
    )
