"""Deadlines on an HTTP connection that uvicorn does not keep: on each request's head, and on a stalled reader.

uvicorn's only timer on a connection is its keep-alive wait, armed after a response and cancelled by any byte that
arrives. A client that sends a request's head a byte at a time, or stops half-way (slowloris), holds its connection
and a file descriptor for ever, its API key never checked: enough of them exhaust the router process's descriptors,
and with them the gRPC listener beside this one. Here the head of every request must be in within a deadline from
the connection's start, or from the previous response's end; past it the connection is closed.

A client that stops reading a response (a stream's events) without hanging up fills the socket's buffers, and
uvicorn's next write waits for room for ever: its request holds its router slot (the in-flight limit a full router
sheds at), its key's stream lease and its span meanwhile. A connection whose buffered response does not shrink for
a deadline is ended (as nginx's send_timeout: a slow reader that takes some of it each time lives on), which the
request sees as its caller hanging up (it ends cancelled, everything given back).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import struct
import termios

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from pdserve.config import RouterConfig

log = logging.getLogger(__name__)

HEAD_TIMEOUT_S = 10.0  # as Go's common ReadHeaderTimeout; a real client sends its head in one write


class DeadlineProtocol(H11Protocol):
    head_timeout_s = HEAD_TIMEOUT_S
    write_stall_timeout_s = RouterConfig.reader_stall_timeout_s
    _head_deadline: asyncio.TimerHandle | None = None
    _write_deadline: asyncio.TimerHandle | None = None
    _buffered = 0  # what the transport held when the write deadline was armed

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
        self._buffered = self._untaken()
        self._write_deadline = self.loop.call_later(self.write_stall_timeout_s, self._write_stalled)

    def _untaken(self) -> int:
        """Bytes the reader has yet to take: the transport's buffer, and the socket's (Linux's TIOCOUTQ), which
        holds megabytes on a fast link and drains first: the transport's alone stays still meanwhile."""
        untaken = self.transport.get_write_buffer_size()
        sock = self.transport.get_extra_info("socket")
        if sock is not None and hasattr(termios, "TIOCOUTQ"):
            with contextlib.suppress(OSError):
                untaken += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, bytes(4)))[0]
        return untaken

    def _cancel_write_deadline(self) -> None:
        if self._write_deadline is not None:
            self._write_deadline.cancel()
            self._write_deadline = None

    def _write_stalled(self) -> None:
        if self._untaken() < self._buffered:  # it took some: a slow reader, not a gone one
            self._arm_write_deadline()
            return
        self._write_deadline = None
        log.warning(
            "closing the HTTP connection of %s: it took none of its response for %g s",
            self.client and self.client[0],
            self.write_stall_timeout_s,
        )
        self.transport.abort()  # close() would wait to flush what the reader never takes


def with_deadlines(head_timeout_s: float, write_stall_timeout_s: float) -> type[DeadlineProtocol]:
    """The protocol class with other deadlines (tests)."""
    deadlines = {"head_timeout_s": head_timeout_s, "write_stall_timeout_s": write_stall_timeout_s}
    return type("DeadlineProtocol", (DeadlineProtocol,), deadlines)
