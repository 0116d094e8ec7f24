"""Two "hosts" on this machine: network namespaces of the test's own, each with an address of its own on a bridge
that the root namespace (a third host: the router's) also sits on. Needs root and `ip netns`; `unavailable()`
says why not where that is missing."""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import shutil
import subprocess
from collections.abc import Iterator


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = ["ip", *args] if netns is None else ["ip", "netns", "exec", netns, "ip", *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)


def _routes() -> str:
    return subprocess.run(["ip", "-4", "route"], check=True, capture_output=True, text=True, timeout=30).stdout


def unavailable() -> str | None:
    """None when a namespace can be made here, else the reason."""
    if shutil.which("ip") is None:
        return "no `ip` command"
    if os.geteuid() != 0:
        return "not root: `ip netns add` needs CAP_SYS_ADMIN"
    name = f"pdprobe{os.getpid()}"
    try:
        _ip("netns", "add", name)
    except subprocess.CalledProcessError as e:
        return f"`ip netns add` fails here: {e.stderr.strip()}"
    _ip("netns", "del", name)
    return None


class TwoHosts:
    """`hosts`: [(namespace, address)] for the two hosts; `gateway`: the root namespace's address beside them."""

    def __init__(self) -> None:
        # Names and a subnet no one else on the machine uses (a run killed mid-way leaves its own behind).
        tag = secrets.token_hex(2)
        self.subnet = random.choice([s for s in (f"10.213.{i}" for i in range(1, 250)) if f"{s}.0/" not in _routes()])
        self.bridge = f"pdbr{tag}"
        self.gateway = f"{self.subnet}.1"
        self.hosts = [(f"pdns{tag}{n}", f"{self.subnet}.{i + 2}") for i, n in enumerate("ab")]
        self._made: list[tuple[str, ...]] = []
        try:
            self._make()
        except BaseException:
            self.remove()
            raise

    def _make(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", "del", self.bridge))
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, (ns, address) in enumerate(self.hosts):
            veth = f"{self.bridge}v{i}"
            _ip("netns", "add", ns)
            self._made.append(("netns", "del", ns))
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", self.bridge)
            _ip("link", "set", veth, "up")
            _ip("addr", "add", f"{address}/24", "dev", "eth0", netns=ns)
            _ip("link", "set", "eth0", "up", netns=ns)
            _ip("link", "set", "lo", "up", netns=ns)

    def remove(self) -> None:
        """Deleting a namespace deletes its end of the veth, and with it the other end."""
        for args in reversed(self._made):
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip(*args)
        self._made.clear()


@contextlib.contextmanager
def slow_link(netns: str, rate: str) -> Iterator[None]:
    """Everything `netns` sends leaves at `rate` (tc's token bucket, e.g. "2mbit"): a slow link between hosts,
    so that a transfer's bytes are still on the wire seconds after it started."""
    tc = ["ip", "netns", "exec", netns, "tc", "qdisc"]
    bucket = ["tbf", "rate", rate, "burst", "16kb", "latency", "5s"]
    subprocess.run([*tc, "add", "dev", "eth0", "root", *bucket], check=True)
    try:
        yield
    finally:
        subprocess.run([*tc, "del", "dev", "eth0", "root"], check=True)
