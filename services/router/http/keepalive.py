"""An SSE stream that goes silent sends a comment now and then, so the proxies and load balancers in front of the
router do not take it for dead: their idle timers (nginx's `proxy_read_timeout`, an AWS ALB's idle timeout: 60 s
by default) cut a connection that carried no byte for that long. A stream goes silent while its decode worker has
preempted it and waits for room, or while it moves to another worker; clients skip comments (the SSE spec). Before
its first event too: a request may wait for its first token up to the first-token bound (60 s) per attempt, so a
stream whose first event takes `interval_s` starts then (its status, 200, and a comment), and a refusal after that
can only be an error event."""

from __future__ import annotations

import asyncio
from contextlib import suppress
from types import TracebackType

from starlette.types import Message, Send

KEEPALIVE_EVENT = b": keep-alive\n\n"


class KeptAliveBody:
    """Sends a response's start (`status`, `headers`) with its first body part, or from a task of its own with
    KEEPALIVE_EVENT when no part came for `interval_s`, and a comment whenever none went for `interval_s` after.
    A lock keeps the two from sending at once. After leaving the context the beat has stopped: `started` says
    whether the start went (the caller sends the last part, or an error response in its place)."""

    def __init__(self, send: Send, interval_s: float, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self._send, self._interval_s = send, interval_s
        self._start: Message = {"type": "http.response.start", "status": status, "headers": headers}
        self.started = False
        self._lock = asyncio.Lock()
        self._loop = asyncio.get_running_loop()
        self._last = self._loop.time()
        self._beat: asyncio.Task[None] | None = None

    async def __aenter__(self) -> KeptAliveBody:
        self._beat = asyncio.ensure_future(self._keep_alive())
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._beat is not None
        self._beat.cancel()
        with suppress(asyncio.CancelledError):  # in a cancelled scope this returns at once; the beat ends anyway
            await self._beat

    async def send(self, body: bytes) -> None:
        async with self._lock:
            await self._send_now(body)

    async def _send_now(self, body: bytes) -> None:
        if not self.started:
            await self._send(self._start)
            self.started = True
        await self._send({"type": "http.response.body", "body": body, "more_body": True})
        self._last = self._loop.time()

    async def _keep_alive(self) -> None:
        try:
            while True:
                await asyncio.sleep(self._last + self._interval_s - self._loop.time())
                async with self._lock:  # an event may have gone while it waited for the lock
                    if self._loop.time() - self._last >= self._interval_s:
                        await self._send_now(KEEPALIVE_EVENT)
        except OSError:  # the client is gone (ASGI 2.4): the stream's own send learns it too, and ends the request
            return
