"""Internal mTLS as on Kubernetes: cluster members dial each other's pod IP, and the one internal certificate
names only the cluster's internal server name, so every internal channel must check that name, not the address.
A real server on 127.0.0.1 with such a certificate, reached through `internal_channel`."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.cluster.internal_security import prepare_internal_security
from pdserve.config import ClusterConfig
from pdserve.rpc.channel_pool import ChannelPool
from pdserve.rpc.credentials import internal_server_tls
from pdserve.rpc.server import Server, internal_channel
from pdserve.security.watched_files import WatchedFiles
from tests.certs import INTERNAL_NAME, Certs, make_certs

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
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


async def test_a_renewed_internal_certificate_reaches_pooled_channels_and_a_call_in_flight_keeps_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rotation to a new CA (a renewal is the same with one CA): a pooled channel opened before it would reconnect
    to a restarted worker with the old certificate, which that worker no longer trusts."""
    for name in ("old", "new", "live"):
        (tmp_path / name).mkdir()
    old, new, live = make_certs(tmp_path / "old"), make_certs(tmp_path / "new"), tmp_path / "live"
    files = [live / "cert.pem", live / "key.pem", live / "ca.pem"]

    def install(certs: Certs) -> None:
        for dst, src in zip(files, (certs.internal_cert, certs.internal_key, certs.ca), strict=True):
            dst.write_bytes(src.read_bytes())

    install(old)
    for var in INTERNAL_TLS_VARS:
        monkeypatch.setenv(var, "")
    cert, key, ca = map(str, files)
    config = ClusterConfig(
        internal_tls_cert=cert, internal_tls_key=key, internal_tls_ca=ca, internal_tls_server_name=INTERNAL_NAME
    )
    prepare_internal_security(config, make_secret=False)
    steady, restarted = (
        Server("127.0.0.1", 0, tls=internal_server_tls()),
        Server("127.0.0.1", 0, tls=internal_server_tls()),
    )
    pool = ChannelPool(health_pb2_grpc.HealthStub, credential_files=WatchedFiles([cert, key, ca], interval_s=0))
    request = health_pb2.HealthCheckRequest()

    async def check(address: str) -> int:
        return (await pool.call(address, lambda stub: stub.Check(request, timeout=5))).status

    servers = [steady, restarted]
    try:
        for server in servers:
            await server.start()
            await server.set_serving(True)
        watch = pool.call(steady.address, lambda stub: stub.Watch(request, timeout=30))
        assert (await watch.read()).status == SERVING
        assert await check(restarted.address) == SERVING

        install(new)
        port = restarted.port
        await restarted.stop(None)  # a worker restarted at its address, with the renewed files
        restarted = Server("127.0.0.1", port, tls=internal_server_tls())
        servers[1] = restarted
        await restarted.start()
        await restarted.set_serving(True)
        assert await check(restarted.address) == SERVING
        assert pool.addresses == [restarted.address]  # the channel with a call in flight is retired...

        await steady.set_serving(False)
        assert (await asyncio.wait_for(watch.read(), 5)).status == NOT_SERVING  # ...and its call goes on
    finally:
        await pool.close()
        for server in servers:
            await server.stop(None)
