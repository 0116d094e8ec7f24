"""The decode worker's stream after its first message: read as fast as it arrives, merged while the router is
behind, and bounded in silence (the stall bound).

**Read ahead, merged.** A router relays every token, and its cost is per message (most of it gRPC's own, per
read and per write). A background task reads the decode call into a queue as messages arrive, and the relay
takes what queued while it was busy as one message (tokens and text in order, the last one's finish and usage):
a loaded router writes fewer, not later, messages to its callers, and an idle one passes each on alone.

**The stall bound.** A SIGSTOPped or hung decode worker keeps its TCP connection open, so its stream neither
ends nor fails; gRPC keepalive notices only after its ping interval and timeout (about 15 s). Past
`stall_timeout_s` without a message after the first one, the router cancels the call and treats the stream as
broken: an UnavailableError naming only the decode worker, so the lifecycle ejects that worker and migrates the
request. The bound also covers the gap between the first token and the second, which holds the KV transfer: it
must exceed the longest transfer.
"""

from __future__ import annotations

import asyncio

import grpc

from pdserve.errors import UnavailableError
from pdserve.registry.base import WorkerState
from pdserve.v1 import generate_pb2 as pb


class StreamReader:
    """Reads `call` from now on (the caller read its first message itself: it goes out alone, at once)."""

    def __init__(self, call: grpc.aio.UnaryStreamCall, bound_s: float, decode: WorkerState) -> None:
        self._call = call
        self._bound_s = bound_s
        self._decode = decode
        self._queue: asyncio.Queue[object] = asyncio.Queue()  # messages, then EOF or the call's error
        self._held: object | None = None  # EOF or an error met while merging: the next read's answer
        self._task = asyncio.ensure_future(self._read_all())

    async def _read_all(self) -> None:
        try:
            while (msg := await self._call.read()) is not grpc.aio.EOF:
                self._queue.put_nowait(msg)
            self._queue.put_nowait(grpc.aio.EOF)
        except grpc.aio.AioRpcError as e:
            self._queue.put_nowait(e)

    async def read(self) -> object:
        """The next message (what queued meanwhile merged into it) or EOF; the call's AioRpcError; or
        UnavailableError once the bound passes without a message (the call is cancelled)."""
        item = self._held if self._held is not None else await self._next()
        self._held = None
        while isinstance(item, pb.GenerateResponse) and not item.finish_reason and not self._queue.empty():
            later = self._queue.get_nowait()
            if not isinstance(later, pb.GenerateResponse):
                self._held = later
                break
            _append(item, later)
        if isinstance(item, Exception):
            raise item
        return item

    async def _next(self) -> object:
        try:
            async with asyncio.timeout(self._bound_s):
                return await self._queue.get()
        except TimeoutError:
            self._call.cancel()
            d = self._decode
            raise UnavailableError(
                f"decode worker {d.worker_id} at {d.address} sent nothing for {self._bound_s:g} s mid-stream "
                "(the router's stall bound); the stream was cancelled there"
            ) from None

    def close(self) -> None:
        """Stops reading (the caller cancels the call)."""
        self._task.cancel()


def _append(msg: pb.GenerateResponse, later: pb.GenerateResponse) -> None:
    msg.token_ids.extend(later.token_ids)
    msg.text += later.text
    msg.finish_reason = later.finish_reason
    if later.HasField("usage"):
        msg.usage.CopyFrom(later.usage)
