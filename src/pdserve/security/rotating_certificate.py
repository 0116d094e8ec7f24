"""A listener's certificate, key and the CAs its clients' certificates must chain to, read again when the files
change (cert-manager renewing a Secret): new handshakes get the new ones, connections already up keep theirs,
and no restart drops a stream.

A change is taken only once Python's `ssl` accepts it (the key matches the certificate, every PEM parses): a
half-written file or a mismatched pair leaves the listener serving the last good set, with one error logged per
bad change. The same set serves both listeners of the router, gRPC (`grpc_fetcher`, asked by gRPC on each
handshake) and HTTP (`sni_callback`, which ssl calls on each handshake, SNI or not).
"""

from __future__ import annotations

import contextlib
import logging
import os
import ssl
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grpc

from pdserve.security.watched_files import POLL_INTERVAL_S, Contents, WatchedFiles

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CertificateSet:
    """One version of the files. `context`: a server context made of them; building it is what checks them."""

    cert: bytes
    key: bytes
    roots: bytes | None  # the client CAs, one PEM bundle; None: no client certificate asked for
    context: ssl.SSLContext

    def grpc_configuration(self) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(self.key, self.cert)], root_certificates=self.roots)


def certificate_set(contents: Contents) -> CertificateSet:
    """The set of a certificate's, its key's and its client CAs' bytes (in that order); ssl.SSLError or
    ValueError when they do not make one."""
    cert, key, *cas = contents
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with _in_memory(cert) as cert_path, _in_memory(key) as key_path:
        context.load_cert_chain(cert_path, key_path, password=_no_password)
    for ca in cas:  # each on its own: an emptied one (rewritten in place) must not pass beside a good one
        with _in_memory(ca) as ca_path:
            context.load_verify_locations(cafile=ca_path)  # no certificate in it: ssl.SSLError
    if cas:
        context.verify_mode = ssl.CERT_REQUIRED
    return CertificateSet(cert, key, b"\n".join(cas) or None, context)


def _no_password() -> bytes:
    """An encrypted key fails to load, as gRPC fails on one, rather than OpenSSL asking for its password on a TTY."""
    return b""


@contextlib.contextmanager
def _in_memory(data: bytes) -> Iterator[str]:
    """A path that reads as `data` and never lands on a disk: `ssl` loads a key from a path only."""
    fd = os.memfd_create("pdserve-tls")
    try:
        with open(fd, "wb", closefd=False) as f:
            f.write(data)
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


class RotatingCertificate:
    """`current`: the last good set of `cert`, `key` and `client_cas`, looked at again at most every
    `interval_s`. A bad set at start raises (the listener would serve nothing), as it did before rotation."""

    def __init__(
        self, cert: str, key: str, client_cas: Sequence[str] = (), interval_s: float = POLL_INTERVAL_S
    ) -> None:
        self._files = WatchedFiles([cert, key, *client_cas], interval_s)
        self.current = certificate_set(self._files.initial)
        self.requires_client_certificate = bool(client_cas)  # fixed for the listener's life
        self._refreshing = threading.Lock()

    def refresh(self) -> CertificateSet | None:
        """The new set when the files changed to a good one; None when they did not, or not to a good one (then
        one error, and `current` stays). One at a time: gRPC asks from several threads, and a change built slowly
        must not be set after a later one."""
        with self._refreshing:
            return self._refresh()

    def _refresh(self) -> CertificateSet | None:
        change = self._files.changed()
        if change is None:
            return None
        try:
            if isinstance(change, OSError):
                raise change
            new = certificate_set(change)
        except (OSError, ssl.SSLError, ValueError) as e:
            log.error(
                "TLS certificate %s changed, but not to a usable certificate, key and CA (%s); still serving the "
                "previous one",
                self._files.paths[0],
                e,
            )
            return None
        self.current = new
        log.info("TLS certificate reloaded from %s: new handshakes get it", self._files.paths[0])
        return new

    def grpc_fetcher(self) -> grpc.ServerCertificateConfiguration | None:
        """For `grpc.dynamic_ssl_server_credentials`: a new configuration, or None to keep the one it has."""
        new = self.refresh()
        return None if new is None else new.grpc_configuration()

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self.current.grpc_configuration(), self.grpc_fetcher, self.requires_client_certificate
        )

    def sni_callback(self, connection: ssl.SSLObject | ssl.SSLSocket, server_name: str | None, _: object) -> None:
        """For an `ssl.SSLContext` listener: moves each new connection onto the current set's context (its
        certificate and the CAs its client's is checked against)."""
        self.refresh()
        connection.context = self.current.context
