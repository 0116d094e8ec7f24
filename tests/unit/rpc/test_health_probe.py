"""The exec probe the chart uses with TLS on: it reports a real server's health, over plaintext and TLS."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from pdserve.rpc.health_probe import main
from pdserve.rpc.server import Server


async def _probe(*argv: str) -> int:
    return await asyncio.to_thread(main, list(argv))


async def test_plaintext_serving_then_not_serving() -> None:
    server = Server("127.0.0.1", 0)
    await server.start()
    try:
        assert await _probe("--addr", server.address) == 1  # NOT_SERVING until set_serving
        await server.set_serving(True)
        assert await _probe("--addr", server.address) == 0
        await server.set_serving(False)
        assert await _probe("--addr", server.address) == 1
    finally:
        await server.stop(None)
    assert await _probe("--addr", server.address, "--timeout", "0.5") == 1  # nothing listens


async def test_a_service_held_not_serving_while_the_server_serves() -> None:
    server = Server("127.0.0.1", 0)
    server.add(lambda s: None, ["pdserve.v1.Generation"])
    await server.start()
    try:
        await server.set_serving(True, held=["pdserve.v1.Generation"])
        assert await _probe("--addr", server.address) == 0
        assert await _probe("--addr", server.address, "--service", "pdserve.v1.Generation") == 1
        await server.set_serving(True)
        assert await _probe("--addr", server.address, "--service", "pdserve.v1.Generation") == 0
    finally:
        await server.stop(None)


def _self_signed(tmp: Path, name: str) -> tuple[Path, Path]:
    key, cert = tmp / f"{name}.key", tmp / f"{name}.crt"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        + ["-days", "1", "-subj", f"/CN={name}", "-addext", f"subjectAltName=DNS:{name}"]
        + ["-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    return cert, key


async def test_mutual_tls(tmp_path: Path) -> None:
    server_cert, server_key = _self_signed(tmp_path, "pdserve-internal")
    client_cert, client_key = _self_signed(tmp_path, "probe")
    creds = grpc.ssl_server_credentials(
        [(server_key.read_bytes(), server_cert.read_bytes())],
        root_certificates=client_cert.read_bytes(),
        require_client_auth=True,
    )
    server = grpc.aio.server()
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_secure_port("127.0.0.1:0", creds)
    await server.start()
    addr = f"127.0.0.1:{port}"
    tls = ["--tls-ca", str(server_cert), "--server-name", "pdserve-internal"]
    try:
        assert await _probe("--addr", addr, *tls, "--tls-cert", str(client_cert), "--tls-key", str(client_key)) == 0
        assert await _probe("--addr", addr, *tls, "--timeout", "1") == 1  # no client certificate: refused
        assert await _probe("--addr", addr, "--timeout", "1") == 1  # plaintext on a TLS port: refused
    finally:
        await server.stop(None)


@pytest.mark.parametrize("argv", [[], ["--timeout", "1"]])
def test_addr_is_required(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        main(argv)
