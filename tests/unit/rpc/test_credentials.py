"""TLS and mTLS listeners made by rpc/credentials.py, on a real server with openssl-made throwaway certificates."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.rpc.credentials import ClientCredentials, server_tls
from pdserve.rpc.server import Server, channel
from tests.certs import make_certs


async def _health(address: str, creds: ClientCredentials | None) -> grpc.StatusCode:
    async with channel(address, credentials=creds) as ch:
        try:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.aio.AioRpcError as e:
            return e.code()
    return grpc.StatusCode.OK


async def test_a_client_ca_makes_the_port_require_a_client_certificate(tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
    server = Server("127.0.0.1", 0, tls=server_tls(str(certs.server_cert), str(certs.server_key), str(certs.ca)))
    await server.start()
    try:
        ca_only = ClientCredentials(tls_ca=str(certs.ca))
        with_cert = ClientCredentials(str(certs.ca), str(certs.client_cert), str(certs.client_key))
        assert await _health(server.address, None) == grpc.StatusCode.UNAVAILABLE  # plaintext
        assert await _health(server.address, ca_only) == grpc.StatusCode.UNAVAILABLE  # no client certificate
        assert await _health(server.address, with_cert) == grpc.StatusCode.OK
    finally:
        await server.stop(None)


def test_half_given_certificates_are_refused() -> None:
    assert server_tls(None, None) is None
    with pytest.raises(ValueError, match="both"):
        server_tls("cert.pem", None)
    with pytest.raises(ValueError, match="--tls-client-ca needs"):
        server_tls(None, None, "ca.pem")
