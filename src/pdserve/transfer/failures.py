"""Why a KV transfer failed, as `pdserve_kv_transfer_failures_total{reason}` labels it (pdserve.metrics)."""

from __future__ import annotations

import asyncio

from pdserve.errors import AbandonedError, UnavailableError
from pdserve.transfer.base import PeerLostError, TransferCancelledError, TransferTimeoutError


def failure_reason(error: BaseException) -> str:
    """`timeout`: not done within the transfer timeout (a silent peer's included); `peer_gone`: the other worker was
    lost (its process or pair; to a decode worker, the prefill worker's call failing, UNAVAILABLE); `cancelled`: the
    request ended first (its caller left, or its deadline passed); `error`: anything else (a layout mismatch, a send
    the decode side refused)."""
    if isinstance(error, TransferTimeoutError):
        return "timeout"
    if isinstance(error, AbandonedError):  # the router ended the attempt: a decode worker resumed from a stop reads it
        return "cancelled"
    if isinstance(error, PeerLostError | UnavailableError):
        return "peer_gone"
    if isinstance(error, TransferCancelledError | asyncio.CancelledError | TimeoutError):
        return "cancelled"
    return "error"
