"""Each in-flight request's outputs, carried from the engine thread to its caller's event loop.

The engine thread puts a step's outputs on the callers' asyncio queues, one wake-up per loop per step; a caller
that fell behind reads what waits merged into one output. A request id is a key here: a second caller with an id
in flight is refused, never handed the first one's outputs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from pdserve.errors import InvalidRequestError
from pdserve.protocol.outputs import RequestOutput


class DuplicateRequestError(InvalidRequestError):
    """Another caller's request with this id is in flight on this worker; that one keeps running."""

    def __init__(self, request_id: str) -> None:
        super().__init__("request_id", f"{request_id!r} is already in flight on this worker")


@dataclass(frozen=True)
class Stream:
    """One caller's outputs: the engine thread puts them on the caller's loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | Exception]

    async def outputs(self) -> AsyncGenerator[RequestOutput, None]:
        """The outputs up to the finished one, those already waiting merged into one: a caller that fell behind the
        engine (a slow client, a busy event loop) catches up with one message, not one per step it missed. An error
        put on the stream is raised after the outputs before it."""
        while True:
            item = await self.queue.get()
            while isinstance(item, RequestOutput) and not item.finished and not self.queue.empty():
                later = self.queue.get_nowait()
                if isinstance(later, Exception):
                    yield item
                    raise later
                item = item.followed_by(later)
            if isinstance(item, Exception):
                raise item
            yield item
            if item.finished:
                return


class OutputStreams:
    """Request id -> its caller's stream. Opened and forgotten on the callers' loops, read by the engine thread."""

    def __init__(self) -> None:
        self._by_id: dict[str, Stream] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def get(self, request_id: str) -> Stream | None:
        return self._by_id.get(request_id)

    def open(self, request_id: str) -> Stream:
        """On the caller's loop: the request's stream. An id already streaming belongs to another caller: never
        replaced (DuplicateRequestError)."""
        if request_id in self._by_id:
            raise DuplicateRequestError(request_id)
        stream = Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._by_id[request_id] = stream
        return stream

    def forget(self, request_id: str, stream: Stream) -> bool:
        """The id free again, if `stream` still holds it; False when another caller's does (or none)."""
        if self._by_id.get(request_id) is not stream:
            return False
        del self._by_id[request_id]
        return True

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """On the engine thread: one wake-up per event loop per step, not one per output: each costs the loop a
        self-pipe write and read, and a decode step has an output for every sequence in its batch."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Stream, RequestOutput | Exception]]] = {}
        for out in outputs:  # a failed request's stream ends with its error, raised after the outputs before it
            if (target := self.get(out.request_id)) is not None:
                by_loop.setdefault(target.loop, []).append((target, out if out.error is None else out.error))
        for loop, deliveries in by_loop.items():
            loop.call_soon_threadsafe(_put_all, deliveries)

    def fail_all(self, error: Exception) -> None:
        """On the dying engine thread: every stream ends with `error`."""
        for stream in list(self._by_id.values()):
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)


def _put_all(deliveries: list[tuple[Stream, RequestOutput | Exception]]) -> None:
    """On the streams' loop: one step's outputs, each to its caller."""
    for stream, out in deliveries:
        stream.queue.put_nowait(out)
