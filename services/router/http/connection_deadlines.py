"""Deadlines on an HTTP connection that uvicorn does not keep: on each request's head, and on a stalled reader.

uvicorn's only timer on a connection is its keep-alive wait, armed after a response and cancelled by any byte that
arrives. A client that sends a request's head a byte at a time, or stops half-way (slowloris), holds its connection
and a file descriptor for ever, its API key never checked: enough of them exhaust the router process's descriptors,
and with them the gRPC listener beside this one. Here the head of every request must be in within a deadline from
the connection's start, or from the previous response's end; past it the connection is closed.

A client that stops reading a response (a stream's events) without hanging up fills the socket's buffers, and
uvicorn's next write waits for room for ever: its request holds its router slot (the in-flight limit a full router
sheds at), its key's stream lease and its span meanwhile. A connection whose reader takes none of the response
for a deadline once writes wait is ended (as nginx's send_timeout: a slow reader that takes some each time lives
on), which the request sees as its caller hanging up (it ends cancelled, everything given back).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections.abc import Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from pdserve.config import RouterConfig

log = logging.getLogger(__name__)

HEAD_TIMEOUT_S = 10.0  # as Go's common ReadHeaderTimeout; a real client sends its head in one write
# struct tcp_info (linux/tcp.h): tcpi_bytes_acked, a u64 after 120 bytes of older fields (Linux 4.1 and later)
_TCP_INFO_BYTES, _BYTES_ACKED_AT, _BYTES_ACKED = 256, 120, struct.Struct("Q")


class DeadlineProtocol(H11Protocol):
    head_timeout_s = HEAD_TIMEOUT_S
    write_stall_timeout_s = RouterConfig.reader_stall_timeout_s
    _head_deadline: asyncio.TimerHandle | None = None
    _write_deadline: asyncio.TimerHandle | None = None
    _taken = 0  # how much the reader had taken when the write deadline was armed (`_taken_so_far`)

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

    def pause_writing(self) -> None:
        """The transport's buffer is full: the reader has this long to take some of it."""
        super().pause_writing()
        if self._write_deadline is None:
            self._arm_write_deadline()

    def resume_writing(self) -> None:
        self._cancel_write_deadline()
        super().resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._cancel_write_deadline()
        super().connection_lost(exc)
        self.on_closed(self.client, self.server)

    @staticmethod
    def on_closed(client: object, server: object) -> None:
        """What else keeps state per connection forgets it (`ConnectionAge.forget`)."""

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

    def _arm_write_deadline(self) -> None:
        self._taken = self._taken_so_far()
        self._write_deadline = self.loop.call_later(self.write_stall_timeout_s, self._write_stalled)

    def _taken_so_far(self) -> int:
        """A count that grows as the reader takes the response: the bytes its TCP acknowledged (Linux's TCP_INFO),
        whatever buffers lie between (TLS's, the transports', the socket's: those the check can see stay still
        while hidden ones drain); elsewhere, the shrinking of the transport's buffer."""
        sock = self.transport.get_extra_info("socket")
        if sock is not None and hasattr(socket, "TCP_INFO"):
            with contextlib.suppress(OSError):
                info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
                if len(info) >= _BYTES_ACKED.size + _BYTES_ACKED_AT:
                    return int(_BYTES_ACKED.unpack_from(info, _BYTES_ACKED_AT)[0])
        return -self.transport.get_write_buffer_size()

    def _cancel_write_deadline(self) -> None:
        if self._write_deadline is not None:
            self._write_deadline.cancel()
            self._write_deadline = None

    def _write_stalled(self) -> None:
        if self._taken_so_far() > self._taken:  # it took some: a slow reader, not a gone one
            self._arm_write_deadline()
            return
        self._write_deadline = None
        log.warning(
            "closing the HTTP connection of %s: it took none of its response for %g s",
            self.client and self.client[0],
            self.write_stall_timeout_s,
        )
        self.transport.abort()  # close() would wait to flush what the reader never takes


def with_deadlines(
    head_timeout_s: float, write_stall_timeout_s: float, on_closed: Callable[[object, object], None] | None = None
) -> type[DeadlineProtocol]:
    """The protocol class with these deadlines, telling `on_closed` of each connection that closed."""
    attributes: dict[str, object] = {"head_timeout_s": head_timeout_s, "write_stall_timeout_s": write_stall_timeout_s}
    if on_closed is not None:
        attributes["on_closed"] = staticmethod(on_closed)
    return type("DeadlineProtocol", (DeadlineProtocol,), attributes)
