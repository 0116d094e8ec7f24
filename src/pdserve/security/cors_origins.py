"""Which web origins a browser may call the HTTP API from (CORS), checked at start: an origin is compared with the
`Origin` header as a string, so one written otherwise than a browser sends it (a path, a capital letter, a default
port) would never match, and a combination the CORS spec forbids would fail in every browser. Both are refused,
naming what to write instead. `scheme://*.domain[:port]` allows every host under `domain` (preview deployments,
one origin per branch), matched by `subdomain_pattern`."""

from __future__ import annotations

import re
from collections.abc import Sequence

ANY_ORIGIN = "*"
# scheme://host[:port] as a browser serializes it: lowercase, an IPv6 host in brackets, an IDN host in punycode.
_ORIGIN = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*)://(?P<host>[a-z0-9.-]+|\[[0-9a-f:.]+\])(?::(?P<port>[0-9]+))?")
_DEFAULT_PORTS = {"http": "80", "https": "443"}
SUBDOMAINS = "*."  # `https://*.example.com`: any host under example.com, at any depth, not example.com itself
_LABEL = "[a-z0-9_-]+"  # one DNS label of a host a browser sends (lowercase, punycode)


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


def subdomain_pattern(origins: Sequence[str]) -> str | None:
    """A regular expression that `Origin` headers from hosts under the `*.` origins of `origins` fullmatch (checked
    ones); None when there are none."""
    patterns = []
    for origin in origins:
        scheme, _, host = origin.partition("://")
        if host.startswith(SUBDOMAINS):
            patterns.append(f"{re.escape(scheme)}://(?:{_LABEL}\\.)+{re.escape(host.removeprefix(SUBDOMAINS))}")
    return "|".join(patterns) or None


def _check_origin(origin: str) -> None:
    if origin == "null":  # what a sandboxed iframe or a local file sends, whatever site it came from
        raise ValueError("'null' cannot be allowed: sandboxed frames and local files of any site send it")
    written = origin.strip().lower().rstrip("/")
    _, _, host = written.partition("://")
    wildcard = SUBDOMAINS if host.startswith(SUBDOMAINS) else ""
    if wildcard:
        _check_subdomains(origin, host.removeprefix(wildcard))
    written = written.replace(f"://{wildcard}", "://", 1)  # checked as the origin of the domain itself
    match = _ORIGIN.fullmatch(written)
    if match is None:
        raise ValueError(f"{origin!r} is no origin: scheme://host[:port], with no path, query or user")
    port = match["port"]
    if port is not None and not 0 < int(port) < 65536:
        raise ValueError(f"{origin!r} has no valid port")
    if port is not None:  # a browser writes the port as a plain number, and leaves the scheme's default one out
        host = written[: -len(port) - 1]
        written = host if str(int(port)) == _DEFAULT_PORTS.get(match["scheme"]) else f"{host}:{int(port)}"
    written = written.replace("://", f"://{wildcard}", 1)
    if written != origin:
        raise ValueError(f"{origin!r} is never sent so by a browser: write {written!r}")


def _check_subdomains(origin: str, domain: str) -> None:
    """`*.` needs a domain of two labels at least: `https://*.com` would allow every site of a top-level domain."""
    name = domain.partition(":")[0]
    if "*" in domain or name.startswith("[") or name.count(".") < 1 or name.replace(".", "").isdigit():
        raise ValueError(
            f"{origin!r} is no origin: '*.' allows the hosts under one domain of two labels at least "
            "(https://*.example.com), and stands only before it"
        )
