"""TLS and mTLS listeners made by rpc/credentials.py, on a real server with openssl-made throwaway certificates."""

from __future__ import annotations

import argparse
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.rpc.credentials import ClientCredentials, add_client_flags, client_credentials, server_tls
from pdserve.rpc.server import Server, channel
from tests.certs import INTERNAL_NAME, Certs, make_certs


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


def _certs(folder: Path) -> Certs:
    folder.mkdir()
    return make_certs(folder)


@pytest.mark.parametrize("internal_tls", [True, False])
async def test_with_a_client_ca_the_public_port_takes_the_clusters_internal_certificate_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, internal_tls: bool
) -> None:
    """The router's own probes, a worker's preStop drain and `helm test` present the cluster's internal
    certificate, not one of the client CA's: with internal TLS configured the public port takes it, and still
    refuses any other CA's."""
    public, cluster, stranger = (_certs(tmp_path / name) for name in ("public", "cluster", "stranger"))
    internal = (cluster.internal_cert, cluster.internal_key, cluster.ca) if internal_tls else ("", "", "")
    for part, path in zip(("CERT", "KEY", "CA"), internal, strict=True):
        monkeypatch.setenv(f"PDSERVE_INTERNAL_TLS_{part}", str(path))
    server = Server("127.0.0.1", 0, tls=server_tls(str(public.server_cert), str(public.server_key), str(public.ca)))
    await server.start()
    try:
        client = ClientCredentials(str(public.ca), str(public.client_cert), str(public.client_key))
        member = ClientCredentials(str(public.ca), str(cluster.internal_cert), str(cluster.internal_key))
        other = ClientCredentials(str(public.ca), str(stranger.client_cert), str(stranger.client_key))
        assert await _health(server.address, client) == grpc.StatusCode.OK
        expected = grpc.StatusCode.OK if internal_tls else grpc.StatusCode.UNAVAILABLE
        assert await _health(server.address, member) == expected
        assert await _health(server.address, other) == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(None)


async def test_tls_server_name_checks_the_name_the_certificate_carries_instead_of_the_host(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A router certificate for its public name, reached at another address (a Service name, a port-forward)."""
    certs = make_certs(tmp_path)
    server = Server("127.0.0.1", 0, tls=server_tls(str(certs.internal_cert), str(certs.internal_key)))
    await server.start()
    parser = argparse.ArgumentParser()
    add_client_flags(parser)
    try:
        for named, expected in (
            (["--tls-server-name", INTERNAL_NAME], grpc.StatusCode.OK),
            ([], grpc.StatusCode.UNAVAILABLE),
        ):
            args = parser.parse_args(["--tls-ca", str(certs.ca), *named])
            assert await _health(server.address, client_credentials(args)) == expected, named
    finally:
        await server.stop(None)
    with pytest.raises(SystemExit) as refused:
        client_credentials(parser.parse_args(["--tls-server-name", INTERNAL_NAME]))
    assert refused.value.code == 2
    assert "--tls-server-name needs --tls-ca" in capsys.readouterr().err
    with pytest.raises(SystemExit) as missing:  # a usage error, not a traceback when the channel opens
        client_credentials(parser.parse_args(["--tls-ca", str(certs.ca) + ".missing"]))
    assert missing.value.code == 2 and "--tls-ca: no such file" in capsys.readouterr().err


def test_half_given_certificates_are_refused() -> None:
    assert server_tls(None, None) is None
    with pytest.raises(ValueError, match="both"):
        server_tls("cert.pem", None)
    with pytest.raises(ValueError, match="--tls-client-ca needs"):
        server_tls(None, None, "ca.pem")
