"""Transport credentials and call credentials, in one place: every server listener and every channel is made
through here, so TLS (and who holds which certificate) is decided once.

- Public side (the router's port): server TLS from `--tls-cert/--tls-key`, client certificates required when
  `--tls-client-ca` is given (mTLS); then a certificate of the cluster CA is accepted too when internal TLS is
  configured, so the cluster's own members (probes, a worker's drain) reach it with their internal certificate.
  Without a certificate the port is plaintext, as before.
- Clients (`pdserve client/status`, loadgen): `--tls-ca [--tls-cert --tls-key] [--tls-server-name]` and
  `--api-key` (or the environment's PDSERVE_API_KEY), sent as `authorization: Bearer KEY`.
- Internal hops (router -> workers, decode -> prefill): mTLS with the cluster CA when `pdserve up
  --internal-tls-cert/--internal-tls-key/--internal-tls-ca` is given (the environment carries the paths to the
  workers): each side presents that certificate and accepts only peers whose certificate the CA signed. With
  `--internal-tls-server-name NAME` every internal channel checks the peer's certificate for NAME instead of the
  address it dials: on Kubernetes that address is a pod IP, which no certificate issued ahead of time can name.
Every listener's certificate, key and CAs are read again when their files change (rotating_certificate.py).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import grpc

from pdserve import env
from pdserve.security.api_keys import bearer_metadata
from pdserve.security.rotating_certificate import RotatingCertificate
from pdserve.security.watched_files import WatchedFiles


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


@dataclass(frozen=True)
class ServerTLS:
    """A listener's certificate and key (PEM files), and the CA its clients' certificates must chain to (mTLS);
    `cluster_ca`: a CA whose certificates it accepts besides the client CA's (the cluster's internal one)."""

    cert: str
    key: str
    client_ca: str | None = None
    cluster_ca: str | None = None

    def credentials(self) -> grpc.ServerCredentials:
        """Read again when the files change (rotating_certificate.py): a renewed certificate needs no restart."""
        cas = [ca for ca in (self.client_ca, self.cluster_ca) if ca]
        return RotatingCertificate(self.cert, self.key, cas).grpc_credentials()


def server_tls(cert: str | None, key: str | None, client_ca: str | None = None) -> ServerTLS | None:
    """The public listener's TLS: None (plaintext) when no certificate is given; a half-given pair is an error,
    not a silent plaintext. When it requires client certificates and internal TLS is configured, it accepts the
    cluster CA's too: the cluster's own members (the router's probes, a worker's preStop drain, `helm test`) hold
    the internal certificate, not a client one, and whoever holds the internal key is already trusted with every
    worker. API keys apply to them as to any client."""
    if not cert and not key:
        if client_ca:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if not (cert and key):
        raise ValueError("give both --tls-cert and --tls-key")
    internal = env.internal_tls()
    return ServerTLS(cert, key, client_ca, cluster_ca=internal[2] if client_ca and internal else None)


def add_port(server: grpc.aio.Server, address: str, tls: ServerTLS | None) -> int:
    """Binds `address`, with TLS when given; the bound port (0 when it could not be bound)."""
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.credentials())


@dataclass(frozen=True)
class ClientCredentials:
    """What a client presents: the CA that signed the server's certificate (TLS on when set), its own
    certificate and key for mTLS, and an API key; `server_name`: the name the server's certificate must carry
    when it is not the host dialled (None: the host)."""

    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    api_key: str | None = None
    server_name: str | None = None

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls_ca:
            return None
        return grpc.ssl_channel_credentials(_read(self.tls_ca), _read(self.tls_key), _read(self.tls_cert))

    def channel_options(self) -> list[tuple[str, str]]:
        """gRPC checks the server's certificate for the dialled host unless told another name."""
        return [("grpc.ssl_target_name_override", self.server_name)] if self.tls_ca and self.server_name else []

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return bearer_metadata(self.api_key)


PLAINTEXT = ClientCredentials()


def make_channel(
    address: str,
    options: Sequence[tuple[str, Any]],
    interceptors: Sequence[Any] | None,
    credentials: ClientCredentials | None,
) -> grpc.aio.Channel:
    credentials = credentials or PLAINTEXT
    creds = credentials.channel_credentials()
    if creds is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    options = [*options, *credentials.channel_options()]
    return grpc.aio.secure_channel(address, creds, options=options, interceptors=interceptors)


def add_client_flags(p: argparse.ArgumentParser) -> None:
    """--tls-ca, --tls-cert, --tls-key, --tls-server-name, --api-key: what every command that calls the router
    takes."""
    p.add_argument("--tls-ca", help="PEM CA of the router's certificate: connect with TLS")
    p.add_argument("--tls-cert", help="PEM client certificate, for a router that requires one (mTLS)")
    p.add_argument("--tls-key", help="PEM key of --tls-cert")
    p.add_argument(
        "--tls-server-name",
        help="the name the router's certificate carries, when it is not the host of --addr (default: that host)",
    )
    p.add_argument("--api-key", help="sent as `authorization: Bearer KEY` (default: $PDSERVE_API_KEY)")


def client_credentials(args: argparse.Namespace) -> ClientCredentials:
    """The client flags' credentials; a usage error (exit 2, one line) when they do not go together or name a
    file that is not there."""
    if bool(args.tls_cert) != bool(args.tls_key):
        _usage_error("give both --tls-cert and --tls-key, or neither")
    if args.tls_cert and not args.tls_ca:
        _usage_error("--tls-cert needs --tls-ca (the client certificate is only sent over TLS)")
    if args.tls_server_name and not args.tls_ca:
        _usage_error("--tls-server-name needs --tls-ca (the name is checked only over TLS)")
    for flag, path in (("--tls-ca", args.tls_ca), ("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
        if path and not Path(path).is_file():
            _usage_error(f"{flag}: no such file: {path}")
    api_key = args.api_key or env.api_key()
    return ClientCredentials(args.tls_ca, args.tls_cert, args.tls_key, api_key, args.tls_server_name)


def _usage_error(message: str) -> NoReturn:
    print(f"pdserve: {message}", file=sys.stderr)
    raise SystemExit(2)


def internal_server_tls() -> ServerTLS | None:
    """A worker's listener: mTLS with the cluster CA when internal TLS is configured, else plaintext."""
    paths = env.internal_tls()
    return ServerTLS(paths[0], paths[1], client_ca=paths[2]) if paths else None


def internal_tls_files() -> WatchedFiles | None:
    """The internal certificate, key and CA as a long-lived channel pool watches them for renewal (channel_pool.py);
    None without internal TLS."""
    paths = env.internal_tls()
    return WatchedFiles(paths) if paths else None


def internal_client_credentials() -> ClientCredentials | None:
    """What a cluster member presents when it calls another: its certificate, trusting only the cluster CA, and
    expecting the cluster's internal server name when one is configured."""
    paths = env.internal_tls()
    if not paths:
        return None
    cert, key, ca = paths
    return ClientCredentials(tls_ca=ca, tls_cert=cert, tls_key=key, server_name=env.internal_tls_server_name())
