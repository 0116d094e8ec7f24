"""A deadline on each HTTP request's head (its request line and headers), which uvicorn does not keep.

uvicorn's only timer on a connection is its keep-alive wait, armed after a response and cancelled by any byte that
arrives. A client that sends a request's head a byte at a time, or stops half-way (slowloris), holds its connection
and a file descriptor for ever, its API key never checked: enough of them exhaust the router process's descriptors,
and with them the gRPC listener beside this one. Here the head of every request must be in within a deadline from
the connection's start, or from the previous response's end; past it the connection is closed.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_TIMEOUT_S = 10.0  # as Go's common ReadHeaderTimeout; a real client sends its head in one write


class HeadDeadlineProtocol(H11Protocol):
    head_timeout_s = HEAD_TIMEOUT_S
    _head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # the head is in (or the connection failed or closed)
            self._disarm()

    def on_response_complete(self) -> None:
        self._arm()  # first: the next request may be pipelined already, and its head handled within
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._head_deadline = self.loop.call_later(self.head_timeout_s, self._head_late)

    def _disarm(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_late(self) -> None:
        self._head_deadline = None
        if not self.transport.is_closing():
            self.transport.close()


def with_head_timeout(seconds: float) -> type[HeadDeadlineProtocol]:
    """The protocol class with another deadline (tests)."""
    return type("HeadDeadlineProtocol", (HeadDeadlineProtocol,), {"head_timeout_s": seconds})
