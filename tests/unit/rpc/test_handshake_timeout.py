"""A TLS listener closes a connection that never starts its handshake (an idle TCP connect, no ClientHello) within
HANDSHAKE_TIMEOUT_MS, not gRPC's default 120 s: such connections held file descriptors unauthenticated."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from pdserve.rpc.credentials import server_tls
from pdserve.rpc.server import HANDSHAKE_TIMEOUT_MS, Server
from tests.certs import make_certs

pytestmark = pytest.mark.timeout(60)


async def test_an_idle_connection_to_a_tls_port_is_closed_after_the_handshake_timeout(tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
    server = Server("127.0.0.1", 0, tls=server_tls(str(certs.server_cert), str(certs.server_key), None))
    await server.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        start = time.monotonic()
        assert await asyncio.wait_for(reader.read(), timeout=HANDSHAKE_TIMEOUT_MS / 1000 + 5) == b""  # closed
        assert time.monotonic() - start > HANDSHAKE_TIMEOUT_MS / 1000 - 1
        writer.close()
    finally:
        await server.stop(None)
