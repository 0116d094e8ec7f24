"""How the two sides of a pair meet: the decode side's TCPStore, the sender's claim on it, the backend choice.

The decode side hosts one store per prefill peer, bound to its bind host and announced on its advertised host;
the prefill side connects to it on its first send. Both write their device and backend preference into the store
and pick the same backend: NCCL when both caches are on CUDA (and NCCL exists on both), gloo otherwise.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from pdserve.addresses import bind_first_free, join, split_host_port
from pdserve.transfer.base import PeerLostError, TransferError, TransferTimeoutError
from pdserve.transfer.pair_group import error_summary, time_left
from pdserve.transfer.store_calls import StoreSilent, within

_RECV_KEY = "pdserve/recv"  # "<receiver identity>/<peer id> <device info>"
_SEND_KEY = "pdserve/send"  # the sender's device info
_CLAIM_KEY = "pdserve/claimed"  # counts senders: only the first may use the store
# Rendezvous addresses whose claim is still running on its thread, each with the event set once its caller gave up.
_unanswered: dict[str, threading.Event] = {}
_claims_lock = threading.Lock()


def device_info(device: torch.device, backend: str) -> str:
    """What `choose_backend` needs from one side: "device preference nccl_ok", the device "cuda:<GPU uuid>" for
    a GPU. (A peer of a release before the uuid says "cuda": it then reads ours as no CUDA device, and both
    choose gloo.)"""
    nccl_ok = int(device.type == "cuda" and dist.is_nccl_available())
    kind = f"cuda:{torch.cuda.get_device_properties(device).uuid}" if device.type == "cuda" else device.type
    return f"{kind} {backend} {nccl_ok}"


def choose_backend(mine: str, theirs: str) -> str:
    """Both sides call this with the two `device_info` strings and get the same answer. NCCL needs two GPUs: a
    prefill and a decode worker sharing one (a single-GPU node) pair over gloo."""
    devices, prefs, nccl_ok = zip(*(s.split() for s in (mine, theirs)), strict=True)
    forced = set(prefs) - {"auto"}
    if len(forced) > 1:
        raise TransferError(f"backend conflict: one side wants gloo, the other nccl ({mine!r} vs {theirs!r})")
    kinds, gpus = zip(*(d.split(":", 1) if ":" in d else (d, "") for d in devices), strict=True)
    two_gpus = kinds == ("cuda", "cuda") and all(gpus) and gpus[0] != gpus[1]
    nccl_possible = two_gpus and nccl_ok == ("1", "1")
    if forced == {"nccl"} and not nccl_possible:
        raise TransferError(f"backend nccl needs two GPUs and NCCL, one each side ({mine!r} vs {theirs!r})")
    if forced == {"gloo"}:
        return "gloo"
    return "nccl" if nccl_possible else "gloo"


def open_store(
    bind_host: str, advertise_host: str, first_port: int, timeout_s: float, receiver_info: str
) -> tuple[dist.TCPStore, str]:
    """Decode side: a store bound to `bind_host` on the first free port from `first_port` on (0: any free port),
    announcing `receiver_info`; returns it and the "host:port" a sender dials (on `advertise_host`)."""
    sock = _listen(bind_host, first_port)
    port = sock.getsockname()[1]
    fd = sock.detach()  # the store owns the socket from here on
    try:
        store = dist.TCPStore(
            _self_dialable(bind_host),  # the store's own client connects here: the bind host, not the advertised
            port,
            2,
            True,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=fd,
            use_libuv=True,
        )
    except BaseException:
        with contextlib.suppress(OSError):  # the store may have closed it already
            os.close(fd)
        raise
    store.set(_RECV_KEY, receiver_info)
    return store, join(advertise_host, port)


def _self_dialable(bind_host: str) -> str:
    """Where this process reaches a socket bound to `bind_host`: loopback for a wildcard."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(bind_host, bind_host)


def _listen(host: str, first_port: int) -> socket.socket:
    """A listening socket on `host` only (TCPStore itself would listen on every interface); one store per prefill
    peer, so a fixed first port is followed by the next free ones."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET

    def listen(port: int) -> socket.socket:
        sock = socket.socket(family, socket.SOCK_STREAM)
        # A restarted decode worker takes its fixed port back at once, past its predecessor's closed connections
        # (TIME_WAIT); a port another process listens on stays refused.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen(16)
        except OSError:
            sock.close()
            raise
        return sock

    return bind_first_free(listen, first_port)


def claims(store: dist.Store) -> int:
    """Decode side: how many senders have claimed the store. More than one: the first (its prefill process's only
    sender) dropped the pair and came back, so the pair it dropped is dead, whatever its gloo sockets say."""
    return store.add(_CLAIM_KEY, 0)


def sender_info(store: dist.Store) -> str | None:
    """Decode side: the sender's `device_info` once it claimed the store, else None."""
    if not store.check([_SEND_KEY]):
        return None
    return store.get(_SEND_KEY).decode()


def listening(address: str, timeout_s: float) -> bool:
    """Whether anything accepts a connection at `address` now: tells a decode worker that restarted at the address
    of its predecessor (its store listens there again) from one that is gone (refused at once)."""
    try:
        with socket.create_connection(split_host_port(address), timeout=max(timeout_s, 0.001)):
            return True
    except OSError:
        return False


def claim_store(address: str, mine: str, deadline: float, name: str) -> tuple[dist.TCPStore, str, str]:
    """Prefill side: connects to the decode side's store and claims it with our `device_info`; returns the store,
    the receiver's identity and its `device_info`; by `deadline` even when the decode process is stopped
    (store_calls.py). While an earlier claim of `address` given up on is still unanswered, one more would only
    leave another thread waiting: it fails at once; and the earlier one, if answered late, claims nothing."""
    host, port = split_host_port(address)
    given_up = threading.Event()

    def claim() -> tuple[dist.TCPStore, str, str, int]:
        try:
            store = dist.TCPStore(
                host, port, 2, False, timeout=timedelta(seconds=max(time_left(deadline), 0.001)), use_libuv=True
            )
            identity, their_info = store.get(_RECV_KEY).decode().split(" ", 1)
            if given_up.is_set():  # its sender left: a claim now would hold the store for no one
                return store, identity, their_info, 0
            claimed = store.add(_CLAIM_KEY, 1)
            if claimed == 1:
                store.set(_SEND_KEY, mine)
            return store, identity, their_info, claimed
        finally:
            with _claims_lock:
                if _unanswered.get(address) is given_up:
                    del _unanswered[address]

    with _claims_lock:
        if address in _unanswered:
            raise TransferTimeoutError(f"{name}: an earlier claim of its rendezvous store is still unanswered")
        _unanswered[address] = given_up
    try:
        store, identity, their_info, claimed = within(claim, time_left(deadline), "kv-claim")
    except StoreSilent as e:
        given_up.set()
        raise TransferTimeoutError(f"{name}: no answer from the rendezvous store (the process stopped?): {e}") from None
    except RuntimeError as e:
        if time_left(deadline) < 0.05:
            raise TransferTimeoutError(f"{name}: timed out connecting: {error_summary(e)}") from e
        raise PeerLostError(f"{name}: cannot connect: {error_summary(e)}") from e
    if claimed != 1:
        raise TransferError(f"{name}: another sender already holds this rendezvous (one sender per process)")
    return store, identity, their_info
