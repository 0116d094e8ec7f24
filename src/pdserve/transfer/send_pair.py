"""The prefill side of one pair: connecting to the decode side, and one transfer over the pair."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future

import torch
import torch.distributed as dist

from pdserve.addresses import split_host_port
from pdserve.transfer.base import (
    LayoutMismatchError,
    NotExpectedError,
    PeerLostError,
    PeerSilentError,
    TransferError,
)
from pdserve.transfer.blocks import Blocks
from pdserve.transfer.layout import KVLayout
from pdserve.transfer.pair_group import PairGroup, error_summary, time_left
from pdserve.transfer.pipeline import Staging, send_messages
from pdserve.transfer.rendezvous import choose_backend, claim_store, device_info
from pdserve.transfer.store_calls import StoreSilent, answer, started
from pdserve.transfer.wire import BLOCK_COUNT, FORGED, LAYOUT, MAX_SEGMENTS, NOT_EXPECTED, Header, layout_fields

log = logging.getLogger(__name__)

_ALIVE_KEY = "alive?"  # any key: check() only needs the round trip
REFUSAL_WAIT_S = 0.2  # a refusal is at once; past this, whatever the host does is the store check's to judge
CHECK_TIMEOUT_S = 2.0  # for that round trip, on a loaded host; a stopped decode process never answers


class SendPair:
    def __init__(
        self, rendezvous: str, group: PairGroup, identity: str, device: torch.device, store: dist.Store
    ) -> None:
        self.rendezvous, self.group, self.identity = rendezvous, group, identity
        self.store = store  # served by the decode side: answers at once when that process is gone
        self.lock = threading.Lock()  # one transfer at a time on the wire
        self.staging = Staging(device, wire_on_host=group.backend == "gloo")
        self.broken = False
        self._check: Future[bool] | None = None  # the last liveness round trip, answered or not yet
        self._check_lock = threading.Lock()

    @classmethod
    def connect(
        cls, rendezvous: str, device: torch.device, backend: str, gloo_device: object, deadline: float
    ) -> SendPair:
        name = f"decode side {rendezvous}"
        mine = device_info(device, backend)
        store, identity, their_info = claim_store(rendezvous, mine, deadline, name)
        chosen = choose_backend(mine, their_info)
        group = PairGroup.build(store, 0, gloo_device, chosen, device, time_left(deadline), name)
        log.debug("kv sender: pair with %s over %s", rendezvous, chosen)
        return cls(rendezvous, group, identity, device, store)

    def transfer(
        self,
        tag: int,
        kv_caches: Sequence[torch.Tensor],
        blocks: Blocks,
        layout: KVLayout,
        timeout_s: float,
        pipeline_bytes: int,
        secret: bytes = b"",
    ) -> tuple[int, int]:
        """Header, data, then the receiver's status (code, detail), within `timeout_s` from now. The recv's budget
        (the same timeout: the decode side's, which the prefill worker is sent) starts when it claims the header,
        later: it never gives up on the bytes first. There is no "go" round trip before the data: on a busy host
        each extra wake-up costs up to a scheduler tick."""
        g = self.group
        deadline = time.monotonic() + timeout_s
        header = Header.for_transfer(tag, blocks.n, layout, timeout_s, blocks.runs(MAX_SEGMENTS))
        header_work = g.ctrl_op(True, header.encode(secret))
        in_flight = send_messages(
            g, self.staging, blocks, kv_caches, header.segments, header.block_bytes, pipeline_bytes, deadline
        )
        g.wait(header_work, deadline)
        if in_flight:  # a pair sends in order: the last done, all are (and only then may the others be dropped)
            g.wait_data(in_flight[-1], deadline)
        return g.recv_status(deadline)

    def check_peer(self, timeout_s: float = CHECK_TIMEOUT_S, refusal_first: bool = False) -> None:
        """One store round trip (~0.2 ms). gloo does not always notice a decode worker that died while the pair
        sat idle: the header's send then waits out the whole transfer timeout (seen under load). The store the
        decode worker serves fails at once instead (PeerLostError). One that does not answer within `timeout_s`
        is silent (PeerSilentError: its process stopped, say); the round trip stays under way, and the next check
        waits for its answer rather than sending another. `refusal_first`: a store that refuses connections is lost
        without the round trip, whose failure torch logs as an 18-line C++ stack trace; the prune of gone decode
        workers' pairs asks so (at every decode worker's drain), not each transfer (a connection per hand-off)."""
        if refusal_first and _refused(self.rendezvous):
            raise PeerLostError(f"decode side {self.rendezvous}: peer lost: its store refuses connections")
        with self._check_lock:
            if self._check is None or self._check.done():
                store = self.store  # the thread holds the store alone, not this pair (its group and staging buffers)
                self._check = started(lambda: store.check([_ALIVE_KEY]), "kv-check")
            check = self._check
        try:
            answer(check, timeout_s)
        except StoreSilent as e:
            raise PeerSilentError(f"decode side {self.rendezvous}: not answering: {e}") from None
        except RuntimeError as e:
            # `self._check` keeps `e`; the frames its re-raise gathered (this one holds the pair) would make a cycle
            # through the pair that only a full collection frees, keeping a dropped pair's gloo group open.
            e.__traceback__ = None
            raise PeerLostError(f"decode side {self.rendezvous}: peer lost: {error_summary(e)}") from e

    def close(self) -> None:
        self.broken = True
        self.group.close()


def rejection(code: int, detail: int, where: str, layout: KVLayout, num_blocks: int) -> TransferError:
    """The error for a status other than OK; the pair itself is fine."""
    if code == LAYOUT:
        names = layout_fields(detail)
        return LayoutMismatchError(f"{where}: KV layout mismatch in {', '.join(names)} (ours: {layout})")
    if code == NOT_EXPECTED:
        return NotExpectedError(f"{where}: no recv is waiting for that tag (timed out, cancelled or never posted)")
    if code == FORGED:
        return TransferError(f"{where}: the header's MAC did not verify (the sides hold different cluster secrets)")
    if code == BLOCK_COUNT:
        return TransferError(f"{where}: it expects {detail} blocks, we sent {num_blocks}")
    return TransferError(f"{where}: receive failed on the decode side (status {code})")


def _refused(address: str) -> bool:
    """Whether a connection to `address` is refused now: nothing listens there, its process gone. Any other answer,
    or none, leaves the judgement to the store's round trip."""
    try:
        socket.create_connection(split_host_port(address), REFUSAL_WAIT_S).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False
