"""What the router's caller is told of a worker's failure: the workers by id, never by address.

A worker's status reaches the router with the workers' host:port in its text (`rpc/errors.error_from_rpc`),
which the router needs: an address is how it tells which of the two workers failed (`retry.blamed_worker`).
The caller, often another team's service or a tenant on the public HTTP API, gets the same message with each
address of the request's workers replaced by the worker's id, and any other host:port (a KV rendezvous store's,
which a transfer's failure names) by `<address>`; the router's log keeps the original.
"""

from __future__ import annotations

import re

from pdserve.errors import InvalidRequestError, OverloadedError, UnavailableError
from services.router.placement import Placement

# host:port with an IPv4, a bracketed IPv6 or a dotted host name: what a message may name besides the workers.
_ADDRESS = re.compile(
    r"(?<![\w.])(?:\d{1,3}(?:\.\d{1,3}){3}|\[[0-9A-Fa-f:.]+\]|localhost|[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+):\d{1,5}\b"
)


def for_the_caller(error: Exception, placement: Placement) -> Exception:
    """`error` with `placement`'s addresses replaced by worker ids, of the same type (an OverloadedError keeps its
    retry hint, an InvalidRequestError its field); `error` itself when its text names no address."""
    text = str(error)
    for worker in (placement.decode, placement.prefill):
        if worker is not None:
            # "decode worker d-1 at host:port" -> "decode worker d-1"; a bare address (as a decode worker names
            # the prefill worker it called) -> its id.
            # gRPC names a peer it could not reach as "ipv4:host:port": the scheme goes with the address.
            text = text.replace(f" at {worker.address}", "").replace(f"ipv4:{worker.address}", worker.address)
            text = text.replace(f"ipv6:{worker.address}", worker.address).replace(worker.address, worker.worker_id)
    text = _ADDRESS.sub("<address>", text)
    if text == str(error):
        return error
    if isinstance(error, InvalidRequestError):
        return InvalidRequestError(error.field, text.removeprefix(f"{error.field}: "), error.recorded_message)
    if isinstance(error, OverloadedError):
        return OverloadedError(text, error.retry_after_ms, error.reason)
    return type(error)(text)


def cut_mid_stream(error: Exception, sent: int) -> Exception:
    """An UnavailableError that ends a stream after `sent` tokens reached the caller says so: the same code ends a
    stream that never started, and a caller retrying on UNAVAILABLE would start the output over, not continue it."""
    if not sent or not isinstance(error, UnavailableError):
        return error
    return type(error)(f"{error}; the stream ended after {sent} tokens, its output partial (a retry starts over)")
