"""Bind vs advertised addresses: what a listener tells others to dial is never a wildcard, POD_IP wins over a
guess, a fixed port moves on to the next free one, and the KV rendezvous store binds one host and names another."""

from __future__ import annotations

import asyncio
import socket

import pytest

from pdserve.addresses import advertised_host, bind_first_free, join, primary_address, split_host_port
from pdserve.rpc.server import Server


def test_the_advertised_host_is_the_flag_then_pod_ip_then_the_bind_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POD_IP", raising=False)
    assert advertised_host("127.0.0.1") == "127.0.0.1"
    assert advertised_host("0.0.0.0") == primary_address() != "0.0.0.0"
    assert advertised_host("::") not in ("::", "0.0.0.0")
    monkeypatch.setenv("POD_IP", "10.1.2.3")
    assert advertised_host("0.0.0.0") == "10.1.2.3"
    assert advertised_host("0.0.0.0", "10.9.9.9") == "10.9.9.9"
    with pytest.raises(ValueError, match="dialable"):
        advertised_host("127.0.0.1", "0.0.0.0")


def test_ipv6_addresses_are_bracketed() -> None:
    assert join("::1", 5) == "[::1]:5" and join("10.0.0.1", 5) == "10.0.0.1:5" and join("pod-a", 5) == "pod-a:5"


def test_a_fixed_port_moves_on_to_the_next_free_one() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        first = taken.getsockname()[1]

        def bind(port: int) -> socket.socket:
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                raise
            return s

        with bind_first_free(bind, first, span=8) as other:
            assert first < other.getsockname()[1] < first + 8
        with pytest.raises(OSError, match="no free port"):
            bind_first_free(bind, first, span=1)


async def test_a_server_binds_one_host_and_advertises_another() -> None:
    server = Server("0.0.0.0", 0, advertise_host="10.20.30.40")
    assert server.address == f"10.20.30.40:{server.port}"
    with pytest.raises(OSError, match="could not bind"):  # SO_REUSEPORT off: no silent second listener
        Server("127.0.0.1", server.port)
    await asyncio.sleep(0)


def test_the_kv_rendezvous_store_binds_its_host_and_names_the_advertised_one() -> None:
    from pdserve.transfer.rendezvous import open_store

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        first = probe.getsockname()[1]
    store, address = open_store("0.0.0.0", "10.20.30.40", first, 5.0, "receiver info")
    port = int(address.rpartition(":")[2])
    assert address.startswith("10.20.30.40:") and first <= port < first + 64
    with socket.create_connection(("127.0.0.1", port), timeout=5):  # bound on every interface, loopback too
        pass
    del store


def test_a_free_port_is_held_until_its_listener_is_about_to_bind_it() -> None:
    """`pdserve up` checks its ports, then starts Ray and the workers, which bind port 0: the kernel handed one of
    them the router's port (a CI run's cluster never started: "could not bind"). Held, no other socket takes it."""
    from pdserve.addresses import hold_free, release_held

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    hold_free("127.0.0.1", port, "--port")
    try:
        with socket.socket() as other, pytest.raises(OSError):
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            other.bind(("127.0.0.1", port))
    finally:
        release_held()
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))  # released: its listener binds it


@pytest.mark.parametrize(
    ("address", "split"),
    [("10.0.0.1:50061", ("10.0.0.1", 50061)), ("[fd00::1]:50061", ("fd00::1", 50061)), ("host:1", ("host", 1))],
)
def test_split_host_port_unbrackets_an_ipv6_literal(address, split):
    assert split_host_port(address) == split


@pytest.mark.parametrize("address", ["10.0.0.1", ":50061", "host:0", "host:65536", "host:http", "host:-1"])
def test_split_host_port_refuses_what_no_socket_dials(address):
    with pytest.raises(ValueError, match="must be host:port with a port in 1..65535"):
        split_host_port(address)
