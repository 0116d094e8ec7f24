"""A throwaway `redis-server` for tests: on a free loopback port, no persistence, killable and restartable."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator

import redis

from pdserve.cluster.local_process import free_port
from tests.certs import Certs

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


class RedisServer:
    """One server process; `stop()` kills it (its data goes with it), `start()` brings it back on the same port."""

    def __init__(
        self, port: int | None = None, password: str | None = None, host: str = "127.0.0.1", tls: Certs | None = None
    ) -> None:
        self.host = host
        self.port = port or free_port()
        self.password = password  # set: clients must AUTH (--requirepass)
        self.tls = tls  # set: TLS only, with its server certificate for 127.0.0.1 (clients need no certificate)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://{self.host}:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        assert self.proc is None, "already running"
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", self.host, "--save", "", "--appendonly", "no"]
            + ["--enable-debug-command", "local"]  # DEBUG SLEEP: a test stalls Redis as a slow one would
            + (["--requirepass", self.password] if self.password else [])
            + ([] if self.host == "127.0.0.1" else ["--protected-mode", "no"])  # a test's own address
            + self._tls_args(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(
            host=self.host,
            port=self.port,
            password=self.password,
            socket_connect_timeout=0.2,
            socket_timeout=0.5,
            **({"ssl": True, "ssl_ca_certs": str(self.tls.ca)} if self.tls else {}),
        )
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode} on port {self.port}")
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"redis-server did not answer on port {self.port} in {timeout_s} s")
                time.sleep(0.05)
        finally:
            client.close()

    def _tls_args(self) -> list[str]:
        if self.tls is None:
            return []
        files = ["--tls-cert-file", str(self.tls.server_cert), "--tls-key-file", str(self.tls.server_key)]
        files += ["--tls-ca-cert-file", str(self.tls.ca), "--tls-auth-clients", "no"]
        return ["--port", "0", "--tls-port", str(self.port), *files]

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.kill()
        self.proc.wait(timeout=10)
        self.proc = None

    @contextlib.contextmanager
    def stopped(self) -> Iterator[None]:
        """SIGSTOP: the server keeps its port and accepts connections but answers nothing, as a hung or
        partitioned Redis does (not the refused connection of a dead one)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            self.proc.send_signal(signal.SIGCONT)

    def stall_the_loop(self, stall_s: float, when: str, answer_after_s: float) -> None:
        """The running event loop blocks for `stall_s` while this server stands still (SIGSTOP from now), and it
        answers `answer_after_s` after the block, as one across a network would: a stall of a router's own loop
        with a call in flight. The block comes "before" the call just begun is sent (the loop's next callback) or
        "after" it (10 ms on, its answer awaited)."""
        assert self.proc is not None
        proc, loop = self.proc, asyncio.get_running_loop()
        proc.send_signal(signal.SIGSTOP)

        def stall() -> None:
            time.sleep(stall_s)
            loop.call_later(answer_after_s, proc.send_signal, signal.SIGCONT)

        if when == "before":
            loop.call_soon(stall)
        else:
            loop.call_later(0.01, stall)

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, **({"ssl_ca_certs": str(self.tls.ca)} if self.tls else {}))


def started() -> Iterator[RedisServer]:
    """A module's own redis-server (register with `pytest.fixture(scope="module")`)."""
    srv = RedisServer()
    srv.start()
    yield srv
    srv.stop()


def emptied(server: RedisServer) -> str:
    """The module's server, running and empty, for one test (register with `pytest.fixture`); its URL."""
    if server.proc is None:  # a test that stopped it failed before restarting it
        server.start()
    with server.client() as c:
        c.flushall()
    return server.url


def silent() -> Iterator[str]:
    """The URL of a Redis that never answers (register with `pytest.fixture`): a listener that accepts connections
    and reads nothing, as a stopped or partitioned server looks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)  # the kernel completes handshakes; nobody ever reads or writes
        yield f"redis://127.0.0.1:{s.getsockname()[1]}/0"
