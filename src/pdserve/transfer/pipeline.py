"""The data step of a transfer: two messages per layer (keys, then values), pipelined.

Later messages are gathered while earlier ones are on the wire, up to `pipeline_bytes` in flight per side. Keys and
values lie apart in the cache, hence two messages per layer: both can go direct when the block ids are a run.
Every receive is posted with the size the header announced: gloo aborts the whole process on a larger message.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch
import torch.distributed as dist

from pdserve.transfer.blocks import Blocks
from pdserve.transfer.pair_group import PairGroup


class Staging:
    """A pair's reusable message buffers, one slot per message in flight, allocated on first use.

    `work` lives on the cache device (gather / scatter there); `wire` is what the backend moves: the same tensor,
    or a pinned host copy when gloo carries CUDA caches (then the cache itself can never go on the wire).
    """

    def __init__(self, device: torch.device, wire_on_host: bool) -> None:
        self.device = device
        self.host = wire_on_host and device.type != "cpu"
        self._work: list[torch.Tensor] = []
        self._wire: list[torch.Tensor] = []

    def slot(self, i: int, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        while len(self._work) <= i:
            self._work.append(torch.empty(0, dtype=torch.uint8, device=self.device))
            self._wire.append(self._work[-1])
        if self._work[i].numel() < nbytes:
            self._work[i] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._wire[i] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) if self.host else self._work[i]
        work = self._work[i][:nbytes]
        return work, (self._wire[i][:nbytes] if self.host else work)


def _pipeline_depth(pipeline_bytes: int, message_bytes: int, num_messages: int) -> int:
    """Messages in flight: as many as `pipeline_bytes` holds, at least two (one on the wire, one being copied)."""
    return max(2, min(num_messages, pipeline_bytes // max(message_bytes, 1)))


def send_messages(
    group: PairGroup,
    staging: Staging,
    blocks: Blocks,
    kv_caches: Sequence[torch.Tensor],
    message_bytes: int,
    pipeline_bytes: int,
    deadline: float,
) -> deque[dist.Work]:
    """Posts every layer's messages, waiting only to stay within the pipeline; returns the sends still in flight."""
    num_messages = 2 * len(kv_caches)
    depth = _pipeline_depth(pipeline_bytes, message_bytes, num_messages)
    in_flight: deque[dist.Work] = deque()
    for m in range(num_messages):
        if len(in_flight) == depth:
            group.wait_data(in_flight.popleft(), deadline)
        kv, half = kv_caches[m // 2], m % 2
        wire = None if staging.host else blocks.direct(kv, half)
        if wire is None:
            work, wire = staging.slot(m % depth, message_bytes)
            blocks.gather(kv, half, work)
            if wire is not work:
                wire.copy_(work)
        in_flight.append(group.data_op(True, wire, m))
    return in_flight


def receive_messages(
    group: PairGroup,
    staging: Staging,
    num_layers: int,
    message_bytes: int,
    pipeline_bytes: int,
    deadline: float,
    target: tuple[Blocks, Sequence[torch.Tensor]] | None,
) -> None:
    """Receives every layer's messages into the target's blocks, or into the staging buffers only (a rejected
    transfer is drained, so the pair stays in step) when target is None."""
    num_messages = 2 * num_layers
    depth = _pipeline_depth(pipeline_bytes, message_bytes, num_messages)

    def post(m: int) -> tuple[dist.Work, torch.Tensor, torch.Tensor, bool]:
        direct = target[0].direct(target[1][m // 2], m % 2) if target is not None and not staging.host else None
        if direct is not None:
            return group.data_op(False, direct, m), direct, direct, True
        work, wire = staging.slot(m % depth, message_bytes)
        return group.data_op(False, wire, m), work, wire, False

    posted = deque(post(m) for m in range(min(depth, num_messages)))
    for m in range(num_messages):
        op, work, wire, direct = posted.popleft()
        group.wait_data(op, deadline)
        if target is not None and not direct:
            if wire is not work:
                work.copy_(wire)
            blocks, kv_caches = target
            blocks.scatter(work, kv_caches[m // 2], m % 2)
        if m + depth < num_messages:
            posted.append(post(m + depth))
    if target is not None and staging.device.type == "cuda":
        torch.cuda.synchronize(staging.device)
