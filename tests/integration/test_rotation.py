"""Certificates and API keys rotated under a running `pdserve router` (gRPC and HTTP, TLS, --api-keys), as on
Kubernetes: the kubelet swaps a Secret's files at once by repointing a `..data` symlink, here as there. New
connections get the new certificate, new calls the new keys, and the process is the same one throughout; a bad
change (a key that does not match its certificate, a key file that does not parse) leaves the old one in use."""

from __future__ import annotations

import asyncio
import http.client
import os
import ssl
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.cluster.local_process import PdserveProcess
from pdserve.rpc.credentials import ClientCredentials
from pdserve.rpc.server import channel
from pdserve.security.api_keys import digest
from tests.certs import Certs, make_certs
from tests.integration.secure_client import cluster_status
from tests.redis_server import RedisServer, free_port, started

pytestmark = pytest.mark.timeout(180)
RELOAD_WITHIN_S = 6.0  # the files are looked at every second; a loaded 2-core machine may take a few
BAD_CERT = "not to a usable certificate"
BAD_KEYS = "API keys not reloaded"

redis_server = pytest.fixture(scope="module")(started)


class Secret:
    """A mounted Secret's folder: `tls.crt`, `tls.key`, `keys.toml` through `..data`, swapped all at once."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._versions = 0

    def path(self, name: str) -> str:
        return str(self.folder / name)

    def write(self, files: dict[str, bytes]) -> None:
        self._versions += 1
        version = self.folder / f"..{self._versions}"
        version.mkdir()
        for name, data in files.items():
            (version / name).write_bytes(data)
            if not (self.folder / name).is_symlink():
                (self.folder / name).symlink_to(f"..data/{name}")
        (self.folder / "..data_tmp").symlink_to(version.name)
        os.replace(self.folder / "..data_tmp", self.folder / "..data")  # the kubelet's atomic swap

    def current(self) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in self.folder.iterdir() if not p.name.startswith("..")}


def keys_toml(*names: str) -> bytes:
    """Admin keys (the Admin service is what a router without workers answers), each its own tenant."""
    return "".join(
        f'[[keys]]\nname = "{n}"\nsha256 = "{digest(n)}"\ntenant = "{n}"\nadmin = true\n' for n in names
    ).encode()


def pair(certs: Certs, key_of: Certs | None = None) -> dict[str, bytes]:
    return {"tls.crt": certs.server_cert.read_bytes(), "tls.key": (key_of or certs).server_key.read_bytes()}


class Router:
    def __init__(self, proc: PdserveProcess, grpc_port: int, http_port: int, secret: Secret, certs: Certs) -> None:
        self.proc, self.grpc_port, self.http_port, self.secret = proc, grpc_port, http_port, secret
        self.current_ca = certs.ca  # of the certificate it serves
        self.made = 0
        self.temp = secret.folder.parent

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def new_certs(self) -> Certs:
        """A certificate of a CA of its own: a client trusting only that CA accepts no other."""
        self.made += 1
        folder = self.temp / f"certs-{self.made}"
        folder.mkdir()
        return make_certs(folder)


@pytest.fixture(scope="module")
def router(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    temp = tmp_path_factory.mktemp("rotation")
    (temp / "certs-0").mkdir()
    certs = make_certs(temp / "certs-0")
    secret = Secret(temp / "secret")
    secret.folder.mkdir()
    secret.write(pair(certs) | {"keys.toml": keys_toml("first")})
    grpc_port, http_port = free_port(), free_port()
    proc = PdserveProcess(
        "router", "--model", "tiny-random", "--redis", redis_server.url,
        "--port", str(grpc_port), "--http-port", str(http_port),
        "--tls-cert", secret.path("tls.crt"), "--tls-key", secret.path("tls.key"),
        "--api-keys", secret.path("keys.toml"),
        log_path=temp / "router.log", env={"PDSERVE_CLUSTER_SECRET": "s" * 64},
    )  # fmt: skip
    proc.wait_ready()
    yield Router(proc, grpc_port, http_port, secret, certs)
    proc.stop()


def grpc_handshake(router: Router, ca: Path) -> bool:
    """Whether a new connection, trusting only `ca`, gets through its TLS handshake (a health check answers)."""

    async def check() -> bool:
        async with channel(router.address, credentials=ClientCredentials(tls_ca=str(ca))) as ch:
            try:
                await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE, e
                return False
        return True

    return asyncio.run(check())


def http_get(router: Router, ca: Path, key: str = "first", path: str = "/v1/models") -> int | None:
    """The status of a GET on a new connection trusting only `ca`; None when the handshake fails."""
    conn = http.client.HTTPSConnection(
        "127.0.0.1", router.http_port, timeout=5, context=ssl.create_default_context(cafile=str(ca))
    )
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {key}"})
        return conn.getresponse().status
    except ssl.SSLCertVerificationError:
        return None
    finally:
        conn.close()


def status_code(router: Router, key: str) -> grpc.StatusCode:
    creds = ClientCredentials(tls_ca=str(router.current_ca), api_key=key)
    try:
        asyncio.run(cluster_status(router.address, creds))
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def eventually(check: Callable[[], bool], within_s: float = RELOAD_WITHIN_S) -> bool:
    deadline = time.monotonic() + within_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def rotate_to(router: Router, certs: Certs) -> None:
    """Serves `certs` (the keys file as it was), and waits until both listeners hand it to new connections."""
    router.secret.write(router.secret.current() | pair(certs))
    assert eventually(lambda: grpc_handshake(router, certs.ca)), router.proc.log()[-3000:]
    assert eventually(lambda: http_get(router, certs.ca) == 200), router.proc.log()[-3000:]
    router.current_ca = certs.ca


def test_a_renewed_certificate_reaches_new_connections_without_a_restart(router: Router) -> None:
    old, pid = router.current_ca, router.proc.proc.pid
    assert grpc_handshake(router, old) and http_get(router, old) == 200
    renewed = router.new_certs()
    assert not grpc_handshake(router, renewed.ca) and http_get(router, renewed.ca) is None
    rotate_to(router, renewed)
    assert not grpc_handshake(router, old) and http_get(router, old) is None  # the old one is no longer served
    assert router.proc.proc.poll() is None and router.proc.proc.pid == pid
    assert "TLS certificate reloaded" in router.proc.log()


def test_a_key_that_does_not_match_its_certificate_leaves_the_previous_one_served(router: Router) -> None:
    good, other = router.new_certs(), router.new_certs()
    rotate_to(router, good)
    errors = router.proc.log().count(BAD_CERT)
    router.secret.write(router.secret.current() | pair(other, key_of=good))  # other's certificate, good's key
    time.sleep(2.5)  # two looks at the files
    for _ in range(3):  # each handshake asks for the certificate: the bad change is logged once, not each time
        assert grpc_handshake(router, good.ca) and http_get(router, good.ca) == 200
        assert not grpc_handshake(router, other.ca) and http_get(router, other.ca) is None
    assert router.proc.log().count(BAD_CERT) == errors + 2  # once by the gRPC listener, once by the HTTP one
    assert router.proc.proc.poll() is None
    rotate_to(router, other)  # the pair completed: served at once


def test_a_key_added_is_accepted_and_a_key_revoked_is_refused_without_a_restart(router: Router) -> None:
    router.secret.write(router.secret.current() | {"keys.toml": keys_toml("first", "added")})
    assert eventually(lambda: status_code(router, "added") == grpc.StatusCode.OK), router.proc.log()[-3000:]
    assert http_get(router, router.current_ca, key="added") == 200
    router.secret.write(router.secret.current() | {"keys.toml": keys_toml("added")})
    revoked = lambda: status_code(router, "first") == grpc.StatusCode.UNAUTHENTICATED  # noqa: E731
    assert eventually(revoked), router.proc.log()[-3000:]
    assert http_get(router, router.current_ca, key="first") == 401
    assert status_code(router, "added") == grpc.StatusCode.OK
    assert "API keys reloaded: 1 keys" in router.proc.log()
    router.secret.write(router.secret.current() | {"keys.toml": keys_toml("first")})  # as the module began
    assert eventually(lambda: status_code(router, "first") == grpc.StatusCode.OK)


def test_a_key_file_that_does_not_parse_keeps_the_keys_in_use(router: Router) -> None:
    errors = router.proc.log().count(BAD_KEYS)
    router.secret.write(router.secret.current() | {"keys.toml": keys_toml("first") + b"[[keys]\n"})
    assert eventually(lambda: router.proc.log().count(BAD_KEYS) == errors + 1), router.proc.log()[-3000:]
    assert "not valid TOML" in router.proc.log()
    assert status_code(router, "first") == grpc.StatusCode.OK
    assert http_get(router, router.current_ca, key="first") == 200
    time.sleep(2.5)
    assert router.proc.log().count(BAD_KEYS) == errors + 1  # one error per bad change, not one per look
    router.secret.write(router.secret.current() | {"keys.toml": keys_toml("first", "later")})
    assert eventually(lambda: status_code(router, "later") == grpc.StatusCode.OK)
