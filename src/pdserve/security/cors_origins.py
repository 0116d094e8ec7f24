"""Which web origins a browser may call the HTTP API from (CORS), checked at start: an origin is compared with the
`Origin` header as a string, so one written otherwise than a browser sends it (a path, a capital letter, a default
port) would never match, and a combination the CORS spec forbids would fail in every browser. Both are refused,
naming what to write instead."""

from __future__ import annotations

import re
from collections.abc import Sequence

ANY_ORIGIN = "*"
# scheme://host[:port] as a browser serializes it: lowercase, an IPv6 host in brackets, an IDN host in punycode.
_ORIGIN = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*)://(?P<host>[a-z0-9.-]+|\[[0-9a-f:.]+\])(?::(?P<port>[0-9]+))?")
_DEFAULT_PORTS = {"http": "80", "https": "443"}


def check_cors_origins(origins: Sequence[str], allow_credentials: bool) -> None:
    """ValueError, its text to follow the setting's name, for the first bad origin or a forbidden combination."""
    if ANY_ORIGIN in origins and allow_credentials:
        raise ValueError(
            "'*' cannot go with credentials: the CORS spec forbids it and browsers refuse such a response; list the "
            "origins that may send credentials"
        )
    if ANY_ORIGIN in origins and len(origins) > 1:
        raise ValueError(f"'*' already allows every origin: give it alone, got {list(origins)}")
    for origin in origins:
        if origin != ANY_ORIGIN:
            _check_origin(origin)


def _check_origin(origin: str) -> None:
    if origin == "null":  # what a sandboxed iframe or a local file sends, whatever site it came from
        raise ValueError("'null' cannot be allowed: sandboxed frames and local files of any site send it")
    written = origin.strip().lower().rstrip("/")
    match = _ORIGIN.fullmatch(written)
    if match is None:
        raise ValueError(f"{origin!r} is no origin: scheme://host[:port], with no path, query or user")
    port = match["port"]
    if port is not None and not 0 < int(port) < 65536:
        raise ValueError(f"{origin!r} has no valid port")
    if port is not None:  # a browser writes the port as a plain number, and leaves the scheme's default one out
        host = written[: -len(port) - 1]
        written = host if str(int(port)) == _DEFAULT_PORTS.get(match["scheme"]) else f"{host}:{int(port)}"
    if written != origin:
        raise ValueError(f"{origin!r} is never sent so by a browser: write {written!r}")
