"""One channel per worker address, closed once it has carried no call for a while.

Workers come and go at new addresses (Ray restarts a worker on a new port, scaling adds and removes them), so a
router or decode worker that kept every channel it ever opened would hold one per address it ever called, for
its whole life. A channel with a call in flight is never closed (closing it would cancel the call); the next
call to a closed channel's address opens a new one.

A channel presents the internal certificate it was opened with for its whole life, and reconnects with it: gRPC
Python has no client credentials read again on renewal. So when the certificate's files change (cert-manager
renewing the Secret), every channel is retired: the next call opens a new one, which presents the new
certificate, and a retired channel closes once its calls in flight end. Kept, it would reconnect (a worker
restarted at its address, a connection aged out) with the old certificate, refused once it expired or its CA
was rotated out.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc

from pdserve.rpc.server import internal_channel
from pdserve.security.rotating_certificate import certificate_set
from pdserve.security.watched_files import WatchedFiles

log = logging.getLogger(__name__)

IDLE_CLOSE_S = 300.0  # far above a worker's gaps between calls under load, far below a cluster's lifetime

StubT = TypeVar("StubT")
CallT = TypeVar("CallT", bound=grpc.aio.Call)


@dataclass
class _Channel(Generic[StubT]):
    channel: grpc.aio.Channel
    stub: StubT
    calls: int
    idle_since: float
    retired: bool = False  # its certificate was renewed: it closes once its calls end


class ChannelPool(Generic[StubT]):
    """Stubs of one service by worker address, for the calls `call` starts."""

    def __init__(
        self,
        make_stub: Callable[[grpc.aio.Channel], StubT],
        interceptors: Sequence[Any] = (),
        idle_close_s: float = IDLE_CLOSE_S,
        clock: Callable[[], float] = time.monotonic,
        credential_files: WatchedFiles | None = None,
    ) -> None:
        """`credential_files`: the internal certificate, key and CA its channels present (credentials.py's
        `internal_tls_files`), or None without internal TLS."""
        self._make_stub = make_stub
        self._interceptors = interceptors
        self._idle_close_s = idle_close_s
        self._clock = clock
        self._channels: dict[str, _Channel[StubT]] = {}
        self._retired: list[_Channel[StubT]] = []  # with calls in flight
        self._closing: set[asyncio.Task[None]] = set()
        self._credential_files = credential_files

    def call(self, address: str, start: Callable[[StubT], CallT]) -> CallT:
        """The call `start` makes on the address's stub; the channel counts it until it ends."""
        self._retire_on_renewal()
        self._close_idle(keep=address)
        entry = self._channels.get(address)
        if entry is None:
            channel = internal_channel(address, self._interceptors)
            entry = self._channels[address] = _Channel(channel, self._make_stub(channel), 0, self._clock())
        call = start(entry.stub)
        entry.calls += 1
        call.add_done_callback(lambda _: self._ended(entry))  # at once for a call already over
        return call

    @property
    def addresses(self) -> list[str]:
        """The addresses with an open channel."""
        return list(self._channels)

    async def close(self) -> None:
        """Closes every channel (cancelling calls still in flight) and waits for those closing."""
        channels, self._channels = [*self._channels.values(), *self._retired], {}
        self._retired = []
        await asyncio.gather(*(entry.channel.close() for entry in channels), *self._closing)

    def _ended(self, entry: _Channel[StubT]) -> None:
        entry.calls -= 1
        entry.idle_since = self._clock()
        if entry.retired and entry.calls == 0 and entry in self._retired:
            self._retired.remove(entry)
            self._close_later(entry)

    def _retire_on_renewal(self) -> None:
        """Retires every channel once the certificate files changed to a usable set (one that does not load, a
        file half-written, keeps them: they still present the old one, which a new channel could not replace)."""
        change = self._credential_files.changed() if self._credential_files is not None else None
        if change is None or isinstance(change, OSError):
            return
        try:
            certificate_set(change)
        except (ssl.SSLError, ValueError) as e:
            log.error("internal TLS certificate changed, but not to a usable one (%s); channels keep the old one", e)
            return
        for entry in self._channels.values():
            entry.retired = True
            if entry.calls:
                self._retired.append(entry)
            else:
                self._close_later(entry)
        log.info("internal TLS certificate renewed: %d channels to peers reopen with it", len(self._channels))
        self._channels = {}

    def _close_later(self, entry: _Channel[StubT]) -> None:
        task = asyncio.get_running_loop().create_task(entry.channel.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _close_idle(self, keep: str) -> None:
        now = self._clock()
        for address, entry in list(self._channels.items()):
            if address != keep and entry.calls == 0 and now - entry.idle_since >= self._idle_close_s:
                del self._channels[address]
                self._close_later(entry)
