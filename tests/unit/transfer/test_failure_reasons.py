"""What `pdserve_kv_transfer_failures_total{reason}` says of each way a transfer fails, on either side."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.errors import AbandonedError, UnavailableError
from pdserve.metrics import KV_TRANSFER_FAILURE_REASONS
from pdserve.transfer.base import (
    LayoutMismatchError,
    PeerLostError,
    PeerSilentError,
    TransferCancelledError,
    TransferError,
    TransferTimeoutError,
)
from pdserve.transfer.failures import failure_reason


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (PeerLostError("decode side: peer lost"), "peer_gone"),
        (UnavailableError("prefill worker p0: Socket closed (UNAVAILABLE)"), "peer_gone"),  # its call, lost
        (AbandonedError("prefill worker p0: the router ended this attempt (UNAVAILABLE)"), "cancelled"),
        (TransferTimeoutError("timed out"), "timeout"),
        (PeerSilentError("decode side: not answering"), "timeout"),
        (TransferCancelledError("cancelled before any byte"), "cancelled"),
        (asyncio.CancelledError(), "cancelled"),  # the decode worker's caller left
        (TimeoutError("prefill worker p0: Deadline Exceeded"), "cancelled"),  # the caller's deadline, on its call
        (LayoutMismatchError("KV layout mismatch"), "error"),
        (TransferError("no recv is waiting for that tag"), "error"),
    ],
)
def test_each_failure_has_its_reason(error: BaseException, reason: str) -> None:
    assert failure_reason(error) == reason
    assert reason in KV_TRANSFER_FAILURE_REASONS
