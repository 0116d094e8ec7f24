"""The prefill side of one pair: connecting to the decode side, and one transfer over the pair."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import torch

from pdserve.transfer.base import LayoutMismatchError, TransferError
from pdserve.transfer.blocks import Blocks
from pdserve.transfer.layout import KVLayout
from pdserve.transfer.pair_group import PairGroup, time_left
from pdserve.transfer.pipeline import Staging, send_messages
from pdserve.transfer.rendezvous import choose_backend, claim_store, device_info
from pdserve.transfer.wire import BLOCK_COUNT, LAYOUT, MAX_SEGMENTS, NOT_EXPECTED, Header, layout_fields

log = logging.getLogger(__name__)


class SendPair:
    def __init__(self, rendezvous: str, group: PairGroup, identity: str, device: torch.device) -> None:
        self.rendezvous, self.group, self.identity = rendezvous, group, identity
        self.lock = threading.Lock()  # one transfer at a time on the wire
        self.staging = Staging(device, wire_on_host=group.backend == "gloo")
        self.broken = False

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
        return cls(rendezvous, group, identity, device)

    def transfer(
        self,
        tag: int,
        kv_caches: Sequence[torch.Tensor],
        blocks: Blocks,
        layout: KVLayout,
        deadline: float,
        timeout_s: float,
        pipeline_bytes: int,
    ) -> tuple[int, int]:
        """Header, data, then the receiver's status (code, detail). There is no "go" round trip before the data:
        on a busy host each extra wake-up costs up to a scheduler tick."""
        g = self.group
        header = Header.for_transfer(tag, blocks.n, layout, timeout_s, blocks.runs(MAX_SEGMENTS))
        header_work = g.ctrl_op(True, header.encode())
        in_flight = send_messages(
            g, self.staging, blocks, kv_caches, header.segments, header.block_bytes, pipeline_bytes, deadline
        )
        g.wait(header_work, deadline)
        if in_flight:  # a pair sends in order: the last done, all are (and only then may the others be dropped)
            g.wait_data(in_flight[-1], deadline)
        return g.recv_status(deadline)

    def close(self) -> None:
        self.broken = True
        self.group.close()


def rejection(code: int, detail: int, where: str, layout: KVLayout, num_blocks: int) -> TransferError:
    """The error for a status other than OK; the pair itself is fine."""
    if code == LAYOUT:
        names = layout_fields(detail)
        return LayoutMismatchError(f"{where}: KV layout mismatch in {', '.join(names)} (ours: {layout})")
    if code == NOT_EXPECTED:
        return TransferError(f"{where}: no recv is waiting for that tag (timed out, cancelled or never posted)")
    if code == BLOCK_COUNT:
        return TransferError(f"{where}: it expects {detail} blocks, we sent {num_blocks}")
    return TransferError(f"{where}: receive failed on the decode side (status {code})")
