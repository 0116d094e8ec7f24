"""Where a listener binds and what it tells others to dial: two addresses, because the first may be a wildcard
(0.0.0.0 in a container) that no other host can dial, and the second must be one they can (a pod's IP)."""

from __future__ import annotations

import argparse
import ipaddress
import socket
from collections.abc import Callable
from typing import TypeVar

from pdserve import env
from pdserve.config import MAX_WORKERS_PER_ROLE

T = TypeVar("T")
WILDCARDS = ("0.0.0.0", "::", "")
# A fixed port is the first of this many: several workers on one host (or a decode worker's rendezvous store per
# prefill peer) take the next free ones, P..P+PORT_SPAN-1.
PORT_SPAN = MAX_WORKERS_PER_ROLE


def is_wildcard(host: str) -> bool:
    return host in WILDCARDS


def advertised_host(bind_host: str, advertise_host: str | None = None) -> str:
    """The host others dial: the one asked for, else env POD_IP, else the bind host unless it is a wildcard, in
    which case this machine's primary address. Never a wildcard: nobody can dial 0.0.0.0."""
    for host in (advertise_host, env.pod_ip()):
        if host:
            if is_wildcard(host):
                raise ValueError(f"advertised host must be dialable, got {host!r}")
            return host
    return primary_address() if is_wildcard(bind_host) else bind_host


def primary_address() -> str:
    """The address this machine's default route leaves from (no packet is sent), else its hostname's address,
    else loopback: what a peer on the same network would dial."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: only the route is looked up
            return s.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def hold_free(host: str, port: int, flag: str) -> None:
    """OSError naming `flag` when `host:port` cannot be bound now (0: any free port, never taken), so a command
    fails before it starts anything rather than when its listener binds, after its workers loaded. A free one
    stays bound here until `release_held`, just before the listener binds it: the workers and Ray's processes
    started meanwhile bind port 0, and the kernel handed one of them the port (50051 is an ephemeral port too)."""
    if not port:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    probe = socket.socket(family, socket.SOCK_STREAM)
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC's listener: TIME_WAIT is no conflict
    try:
        probe.bind((host.strip("[]"), port))
        probe.listen(1)  # listening: no other socket, SO_REUSEADDR or not, binds it meanwhile
    except OSError as e:
        probe.close()
        raise OSError(f"{join(host, port)} cannot be bound ({e.strerror}); pass another {flag}") from None
    _held.append(probe)


def release_held() -> None:
    """The ports `hold_free` holds, for their listeners to bind now."""
    while _held:
        _held.pop().close()


_held: list[socket.socket] = []


def host_port(value: str) -> str:
    """An --addr flag's value, checked: gRPC would dial a bare host on port 443, and read `http://h:p` as a host
    named so (`Misformatted domain name`)."""
    if value.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"{value!r} is a URL: give the router's gRPC HOST:PORT (its --port)")
    host, colon, port = value.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{value!r} is not HOST:PORT (gRPC would dial port 443)")
    return value


def host_of(address: str) -> str:
    """The host of a host:port, an IPv6 literal without its brackets, as a pod IP reads ("[fd00::1]:50061" ->
    "fd00::1")."""
    return address.rpartition(":")[0].strip("[]")


def split_host_port(address: str) -> tuple[str, int]:
    """The host (an IPv6 literal without its brackets) and port of a host:port; ValueError unless the port is one a
    socket can dial."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"must be host:port with a port in 1..65535, got {address!r}")
    return host.strip("[]"), int(port)


def join(host: str, port: int) -> str:
    """host:port, an IPv6 literal in brackets."""
    try:
        v6 = ipaddress.ip_address(host).version == 6
    except ValueError:
        v6 = False
    return f"[{host}]:{port}" if v6 else f"{host}:{port}"


def candidate_ports(first: int, span: int = PORT_SPAN) -> list[int]:
    """The ports to try in order: [0] (the OS picks) for 0, else `first` and the ones after it."""
    return [0] if first == 0 else list(range(first, min(first + max(span, 1), 65536)))


def bind_first_free(bind: Callable[[int], T], first: int, span: int = PORT_SPAN) -> T:
    """`bind(port)` on the first candidate port that is free (`bind` raises OSError for a taken one)."""
    error: OSError | None = None
    for port in candidate_ports(first, span):
        try:
            return bind(port)
        except OSError as e:
            error = e
    raise OSError(f"no free port from {first} ({span} tried): {error}")
