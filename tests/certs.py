"""Throwaway test certificates, made with the `openssl` command in a test's temporary folder (never committed):
a CA, a server certificate for 127.0.0.1, a client certificate, and an internal one as the Helm chart's (it names
only INTERNAL_NAME, never an address, and serves as both server and client certificate), all signed by that CA."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

INTERNAL_NAME = "pdserve-internal"  # the chart's default tls.internalServerName


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    internal_cert: Path
    internal_key: Path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _issue(folder: Path, name: str, subject: str, extensions: str) -> tuple[Path, Path]:
    key, csr, cert, ext = (folder / f"{name}.{s}" for s in ("key", "csr", "pem", "ext"))
    ext.write_text(extensions)
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(key))
    _openssl("req", "-new", "-key", str(key), "-subj", subject, "-out", str(csr))
    ca, ca_key = str(folder / "ca.pem"), str(folder / "ca.key")
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-days", "1",
        "-out", str(cert), "-extfile", str(ext),
    )  # fmt: skip
    return cert, key


def make_certs(folder: Path) -> Certs:
    ca_key, ca = folder / "ca.key", folder / "ca.pem"
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", str(ca_key), "-out", str(ca), "-subj", "/CN=pdserve-test-ca", "-days", "1",
    )  # fmt: skip
    server = _issue(folder, "server", "/CN=127.0.0.1", "subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    client = _issue(folder, "client", "/CN=pdserve-test-client", "extendedKeyUsage=clientAuth\n")
    internal = _issue(
        folder,
        "internal",
        f"/CN={INTERNAL_NAME}",
        f"subjectAltName=DNS:{INTERNAL_NAME}\nextendedKeyUsage=serverAuth,clientAuth\n",
    )
    return Certs(ca, *server, *client, *internal)
