"""Typed errors that cross layers; the gRPC edge maps each to one status code (rpc/errors.py)."""

from __future__ import annotations

# In a recorded message (InvalidRequestError.recorded), where its caller's answer quotes the request.
WITHHELD = "[in the caller's answer only: it quotes the request]"


class InvalidRequestError(ValueError):
    """Bad input from a caller; `field` names what is wrong. -> INVALID_ARGUMENT. `recorded`: the message as a log
    line or a span may keep it, for one that quotes what the request holds back to its caller (a regex's compile
    error shows the regex): a request's content leaves the router only in its own answer
    (docs/security.md#what-pdserve-records-of-a-request)."""

    def __init__(self, field: str, message: str, recorded: str | None = None) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.recorded_message = message if recorded is None else recorded

    @property
    def recorded(self) -> str:
        return f"{self.field}: {self.recorded_message}"


class OverloadedError(RuntimeError):
    """Shed: the request cannot be served in time now. -> RESOURCE_EXHAUSTED with a retry hint. `reason`: which
    refusal, as `pdserve_requests_rejected_total` counts it (pdserve.metrics.REJECTION_REASONS): the router's
    admission and quotas name theirs; one without (a worker's own, relayed as RESOURCE_EXHAUSTED) is `worker`."""

    def __init__(self, message: str, retry_after_ms: int = 1000, reason: str = "worker") -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms
        self.reason = reason


class UnavailableError(RuntimeError):
    """No worker can take the request (draining, none registered, a peer lost). -> UNAVAILABLE."""


class RouterDrainingError(UnavailableError):
    """A request a draining router refuses before admitting it: its caller's retry, on another replica, serves it
    (a rolling restart fails nothing)."""


class RouterStoppedError(RuntimeError):
    """A stream still open when its router stopped (its drain's grace ran out): the caller's retry, on another
    replica, starts it over. Not an UnavailableError, which a stream moves past: no worker failed it. ->
    UNAVAILABLE."""


class ClusterAuthError(UnavailableError):
    """A cluster peer refused this process's cluster credentials on an internal hop (its PDSERVE_CLUSTER_SECRET is
    another, as mid-rotation). The cluster's fault, never the caller's: the peer is unusable, as a lost one is
    (UNAVAILABLE: the request moves, the peer is ejected). Its text, which names the peer, is for the log; the
    router's client is told less."""


class KVMismatchError(UnavailableError):
    """A prefill worker refused a decode worker whose KV is not its own kind (other weights or block size): the pair
    was wrong, neither worker is at fault (a router's view older than a worker's restart onto new weights). ->
    UNAVAILABLE, marked as such on every hop, so the request moves without ejecting either worker."""


class AbandonedError(UnavailableError):
    """The router ended this attempt before its first token and told its prefill worker, which ended the hand-off
    (services/router/abandon.py). -> UNAVAILABLE, marked as such: a decode worker that was still waiting on it (a
    stopped one, resumed) counts its transfer `cancelled`, the request having ended first, not a lost peer."""


class InternalError(RuntimeError):
    """A cluster peer's own bug (an exception its handler did not expect, logged there under the error id its
    text names). Not a lost worker: the request would meet the same bug on the next one, so it neither moves nor
    ejects the peer. -> INTERNAL."""


class UnauthenticatedError(RuntimeError):
    """No credential, or one the server does not know. -> UNAUTHENTICATED."""


class MissingKeyError(UnauthenticatedError):
    """No API key at all: its text says how to send one over gRPC (metadata); the HTTP API says it in its own
    terms (the Authorization header)."""


class PermissionDeniedError(RuntimeError):
    """A known caller asked for more than it may; `field` names what. -> PERMISSION_DENIED."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
