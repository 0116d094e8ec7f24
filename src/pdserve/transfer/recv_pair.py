"""The decode side of one pair: its store, the recvs waiting on it by tag, and whether a header fits them."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from pdserve.addresses import split_host_port
from pdserve.transfer.base import LayoutMismatchError, PeerLostError, TransferError
from pdserve.transfer.blocks import Blocks
from pdserve.transfer.layout import KVLayout
from pdserve.transfer.pair_group import PairGroup, time_left
from pdserve.transfer.rendezvous import choose_backend, claims, open_store, sender_info
from pdserve.transfer.wire import BLOCK_COUNT, FORGED, LAYOUT, NOT_EXPECTED, OK, Header, block_bytes, layout_mask

log = logging.getLogger(__name__)

_WAITING, _RECEIVING, _FINISHED = range(3)
WATCH_TIMEOUT = timedelta(seconds=0.5)  # a rendezvous's one question to its own store, on this host
# Tags whose recv gave up, so a late sender is refused at once; only the latest are kept.
_MAX_ABANDONED = 4096


class Pending:
    """One recv waiting for its tag; the serving thread fills it in. `deadline` bounds the wait for its transfer
    to start; the claim moves it to `timeout_s` from then, the bytes' own budget: a transfer that started just
    before the first deadline (queued behind others on the pair) is not cut mid-way, which costs the pair."""

    def __init__(
        self, tag: int, kv_caches: Sequence[torch.Tensor], blocks: Blocks, layout: KVLayout, timeout_s: float
    ) -> None:
        self.tag, self.kv_caches, self.blocks, self.layout = tag, kv_caches, blocks, layout
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.state = _WAITING
        self.done = threading.Event()
        self.error: TransferError | None = None
        self.nbytes = 0


class RecvPair:
    """`info` is this side's `device_info`; `identity` tells the sender which receiver (and pair) it reached."""

    def __init__(
        self, peer_id: str, host: str, identity: str, info: str, connect_timeout_s: float, bind_host: str, port: int
    ) -> None:
        self.peer_id = peer_id
        self.info = info
        self.store, self.address = open_store(bind_host, host, port, connect_timeout_s, f"{identity}/{peer_id} {info}")
        self.cond = threading.Condition()
        self.pending: dict[int, Pending] = {}
        self.abandoned: OrderedDict[int, None] = OrderedDict()
        self.error: TransferError | None = None
        self.closed = False
        self.last_rendezvous = time.monotonic()  # a hand-off handed out its address: a sender may come
        self._watch: dist.TCPStore | None = None  # a client of the store for `dropped_by_sender`

    def accept(
        self, gloo_device: object, device: torch.device, timeout_s: float, name: str, unclaimed_s: float
    ) -> PairGroup | None:
        """Serving thread: waits for the sender to claim the store, then builds the group; None once no sender
        claimed it within `unclaimed_s` of its last rendezvous and no recv waits (its prefill worker is gone, or
        every hand-off to it ended before a transfer): the caller decides, against a rendezvous just then."""
        while (theirs := sender_info(self.store)) is None:
            if self.closed:
                raise TransferError(f"{name}: receiver closed")
            if self.unclaimed(unclaimed_s):
                return None
            time.sleep(0.02)
        backend = choose_backend(self.info, theirs)
        group = PairGroup.build(self.store, 1, gloo_device, backend, device, timeout_s, name)
        log.debug("kv receiver: pair with %s over %s", self.peer_id, backend)
        return group

    def unclaimed(self, unclaimed_s: float) -> bool:
        with self.cond:
            return not self.pending and time.monotonic() - self.last_rendezvous > unclaimed_s

    def dropped_by_sender(self) -> bool:
        """Its sender claimed the store again (`claims`): it dropped this pair (a liveness check that timed out on
        a paused decode process, say), and gloo notices only once the sender's sockets close, at its next garbage
        collection; a rendezvous meanwhile must hand out a fresh pair, not this store, which refuses the claim.
        Asked over a client of its own: the pair's is the serving thread's, which gloo may hold for as long as
        its connect timeout while it builds the group with a slow sender."""
        if self.store is None:
            return False
        try:
            watch = self._watch  # read once: `close_store`, on another thread, may clear it meanwhile
            if watch is None:
                host, port = split_host_port(self.address)
                watch = self._watch = dist.TCPStore(host, port, is_master=False, timeout=WATCH_TIMEOUT, use_libuv=True)
            return claims(watch) > 1
        except RuntimeError:  # a store that cannot answer now: the serving thread finds out
            return False

    def close_store(self) -> None:
        """A pair that never paired: its store (and listening port) goes now, not whenever the garbage collector
        reaches a traceback that still holds the pair."""
        self.store = None  # type: ignore[assignment]
        self._watch = None

    def register(self, p: Pending) -> None:
        with self.cond:
            if self.error is not None:
                raise type(self.error)(str(self.error))
            if p.tag in self.pending:
                raise ValueError(f"tag {p.tag} already has a recv waiting on peer {self.peer_id!r}")
            self.abandoned.pop(p.tag, None)
            self.pending[p.tag] = p
            self.cond.notify_all()

    def claim(self, tag: int, wait_s: float) -> Pending | None:
        """Serving thread: the recv waiting for `tag`, its deadline now its bytes' (`Pending`), or None when it
        gave up or never comes."""
        deadline = time.monotonic() + wait_s
        with self.cond:
            while True:
                p = self.pending.get(tag)
                if p is not None and p.state == _WAITING:
                    p.state = _RECEIVING
                    p.deadline = time.monotonic() + p.timeout_s
                    return p
                if tag in self.abandoned or self.error is not None or self.closed or time_left(deadline) <= 0:
                    return None
                self.cond.wait(time_left(deadline))

    def drain_deadline(self, header: Header, name: str) -> float:
        """Until when a transfer no recv takes is drained. A header whose MAC fails is drained (the pair stays in
        step for the real transfer behind it) only when it costs no more than a transfer this pair awaits: a
        waiting recv's layers and block size, at most its blocks, by its deadline. Else its sizes are the sender's
        word alone: a protocol error (PeerLostError: the pair goes)."""
        if header.authentic:
            return time.monotonic() + header.timeout_ms / 1000
        with self.cond:
            deadlines = [
                p.deadline
                for p in self.pending.values()
                if header.num_layers == p.layout.num_layers
                and header.block_bytes == block_bytes(p.layout)
                and header.num_blocks <= p.blocks.n
            ]
        if not deadlines:
            raise PeerLostError(f"{name}: protocol error: a header whose MAC fails, sized as no awaited transfer")
        return max(deadlines)

    def abandon(self, p: Pending) -> bool:
        """recv's caller gave up; True when the serving thread had not started on it (nothing will write)."""
        with self.cond:
            if p.state != _WAITING:
                return False
            self._remove(p)
            self._refuse(p.tag)
            return True

    def cancel(self, tag: int, error: TransferError) -> None:
        """The recv waiting for `tag` fails with `error` now, unless the serving thread already receives it. With
        no recv posted yet (its caller left before it), a transfer for `tag` is refused at once: the serving
        thread would wait half its timeout for the recv, and every transfer of the pair behind it."""
        with self.cond:
            p = self.pending.get(tag)
            if p is None:
                self._refuse(tag)
                return
            if not self.abandon(p):
                return
        self.finish(p, error=error)

    def _refuse(self, tag: int) -> None:
        """Under `cond`: a sender's transfer for `tag` finds no recv, now or later (a claim waiting on it wakes)."""
        self.abandoned[tag] = None
        while len(self.abandoned) > _MAX_ABANDONED:
            self.abandoned.popitem(last=False)
        self.cond.notify_all()

    def finish(self, p: Pending, nbytes: int = 0, error: TransferError | None = None) -> None:
        with self.cond:
            self._remove(p)
            p.nbytes, p.error, p.state = nbytes, error, _FINISHED
        p.done.set()

    def _remove(self, p: Pending) -> None:
        if self.pending.get(p.tag) is p:
            del self.pending[p.tag]

    def fail(self, error: TransferError) -> None:
        """The pair is dead: every waiting recv raises `error`; a receiving one is finished by the serving thread."""
        with self.cond:
            self.error = self.error or error
            waiting = [p for p in self.pending.values() if p.state == _WAITING]
            self.cond.notify_all()
        for p in waiting:
            self.finish(p, error=error)


def check_header(p: Pending | None, header: Header, name: str) -> tuple[int, int, TransferError | None]:
    """The status to send back (code, detail) and the error for the recv, if any. A header whose MAC fails was
    never matched to a recv (`p` is None): the recv its tag names keeps waiting for the real one."""
    if not header.authentic:
        log.warning("%s: refused a KV transfer whose header MAC does not verify (tag %d)", name, header.tag)
        return FORGED, 0, None
    if p is None:
        return NOT_EXPECTED, 0, None
    theirs = header.layout(p.layout)
    diffs = p.layout.mismatches(theirs)
    if diffs:
        try:
            p.layout.check_compatible(theirs)
        except LayoutMismatchError as e:
            return LAYOUT, layout_mask(diffs), LayoutMismatchError(f"{name}, tag {p.tag}: {e}")
    if header.block_bytes != block_bytes(p.layout):
        # Same layout by the hashes, other sizes: never post a receive of the wrong size (gloo aborts on that).
        return LAYOUT, 0, LayoutMismatchError(f"{name}, tag {p.tag}: block size {header.block_bytes} B differs")
    if header.num_blocks != p.blocks.n:
        msg = f"{name}, tag {p.tag}: sender has {header.num_blocks} blocks, we reserved {p.blocks.n}"
        return BLOCK_COUNT, p.blocks.n, TransferError(msg)
    return OK, 0, None
