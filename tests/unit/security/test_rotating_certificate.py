"""A listener's certificate read again when its files change: a good change is taken, a bad one (a key of
another certificate, a half-written PEM) leaves the last good set, with one error per change."""

from __future__ import annotations

import logging
import shutil
import socket
import ssl
import threading
from pathlib import Path

import pytest

from pdserve.security.rotating_certificate import RotatingCertificate
from tests.certs import Certs, make_certs


def _certs(folder: Path) -> Certs:
    folder.mkdir()
    return make_certs(folder)


def test_a_mismatched_pair_keeps_the_previous_certificate_and_logs_once(tmp_path: Path, caplog) -> None:
    a, b = _certs(tmp_path / "a"), _certs(tmp_path / "b")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copy(a.server_cert, cert)
    shutil.copy(a.server_key, key)
    rotating = RotatingCertificate(str(cert), str(key), interval_s=0)
    first = rotating.current
    shutil.copy(b.server_cert, cert)  # b's certificate, a's key: a write caught half-way
    with caplog.at_level(logging.ERROR, logger="pdserve.security.rotating_certificate"):
        assert rotating.refresh() is None and rotating.grpc_fetcher() is None
    assert rotating.current is first
    assert [r.getMessage() for r in caplog.records if "KEY_VALUES_MISMATCH" in r.getMessage()] != []
    assert len(caplog.records) == 1
    shutil.copy(b.server_key, key)
    assert rotating.grpc_fetcher() is not None
    assert rotating.current.cert == b.server_cert.read_bytes()


def test_a_client_ca_is_checked_at_start_and_rotates_too(tmp_path: Path) -> None:
    a = _certs(tmp_path / "a")
    rotating = RotatingCertificate(str(a.server_cert), str(a.server_key), [str(a.ca)])
    assert rotating.requires_client_certificate and rotating.current.context.verify_mode == ssl.CERT_REQUIRED
    ca = tmp_path / "ca.pem"
    ca.write_bytes(a.ca.read_bytes()[:100])  # a PEM cut short
    with pytest.raises(ssl.SSLError):
        RotatingCertificate(str(a.server_cert), str(a.server_key), [str(ca)])
    shutil.copy(a.ca, ca)
    rotating = RotatingCertificate(str(a.server_cert), str(a.server_key), [str(ca)], interval_s=0)
    b = _certs(tmp_path / "b")
    shutil.copy(b.ca, ca)  # the client CA rotated: clients' certificates are checked against b's from now on
    assert rotating.refresh() is not None and rotating.current.roots == b.ca.read_bytes()


def test_an_emptied_ca_file_beside_a_good_one_keeps_the_previous_set(tmp_path: Path) -> None:
    """A CA file rewritten in place reads empty for a moment: taken, it would drop that CA's clients (or, alone,
    every client: a listener that requires certificates would trust none)."""
    a = _certs(tmp_path / "a")
    public, cluster = tmp_path / "client-ca.pem", tmp_path / "cluster-ca.pem"
    shutil.copy(a.ca, public)
    shutil.copy(a.ca, cluster)
    rotating = RotatingCertificate(str(a.server_cert), str(a.server_key), [str(public), str(cluster)], interval_s=0)
    first = rotating.current
    public.write_bytes(b"")
    assert rotating.refresh() is None and rotating.current is first
    shutil.copy(a.ca, public)
    assert rotating.refresh() is not None


def _handshake(server: ssl.SSLContext, client_certs: Certs, server_ca: Path) -> bool:
    """Whether `server` (as the HTTP listener uses it) accepts a client presenting `client_certs`' certificate."""
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.load_verify_locations(server_ca)
    client.load_cert_chain(client_certs.client_cert, client_certs.client_key)
    accepted: list[bool] = []
    with socket.create_server(("127.0.0.1", 0)) as listener:

        def serve() -> None:
            conn, _ = listener.accept()
            try:
                with server.wrap_socket(conn, server_side=True) as tls:
                    tls.sendall(b"ok")
                accepted.append(True)
            except (ssl.SSLError, OSError):
                accepted.append(False)

        thread = threading.Thread(target=serve)
        thread.start()
        with socket.create_connection(listener.getsockname()) as raw:
            try:
                with client.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                    tls.recv(2)  # TLS 1.3 reports a refused client certificate on the first read
            except (ssl.SSLError, OSError):
                pass
        thread.join(10)
    return accepted == [True]


def test_a_rotated_client_ca_decides_the_next_handshake_on_the_http_listeners_context(tmp_path: Path) -> None:
    """The HTTP listener keeps the context it was started with (its verify mode) and moves each connection onto the
    current set's in the SNI callback: clients are checked against the CA the files hold now."""
    a, b = _certs(tmp_path / "a"), _certs(tmp_path / "b")
    ca = tmp_path / "client-ca.pem"
    shutil.copy(a.ca, ca)
    rotating = RotatingCertificate(str(a.server_cert), str(a.server_key), [str(ca)], interval_s=0)
    listener = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)  # as uvicorn builds it from the files at start
    listener.load_cert_chain(a.server_cert, a.server_key)
    listener.load_verify_locations(ca)
    listener.verify_mode = ssl.CERT_REQUIRED
    listener.sni_callback = rotating.sni_callback
    assert _handshake(listener, a, a.ca) and not _handshake(listener, b, a.ca)
    shutil.copy(b.ca, ca)
    assert _handshake(listener, b, a.ca) and not _handshake(listener, a, a.ca)
