"""When the router tells an HTTP/1.1 client to leave its keep-alive connection: past the connection's age, and while
the router drains.

The counterpart of gRPC's max connection age: HTTP/1.1 has no GOAWAY, so the first response on
a keep-alive connection older than the age says `Connection: close`, and the server closes it once that response
(a whole stream) has gone out. The client's pool opens a new connection, which a Service may send to a router
replica added since; no request is cut.

The age counts from the connection's first request, known by its client address (host and port), which stays
the same for the connection's life. A connection is forgotten when it closes, or at the latest once a live one
would have made its next request (the age and the keep-alive timeout): a live connection idle past twice the age
is still told to close. A connection whose address is reused before that is told to close after its first
response: one reconnection more, never a lost request.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

CLOSE = (b"connection", b"close")


class ConnectionAge:
    def __init__(
        self, app: ASGIApp, max_age_s: float, keep_alive_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """`keep_alive_s`: the server's keep-alive timeout, the longest a live connection waits between requests."""
        self.app = app
        self.max_age_s = max_age_s
        self.keep_alive_s = keep_alive_s
        self.clock = clock
        # (client, server) -> its first request's time, oldest first: the clock only moves on
        self._first_seen: OrderedDict[tuple[object, ...], float] = OrderedDict()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope.get("client") or _closes_anyway(scope):
            await self.app(scope, receive, send)
            return
        now = self.clock()
        self._prune(now)
        key = (*scope["client"], *(scope.get("server") or ()))
        if now - self._first_seen.setdefault(key, now) < self.max_age_s:
            await self.app(scope, receive, send)
            return
        del self._first_seen[key]  # closed after this response: its next request comes on a new connection
        await self.app(scope, receive, closing(send))

    def forget(self, client: object, server: object) -> None:
        """The connection closed (`DeadlineProtocol.connection_lost`): its entry goes now, not past its horizon
        (a caller opening connections fast, each with one request, would keep as many entries)."""
        if client and server:
            self._first_seen.pop((*client, *server), None)  # type: ignore[misc]

    def _prune(self, now: float) -> None:
        """Forgets connections gone without a request past their age, oldest first: a live one makes its next
        request within the keep-alive timeout, so one past its age and that is closed (pruning at twice the age
        forgot a live connection idle between, whose next request then started a new age)."""
        while self._first_seen:
            key, first = next(iter(self._first_seen.items()))
            if now - first < self.max_age_s + self.keep_alive_s:
                return
            del self._first_seen[key]


def closing(send: Send) -> Send:
    """`send`, with the response saying `Connection: close`: the server closes the connection once it went out."""

    async def send_closing(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [h for h in message.get("headers", ()) if h[0].lower() != b"connection"]
            message = {**message, "headers": [*headers, CLOSE]}
        await send(message)

    return send_closing


class CloseWhileDraining:
    """Every response that starts while the router drains says `Connection: close`: its 503 tells the caller to
    retry on another replica, which a keep-alive connection (a client's pool, behind a Service) would never
    reach, and a stream that finishes during the drain leaves no connection to the stopping router behind."""

    def __init__(self, app: ASGIApp, draining: Callable[[], bool]) -> None:
        self.app = app
        self.draining = draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_while_draining(message: Message) -> None:
            if message["type"] == "http.response.start" and self.draining():
                await closing(send)(message)
            else:
                await send(message)

        await self.app(scope, receive, send_while_draining)


def _closes_anyway(scope: Scope) -> bool:
    """An HTTP/1.0 request, or one that asked for `Connection: close`: its connection ends with this response."""
    if scope.get("http_version") == "1.0":
        return True
    return any(name == b"connection" and b"close" in value.lower() for name, value in scope.get("headers", ()))
