"""The HTTP listener: uvicorn serving the ASGI app on the router's own event loop, beside the gRPC server.

Embedded (`uvicorn.Server.serve()` as a task) rather than a second process: one process means one
lifecycle, one admission count and one drain for both protocols. uvicorn's own signal handling is off,
since the process that runs the router owns SIGTERM and drains both listeners itself."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from ssl import CERT_REQUIRED
from typing import Any

import uvicorn
from starlette.types import ASGIApp

from pdserve.config import RouterConfig
from pdserve.rpc.credentials import ServerTLS
from pdserve.security.rotating_certificate import RotatingCertificate
from services.router.http.connection_close import ConnectionAge
from services.router.http.connection_deadlines import HEAD_TIMEOUT_S, with_deadlines

STARTUP_TIMEOUT_S = 10.0
KEEP_ALIVE_S = 5  # uvicorn's default: an idle keep-alive connection is closed after this


TICK_S = 1.0  # the Date header's resolution: uvicorn's own loop wakes ten times as often to refresh it


class _Embedded(uvicorn.Server):
    """Ticks once a second, or at once when told to exit, where uvicorn's loop wakes every 0.1 s to see whether it
    should exit: on an idle router that was 10 wake-ups a second of the loop that relays every stream."""

    def __init__(self, config: uvicorn.Config) -> None:
        self._exit = asyncio.Event()
        super().__init__(config)

    @property  # uvicorn assigns a plain attribute (its __init__, handle_exit; our stop): each write lands here
    def should_exit(self) -> bool:
        return self._exit.is_set()

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        if value:
            self._exit.set()
        else:
            self._exit.clear()

    async def main_loop(self) -> None:
        while not await self.on_tick(0):  # counter 0: each tick refreshes the Date header
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(TICK_S):
                    await self._exit.wait()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    def __init__(
        self,
        app: ASGIApp,
        host: str,
        port: int,
        tls: ServerTLS | None = None,
        grace_s: int = 1,
        max_connection_age_s: float | None = None,
        head_timeout_s: float = HEAD_TIMEOUT_S,
        write_stall_timeout_s: float = RouterConfig.reader_stall_timeout_s,
    ) -> None:
        """`max_connection_age_s`: a keep-alive connection is closed after its first response past this age (None:
        never), as the gRPC listener's GOAWAY does. `head_timeout_s`: a connection whose request head is not in
        within this is closed, as is one whose reader takes none of a response for `write_stall_timeout_s`
        (connection_deadlines.py)."""
        # The same certificate as the gRPC port: TLS on one public port and plaintext on the other would be a hole.
        ssl: dict[str, Any] = {}
        if tls is not None:
            ssl = {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key}
            if tls.client_ca:
                ssl |= {"ssl_ca_certs": tls.client_ca, "ssl_cert_reqs": CERT_REQUIRED}
        on_closed = None
        if max_connection_age_s is not None:
            app = ConnectionAge(app, max_connection_age_s, KEEP_ALIVE_S)
            on_closed = app.forget
        config = uvicorn.Config(
            app,
            http=with_deadlines(head_timeout_s, write_stall_timeout_s, on_closed),  # h11, with deadlines of its own
            host=host,
            port=port,
            lifespan="off",
            log_config=None,  # the process's JSON logging stands
            log_level="warning",  # its start-up lines advise CTRL+C; the launcher logs the address itself
            access_log=False,
            # The client address is the connection's (connection_close.py keys by it); nothing here reads the
            # X-Forwarded-For of a proxy in front.
            proxy_headers=False,
            timeout_graceful_shutdown=grace_s,
            timeout_keep_alive=KEEP_ALIVE_S,
            **ssl,
        )
        if tls is not None:
            # uvicorn makes its SSLContext from the files once; on each handshake this moves the connection onto a
            # context of the files as they are now, so a renewed certificate or client CA needs no restart.
            config.load()
            assert config.ssl is not None  # load() made it from the files
            client_cas = [tls.client_ca] if tls.client_ca else []
            config.ssl.sni_callback = RotatingCertificate(tls.cert, tls.key, client_cas).sni_callback
        self._server = _Embedded(config)
        self._task: asyncio.Task[None] | None = None
        self.host = host
        self.port = port

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        """Returns once listening; `port` is then the bound one (0 asks for any free port)."""
        self._task = asyncio.create_task(self._server.serve())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + STARTUP_TIMEOUT_S
        while not self._server.started:
            if self._task.done() or loop.time() > deadline:
                await self.stop()
                raise OSError(f"could not serve HTTP on {self.address}")
            await asyncio.sleep(0.02)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Stops accepting, lets open responses finish within the grace, then closes."""
        if self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(Exception, SystemExit):
            await self._task
        self._task = None
