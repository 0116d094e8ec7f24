"""Which host a gRPC call came from, for rights bound to it: a worker pod's drain-only key drains only the workers
of the pod it calls from (admin.py), so the key every worker pod holds cannot drain the fleet."""

from __future__ import annotations

import ipaddress
from urllib.parse import unquote


def peer_host(peer: str) -> str:
    """The IP of a gRPC peer as `context.peer()` names it ("ipv4:10.0.0.5:43210", "ipv6:%5Bfd00::7%5D:43210", its
    brackets percent-encoded as a URI's); an IPv4-mapped IPv6 address as its IPv4; "" for a peer with no IP (a Unix
    socket)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return ""
    return canonical(unquote(rest).rpartition(":")[0])


def canonical(host: str) -> str:
    """An IP literal in one spelling ("fd00:0::7" and "fd00::7", "::ffff:10.0.0.5" and "10.0.0.5" alike); a name as
    given, lower case (never resolved: a name a worker advertises is no address a caller can be seen from)."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return host.lower()
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return str(mapped or ip)
