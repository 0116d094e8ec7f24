"""The moment a send starts reading the prompt's KV blocks, before which its caller may call it off.

A send to a decode process that is stopped or hung waits for its turn on the pair, or for the pair's liveness
check, until its deadline (`--kv-transfer-timeout`). A prefill worker whose caller left meanwhile (its decode
worker cancelled the Prefill call, or stopped answering gRPC's keepalive pings) waited for the send thread before
it freed the blocks, so they stayed held for a request nobody waited for. Called off before that moment, the send
never reads them: the caller frees them at once, and the send raises TransferCancelledError once it gets there.
"""

from __future__ import annotations

import threading

from pdserve.transfer.base import TransferCancelledError


class SendStart:
    """One send's start; thread-safe. The send thread `begin`s once it is about to read the blocks; the caller's
    `call_off` before that wins."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._begun = False
        self._called_off = False

    def begin(self) -> None:
        """The send thread, before its transfer reads the blocks: TransferCancelledError when called off."""
        with self._lock:
            if self._called_off:
                raise TransferCancelledError("the send was called off before its transfer began")
            self._begun = True

    def call_off(self) -> bool:
        """The caller: True when the send will never read the blocks (it had not begun), False when its transfer
        is under way (it ends by its own deadline, and the blocks are in use until then)."""
        with self._lock:
            if not self._begun:
                self._called_off = True
            return self._called_off
