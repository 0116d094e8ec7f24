"""KV transfer over one torch.distributed pair group per (prefill, decode) pair: gloo, or NCCL between CUDA caches.

The decode side (rank 1) hosts a store per prefill peer (`rendezvous.py`); the prefill side (rank 0) connects to
it on its first send. One transfer at a time goes over a pair, in the order the sender starts them (a lock on the
sender, one serving thread on the receiver), so several concurrent transfers share a pair safely:
  1. sender -> receiver, control: the header (`wire.py`): tag, block count, layout, bytes per block, segments, timeout
  2. sender -> receiver, data: layer by layer, keys then values, a message per segment of the block list
     (`pipeline.py`), each straight from / into the cache or staged (`blocks.py`)
  3. receiver -> sender, control: status: the blocks are in place, or why not (layout mismatch, no recv waiting
     for that tag, block count); a rejected transfer's messages are received and discarded
The caller's tag travels in the header, and the receiver hands the transfer to the `recv` waiting for that tag.
The receiver keeps a header receive posted between transfers, which is what notices a dead sender at once.
A timeout during steps 1-3 drops the pair (gloo closes it), and with it every transfer queued on it, so a deadline
only keeps a transfer from starting: the send's bounds its wait for the pair's turn, the recv's the wait for its
header to be claimed (a `recv` that times out then leaves the pair intact). Steps 1-3 get the transfer's timeout
of their own, from when the sender posts the header and from when the receiver claims it: a transfer that waited
behind others on the pair for most of its timeout is not cut mid-way. Both sides use the decode side's timeout and
the claim comes after the header left, so the receiver never gives up on bytes its sender still sends; a silent
peer fails the transfer at that deadline (gloo's wait), a dead one at once. A transfer ends within about twice its
timeout.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from typing import Generic, Literal, TypeVar

import torch

from pdserve.transfer.base import (
    KVCaches,
    KVReceiver,
    KVSender,
    PeerLostError,
    PeerSilentError,
    TransferCancelledError,
    TransferError,
    TransferTimeoutError,
)
from pdserve.transfer.blocks import Blocks
from pdserve.transfer.layout import KVLayout
from pdserve.transfer.pair_group import PairGroup, as_transfer_error, error_summary, gloo_device, time_left
from pdserve.transfer.pipeline import Staging, receive_messages
from pdserve.transfer.recv_pair import Pending, RecvPair, check_header
from pdserve.transfer.rendezvous import device_info, listening
from pdserve.transfer.send_pair import SendPair, rejection
from pdserve.transfer.send_start import SendStart
from pdserve.transfer.wire import HEADER_LEN, OK, Header, check_tag

Backend = Literal["auto", "gloo", "nccl"]
_MAX_CANCELLED = 4096  # (peer, tag) of recvs cancelled before they were posted; only the latest are kept
_MAX_LOST = 1024  # peers whose pair died, with why: only the latest are kept (prefill workers come and go for good)
# A receive pair no sender claimed this long after its last rendezvous is dropped: far past the router's
# first-token bound (60 s by default), within which a live prefill worker connects to send a hand-off's KV.
UNCLAIMED_PAIR_S = 300.0
PairT = TypeVar("PairT", SendPair, RecvPair)


class _Endpoint(Generic[PairT]):
    """What both ends keep: `host` is this worker's advertised address, the one gloo binds and announces (gloo
    announces the address it listens on, so it must be this host's own, never a wildcard); on the decode side each
    pair's store binds `bind_host` (default `host`) on `store_port` or the next free ports (0: any) and is
    announced on `host`; `device` is where the caches live; `model_fingerprint` goes into the layout both sides
    compare."""

    def __init__(
        self,
        host: str,
        device: torch.device | str = "cpu",
        model_fingerprint: str = "",
        backend: Backend = "auto",
        connect_timeout_s: float = 30.0,
        pipeline_bytes: int = 32 << 20,
        secret: bytes = b"",
        bind_host: str | None = None,
        store_port: int = 0,
    ) -> None:
        self.host = host
        self.secret = secret  # the cluster secret: keys the control header's MAC (wire.py)
        self.bind_host = bind_host or host
        self.store_port = store_port
        self.device = torch.device(device)
        self.fingerprint = model_fingerprint
        self.backend = backend
        self.connect_timeout_s = connect_timeout_s
        self.pipeline_bytes = pipeline_bytes
        self._gloo_device = gloo_device(host)
        self._lock = threading.Lock()
        self._pairs: dict[str, PairT] = {}
        self._closed = False
        self._init_side()

    def _init_side(self) -> None:
        """The state only one side keeps."""

    def _checked(
        self, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], tag: int, distinct: bool
    ) -> tuple[KVLayout, Blocks]:
        """What both sides check before a transfer: caches on this endpoint's device, a valid tag, the block ids
        (which the receiver, writing into them, needs distinct)."""
        if kv_caches[0].device.type != self.device.type:
            raise ValueError(f"caches are on {kv_caches[0].device}, this endpoint was built for {self.device}")
        check_tag(tag)
        layout = KVLayout.from_caches(kv_caches, self.fingerprint)
        return layout, Blocks.from_ids(block_ids, kv_caches[0], distinct=distinct)


class TorchDistSender(_Endpoint[SendPair], KVSender):
    """Prefill side (rank 0 of every pair)."""

    def _init_side(self) -> None:
        self._connecting: dict[str, threading.Lock] = {}

    def send(
        self,
        rendezvous: str,
        tag: int,
        kv_caches: KVCaches,
        block_ids: Sequence[int],
        timeout_s: float,
        start: SendStart | None = None,
    ) -> int:
        layout, blocks = self._checked(kv_caches, block_ids, tag, distinct=False)
        if blocks.n == 0:
            return 0  # the receiver short-circuits an empty transfer the same way
        # Bounds the wait for the pair's turn; once it comes, the transfer on the wire gets `timeout_s` of its own.
        pair = self._answering_pair(rendezvous, tag, time.monotonic() + timeout_s, start or SendStart())
        try:
            code, detail = pair.transfer(tag, kv_caches, blocks, layout, timeout_s, self.pipeline_bytes, self.secret)
        except BaseException as e:
            self._drop(pair)
            if isinstance(e, RuntimeError) and not isinstance(e, TransferError):
                raise PeerLostError(f"decode side {rendezvous}: {error_summary(e)}") from e
            raise
        finally:
            pair.lock.release()
        if code == OK:
            return layout.bytes_for(blocks.n)
        raise rejection(code, detail, f"decode side {rendezvous} rejected tag {tag}", layout, blocks.n)

    def _answering_pair(self, rendezvous: str, tag: int, deadline: float, start: SendStart) -> SendPair:
        """The pair for `rendezvous`, locked for one transfer, its decode side checked alive (one store round trip:
        gloo does not always notice a decode worker that died while the pair sat idle). A pair whose decode process
        is gone is dropped (here, or by a concurrent send or the prune); while a process listens at its address (a
        decode worker restarted on a fixed transfer port) the send takes or connects the pair with it, else it
        fails at once. A decode process that does not answer (stopped, starved) keeps its pair: the transfer waits
        for it within its deadline. Dropped, the pair could not be claimed again once the process resumed, and
        every hand-off sent to its address failed (a review saw three of three lost to a 3 s pause)."""
        while True:
            pair = self._pair(rendezvous, deadline)
            if not pair.lock.acquire(timeout=max(time_left(deadline), 0)):
                raise TransferTimeoutError(f"tag {tag}: timed out waiting for earlier transfers to {rendezvous}")
            lost, handed = PeerLostError(f"decode side {rendezvous}: pair dropped by a concurrent failure"), False
            try:
                if not pair.broken:
                    pair.check_peer(max(time_left(deadline), 0.001))
                    start.begin()  # TransferCancelledError when its caller called it off meanwhile
                    handed = True
                    return pair  # locked: the caller releases it
            except PeerSilentError as e:
                raise TransferTimeoutError(f"tag {tag}: {e}") from None
            except PeerLostError as e:
                lost = PeerLostError(str(e))  # not `e`: its traceback would keep the dropped pair (its sockets) alive
                self._drop(pair)
            finally:
                if not handed:
                    pair.lock.release()
            if not listening(rendezvous, min(time_left(deadline), self.connect_timeout_s)):
                raise lost

    def _pair(self, rendezvous: str, deadline: float) -> SendPair:
        """The live pair for `rendezvous`, connecting it first; one thread connects, the others wait for it."""
        with self._lock:
            if self._closed:
                raise TransferError("sender is closed")
            pair = self._pairs.get(rendezvous)
            if pair is not None:
                return pair
            connecting = self._connecting.setdefault(rendezvous, threading.Lock())
        if not connecting.acquire(timeout=max(time_left(deadline), 0)):
            raise TransferTimeoutError(f"decode side {rendezvous}: timed out waiting for the pair to connect")
        try:
            with self._lock:
                if rendezvous in self._pairs:
                    return self._pairs[rendezvous]
            connect_deadline = min(deadline, time.monotonic() + self.connect_timeout_s)
            pair = SendPair.connect(rendezvous, self.device, self.backend, self._gloo_device, connect_deadline)
            with self._lock:
                stale = [p for p in self._pairs.values() if p.identity == pair.identity]
                for p in stale:  # the decode side re-created our pair: the old one is dead
                    del self._pairs[p.rendezvous]
                    p.close()
                self._pairs[rendezvous] = pair
                self._connecting.pop(rendezvous, None)  # waiters find the pair; on failure they retry
            threading.Thread(target=self._drop_dead_pairs, args=(pair,), name="kv-send-prune", daemon=True).start()
            return pair
        finally:
            connecting.release()

    def _drop_dead_pairs(self, new: SendPair) -> None:
        """Drops the pairs of decode processes that are gone. A new pair means a decode worker joined or restarted,
        at a new address: nothing sends to its predecessor's again, whose pair (a process group, its sockets and
        thread) would otherwise stay for this worker's life. A pair busy with a transfer is alive or finds out. A
        silent one stays: dropped, it could not be claimed again once its process resumed."""
        with self._lock:
            pairs = [p for p in self._pairs.values() if p is not new]
        for pair in pairs:
            if not pair.lock.acquire(blocking=False):
                continue
            try:
                pair.check_peer(refusal_first=True)
            except PeerLostError:
                self._drop(pair)
            except PeerSilentError:  # stopped or starved, it may resume; a host gone silent errs once TCP gives up
                pass
            finally:
                pair.lock.release()

    def _drop(self, pair: SendPair) -> None:
        with self._lock:
            pair.broken = True
            if self._pairs.get(pair.rendezvous) is pair:
                del self._pairs[pair.rendezvous]
        pair.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pairs = list(self._pairs.values())
            self._pairs.clear()
        for pair in pairs:
            pair.close()


class TorchDistReceiver(_Endpoint[RecvPair], KVReceiver):
    """Decode side (rank 1 of every pair): hosts a store per prefill peer, on `store_port` or the next free port after
    it (0: a port the OS picks)."""

    def _init_side(self) -> None:
        self._identity = uuid.uuid4().hex
        self._lost: OrderedDict[str, str] = OrderedDict()  # peer -> why its last pair died, until the next rendezvous
        self.unclaimed_pair_s = UNCLAIMED_PAIR_S
        self._cancelled: OrderedDict[tuple[str, int], None] = OrderedDict()

    def rendezvous(self, peer_id: str) -> str:
        with self._lock:
            pair = self._pairs.get(peer_id)
        if pair is not None and pair.error is None and pair.dropped_by_sender():  # a store call: not under the lock
            with self._lock:
                if self._pairs.get(peer_id) is pair:
                    del self._pairs[peer_id]  # its serving thread ends once gloo notices
            pair.closed = True
            pair.fail(PeerLostError(f"prefill peer {peer_id!r}: its sender dropped the pair"))
            pair.close_store()
        with self._lock:
            if self._closed:
                raise TransferError("receiver is closed")
            pair = self._pairs.get(peer_id)
            if pair is None or pair.error is not None:
                info = device_info(self.device, self.backend)
                pair = RecvPair(
                    peer_id, self.host, self._identity, info, self.connect_timeout_s, self.bind_host, self.store_port
                )
                self._pairs[peer_id] = pair
                self._lost.pop(peer_id, None)
                threading.Thread(target=self._serve, args=(pair,), name=f"kv-recv-{peer_id}", daemon=True).start()
            pair.last_rendezvous = time.monotonic()
            return pair.address

    def recv(self, peer_id: str, tag: int, kv_caches: KVCaches, block_ids: Sequence[int], timeout_s: float) -> int:
        layout, blocks = self._checked(kv_caches, block_ids, tag, distinct=True)
        if blocks.n == 0:
            return 0
        p = Pending(tag, kv_caches, blocks, layout, timeout_s)
        with self._lock:  # registered under the lock `cancel` takes: a cancel is never missed
            if (peer_id, tag) in self._cancelled:
                del self._cancelled[(peer_id, tag)]
                raise TransferCancelledError(f"prefill peer {peer_id!r}: tag {tag} cancelled")
            pair = self._pairs.get(peer_id)
            if pair is None:
                why = self._lost.get(peer_id)
                if why is not None:
                    raise PeerLostError(why)
                raise TransferError(f"no pair with prefill peer {peer_id!r}: call rendezvous() first")
            pair.register(p)
        if not p.done.wait(max(time_left(p.deadline), 0)) and pair.abandon(p):
            raise TransferTimeoutError(f"prefill peer {peer_id!r}: no KV data for tag {tag} within {timeout_s}s")
        # The serving thread claimed it: it writes into the blocks until the bytes' own deadline (the claim set it,
        # under the lock `abandon` took) and its waits end there; past that (and gloo's close), it is stuck.
        if not p.done.wait(max(time_left(p.deadline), 0) + self.connect_timeout_s):
            self._drop(pair, PeerLostError(f"prefill peer {peer_id!r}: transfer of tag {tag} is stuck"))
            raise TransferTimeoutError(f"prefill peer {peer_id!r}: tag {tag} stuck past its deadline")
        if p.error is not None:
            raise type(p.error)(str(p.error))  # a fresh exception per caller: one error may fail several recvs
        return p.nbytes

    def cancel(self, peer_id: str, tag: int) -> None:
        with self._lock:
            self._cancelled[(peer_id, tag)] = None
            while len(self._cancelled) > _MAX_CANCELLED:
                self._cancelled.popitem(last=False)
            pair = self._pairs.get(peer_id)
            if pair is not None:
                pair.cancel(tag, TransferCancelledError(f"prefill peer {peer_id!r}: tag {tag} cancelled"))

    def _serve(self, pair: RecvPair) -> None:
        """The pair's serving thread: builds the group, then runs transfers one by one until the pair dies."""
        name = f"prefill peer {pair.peer_id!r}"
        try:
            group = self._accepted(pair, name)
        except Exception as e:
            self._drop(pair, as_transfer_error(e, name))
            pair.close_store()
            return
        if group is None:
            return
        staging = Staging(self.device, wire_on_host=group.backend == "gloo")
        while not pair.closed:
            p: Pending | None = None
            try:
                header = Header.decode(group.recv_ctrl(HEADER_LEN, None), self.secret)
                p = pair.claim(header.tag, header.timeout_ms / 2000) if header.authentic else None
                code, detail, error = check_header(p, header, name)
                deadline = pair.drain_deadline(header, name) if p is None else p.deadline
                target = (p.blocks, p.kv_caches) if p is not None and code == OK else None
                receive_messages(
                    group,
                    staging,
                    header.num_layers,
                    header.segments,
                    header.block_bytes,
                    self.pipeline_bytes,
                    deadline,
                    target,
                )
                group.send_status(code, detail, deadline)
                if p is not None:
                    pair.finish(p, nbytes=p.layout.bytes_for(p.blocks.n) if error is None else 0, error=error)
            except Exception as e:
                err = as_transfer_error(e, name)
                err = type(err)(str(err))  # the pair keeps it: its traceback would keep this frame, the group,
                if p is not None:  # its staging and the pair's store (a listening port) alive until a gc
                    pair.finish(p, error=err)
                self._drop(pair, err)
                group.close()
                pair.close_store()
                return

    def _accepted(self, pair: RecvPair, name: str) -> PairGroup | None:
        """The pair's group once a sender claims it; None when it was given up unclaimed. It leaves `_pairs` under
        the lock a rendezvous and a recv take: a hand-off either refreshed it first, or opens a fresh pair."""
        while True:
            group = pair.accept(self._gloo_device, self.device, self.connect_timeout_s, name, self.unclaimed_pair_s)
            if group is not None:
                return group
            error = TransferError(f"{name}: no sender claimed the pair within {self.unclaimed_pair_s:g} s")
            with self._lock:
                if not pair.unclaimed(self.unclaimed_pair_s):
                    continue
                if self._pairs.get(pair.peer_id) is pair:
                    del self._pairs[pair.peer_id]
                    self._note_lost(pair.peer_id, error)
            pair.fail(error)
            pair.close_store()
            return None

    def _drop(self, pair: RecvPair, error: TransferError) -> None:
        with self._lock:
            if self._pairs.get(pair.peer_id) is pair:
                del self._pairs[pair.peer_id]
                self._note_lost(pair.peer_id, error)
        pair.fail(error)

    def _note_lost(self, peer_id: str, error: TransferError) -> None:
        """Under the lock: why `peer_id`'s pair died, for a recv that comes too late to see it fail."""
        self._lost[peer_id] = str(error)
        self._lost.move_to_end(peer_id)
        while len(self._lost) > _MAX_LOST:
            self._lost.popitem(last=False)

    def close(self) -> None:
        """Fails waiting recvs and forgets every pair. A serving thread blocked on an idle pair ends when its peer
        closes or exits (gloo cannot cancel a posted receive); it is a daemon, so it never holds up exit."""
        with self._lock:
            self._closed = True
            pairs = list(self._pairs.values())
            self._pairs.clear()
        for pair in pairs:
            pair.closed = True
            pair.fail(TransferError(f"prefill peer {pair.peer_id!r}: receiver closed"))
