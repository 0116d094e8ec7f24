"""What `pdserve client`, `pdserve status` and loadgen add to a failure their own flags explain: a plaintext client
at a router serving TLS is told to pass --tls-ca (gRPC says only "Socket closed"; loadgen waited its 30 s and said
"no answer"), a client without a key is told --api-key or PDSERVE_API_KEY; the server's own message is unchanged."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from loadgen import benchmark, grpc_backend
from loadgen.__main__ import main as loadgen_main
from loadgen.record import RequestRecord
from pdserve.cli import main
from pdserve.config import RouterConfig
from pdserve.registry.memory import InMemoryPrefixIndex, InMemoryRegistry
from pdserve.rpc.client_hints import GRPC_PORT_HINT, KEY_HINT, PLAINTEXT_HINT, TLS_HINT, with_hint
from pdserve.rpc.credentials import ClientCredentials, server_tls
from pdserve.rpc.server import Server
from pdserve.security.api_keys import bearer_metadata, digest
from pdserve.telemetry import Telemetry
from pdserve.v1 import admin_pb2 as apb
from pdserve.v1 import admin_pb2_grpc
from services.router.server import start_router
from tests.certs import make_certs

pytestmark = pytest.mark.timeout(90)
NO_KEY_MESSAGE = "this cluster requires an API key: send metadata `authorization: Bearer KEY`"


@pytest.fixture
async def tls_server(tmp_path: Path) -> AsyncIterator[str]:
    certs = make_certs(tmp_path)
    server = Server("127.0.0.1", 0, tls=server_tls(str(certs.server_cert), str(certs.server_key)))
    await server.start()
    yield server.address
    await server.stop(None)


async def _cli(*argv: str) -> int:
    return await asyncio.to_thread(main, list(argv))


async def test_a_plaintext_client_at_a_tls_router_is_told_to_pass_tls_ca(tls_server, capsys) -> None:
    assert await _cli("status", "--addr", tls_server, "--timeout", "5") == 1
    assert await _cli("client", "--addr", tls_server, "--prompt", "hi", "--timeout", "5") == 1
    status, client = capsys.readouterr().err.strip().splitlines()[-2:]
    for command, line in (("status", status), ("client", client)):
        assert line.startswith(f"pdserve {command}: UNAVAILABLE: failed to connect"), line
        assert line.endswith(TLS_HINT), line


async def test_a_tls_client_at_a_plaintext_router_is_told_to_drop_tls_ca(tmp_path, capsys) -> None:
    """It was told OpenSSL's `WRONG_VERSION_NUMBER: Invalid certificate verification context` alone."""
    server = Server("127.0.0.1", 0)
    await server.start()
    try:
        ca = str(make_certs(tmp_path).ca)
        assert await _cli("client", "--addr", server.address, "--prompt", "hi", "--tls-ca", ca, "--timeout", "5") == 1
    finally:
        await server.stop(None)
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("pdserve client: UNAVAILABLE: failed to connect") and line.endswith(PLAINTEXT_HINT), line


async def test_a_client_at_an_http_port_is_told_to_pass_the_grpc_port_not_tls(capsys) -> None:
    """Pointed at the OpenAI API's port (or any web server), it was told to pass --tls-ca, which could not help."""

    async def http_1(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)
        writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(http_1, "127.0.0.1", 0)
    address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        assert await _cli("client", "--addr", address, "--prompt", "hi", "--timeout", "5") == 1
    finally:
        server.close()
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "Failed parsing HTTP/2" in line and line.endswith(GRPC_PORT_HINT) and TLS_HINT not in line, line


def test_an_addr_given_as_a_url_is_refused_naming_the_grpc_port(capsys) -> None:
    """gRPC read `http://h:p` as a host of that name: `Misformatted domain name`."""
    with pytest.raises(SystemExit) as exit_:
        main(["status", "--addr", "http://127.0.0.1:8000"])
    assert exit_.value.code == 2
    assert "argument --addr: 'http://127.0.0.1:8000' is a URL: give the router's gRPC HOST:PORT (its --port)" in (
        capsys.readouterr().err
    )


async def test_nothing_listening_gets_no_tls_hint(capsys) -> None:
    assert await _cli("client", "--addr", "127.0.0.1:1", "--prompt", "hi", "--timeout", "5") == 1
    err = capsys.readouterr().err
    assert "Connection refused" in err and TLS_HINT not in err


async def test_loadgen_at_a_tls_router_says_no_answer_and_to_pass_tls_ca(tls_server, capsys, monkeypatch) -> None:
    monkeypatch.setattr(grpc_backend, "CONNECT_TIMEOUT_S", 1.0)  # not the 30 s a real run waits
    argv = ["--addr", tls_server, "--model", "tiny-random", "--num-prompts", "1"]
    assert await asyncio.to_thread(loadgen_main, argv) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"loadgen: no answer from {tls_server} {TLS_HINT}"


@pytest.fixture
async def keyed_router(tmp_path: Path) -> AsyncIterator[str]:
    keys = tmp_path / "keys.toml"
    keys.write_text(
        f'[[keys]]\nname = "ops"\nsha256 = "{digest("k")}"\ntenant = "ops"\nmax_priority = 0\nadmin = true\n'
    )
    config = RouterConfig(api_keys_file=str(keys), no_workers_wait_s=0.1)
    telemetry = Telemetry("pdserve-router", enabled=False)
    server, _ = await start_router(
        "tiny-random", InMemoryRegistry(), InMemoryPrefixIndex(), config, "127.0.0.1", 0, telemetry
    )
    yield server.address
    await server.stop(None)


async def test_a_client_without_a_key_is_told_the_flag_and_the_server_message_stays(
    keyed_router, capsys, monkeypatch
) -> None:
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    assert await _cli("status", "--addr", keyed_router) == 1
    assert await _cli("client", "--addr", keyed_router, "--prompt", "hi", "--timeout", "5") == 1
    status, client = capsys.readouterr().err.strip().splitlines()[-2:]
    assert status == f"pdserve status: UNAUTHENTICATED: {NO_KEY_MESSAGE} {KEY_HINT}"
    assert client == f"pdserve client: UNAUTHENTICATED: {NO_KEY_MESSAGE} {KEY_HINT}"
    async with grpc.aio.insecure_channel(keyed_router) as ch:  # another gRPC caller: the server's words alone
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await admin_pb2_grpc.AdminStub(ch).ClusterStatus(apb.ClusterStatusRequest(), timeout=10)
        assert e.value.details() == NO_KEY_MESSAGE
        reply = await admin_pb2_grpc.AdminStub(ch).ClusterStatus(
            apb.ClusterStatusRequest(), metadata=bearer_metadata("k"), timeout=10
        )
        assert reply.in_flight == 0


def test_loadgen_check_without_a_key_names_the_flag(capsys, monkeypatch) -> None:
    class RefusingClient:
        def __init__(self, *args: object) -> None:
            pass

        async def check(self, request: object) -> RequestRecord:
            return RequestRecord("check", 5, 4, 0.0, status="UNAUTHENTICATED", error=NO_KEY_MESSAGE)

    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    monkeypatch.setattr(benchmark, "make_backend", lambda config: None)
    monkeypatch.setattr(benchmark, "Client", RefusingClient)
    assert loadgen_main(["--addr", "127.0.0.1:1", "--model", "tiny-random", "--num-prompts", "1"]) == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == f"loadgen: the check request failed: UNAUTHENTICATED: {NO_KEY_MESSAGE} {KEY_HINT}"


def test_a_hint_only_where_the_flags_passed_do_not_already_cover_it() -> None:
    socket_closed = "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:10.0.0.1:50051: Socket closed"
    assert with_hint("UNAVAILABLE", socket_closed, None).endswith(TLS_HINT)
    assert with_hint("UNAVAILABLE", socket_closed, ClientCredentials(tls_ca="ca.pem")) == socket_closed
    assert with_hint("UNAVAILABLE", "no prefill worker is serving", None) == "no prefill worker is serving"
    assert with_hint("UNAUTHENTICATED", "unknown API key", ClientCredentials(api_key="x")) == "unknown API key"


async def test_the_admin_commands_name_the_flag_too(keyed_router, capsys, monkeypatch) -> None:
    """drain, restart and scale printed gRPC's words alone."""
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    assert await _cli("drain", "--addr", keyed_router, "prefill-0") == 1
    assert await _cli("restart", "--addr", keyed_router) == 1
    assert await _cli("scale", "--addr", keyed_router, "--prefill", "2", "--decode", "1") == 1
    lines = capsys.readouterr().err.strip().splitlines()[-3:]
    for command, line in zip(("drain", "restart", "scale"), lines, strict=True):
        assert line == f"pdserve {command}: UNAUTHENTICATED: {NO_KEY_MESSAGE} {KEY_HINT}", line
