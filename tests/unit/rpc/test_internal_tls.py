"""Internal mTLS as on Kubernetes: cluster members dial each other's pod IP, and the one internal certificate
names only the cluster's internal server name, so every internal channel must check that name, not the address.
A real server on 127.0.0.1 with such a certificate, reached through `internal_channel`."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.cluster.internal_security import prepare_internal_security
from pdserve.config import ClusterConfig
from pdserve.rpc.credentials import internal_server_tls
from pdserve.rpc.server import Server, internal_channel
from tests.certs import INTERNAL_NAME, make_certs

INTERNAL_TLS_VARS = [f"PDSERVE_INTERNAL_TLS_{s}" for s in ("CERT", "KEY", "CA", "SERVER_NAME")]


async def _health(address: str) -> grpc.StatusCode:
    async with internal_channel(address) as ch:
        try:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.aio.AioRpcError as e:
            return e.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize(
    ("server_name", "status"), [(None, grpc.StatusCode.UNAVAILABLE), (INTERNAL_NAME, grpc.StatusCode.OK)]
)
async def test_internal_channels_check_the_internal_server_name_not_the_address(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, server_name: str | None, status: grpc.StatusCode
) -> None:
    certs = make_certs(tmp_path)
    for var in INTERNAL_TLS_VARS:  # "" reads as unset; monkeypatch restores the environment after
        monkeypatch.setenv(var, "")
    config = ClusterConfig(
        internal_tls_cert=str(certs.internal_cert),
        internal_tls_key=str(certs.internal_key),
        internal_tls_ca=str(certs.ca),
        internal_tls_server_name=server_name,
    )
    prepare_internal_security(config, make_secret=False)  # as `pdserve router` and `controller` do at start
    server = Server("127.0.0.1", 0, tls=internal_server_tls())
    await server.start()
    try:
        assert await _health(server.address) == status
    finally:
        await server.stop(None)


def test_a_server_name_without_the_internal_certificates_is_refused() -> None:
    with pytest.raises(ValueError, match="--internal-tls-server-name needs"):
        ClusterConfig(internal_tls_server_name=INTERNAL_NAME)
