"""The data step of a transfer: layer by layer, keys then values, one message per segment, pipelined.

The sender splits its block list into segments at the breaks between its runs of consecutive ids (up to
MAX_SEGMENTS, else one segment), so each of its messages can go straight from the cache; the receiver takes a
message straight into its cache wherever its own ids for that segment are a run too, and scatters it otherwise.
Keys and values lie apart in the cache, hence separate messages. Later messages are gathered while earlier ones
are on the wire, up to `pipeline_bytes` in flight per side. Every receive is posted with the size the header
announced: gloo aborts the whole process on a larger message.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

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


class Message(NamedTuple):
    """One data message: the keys (half 0) or values (half 1) of one layer for the ids at [start, start + length)
    of the transfer's block list."""

    layer: int
    half: int
    start: int
    length: int


def plan(num_layers: int, segments: tuple[int, ...]) -> list[Message]:
    """Every message of a transfer in wire order: layer by layer, keys then values, span by span."""
    starts = [sum(segments[:i]) for i in range(len(segments))]
    return [
        Message(layer, half, start, length)
        for layer in range(num_layers)
        for half in (0, 1)
        for start, length in zip(starts, segments, strict=True)
    ]


def _pipeline_depth(pipeline_bytes: int, message_bytes: int, num_messages: int) -> int:
    """Messages in flight: as many of the largest as `pipeline_bytes` holds, at least two (one on the wire, one
    being copied)."""
    return max(2, min(num_messages, pipeline_bytes // max(message_bytes, 1)))


def send_messages(
    group: PairGroup,
    staging: Staging,
    blocks: Blocks,
    kv_caches: Sequence[torch.Tensor],
    segments: tuple[int, ...],
    block_bytes: int,
    pipeline_bytes: int,
    deadline: float,
) -> deque[dist.Work]:
    """Posts every message, waiting only to stay within the pipeline; returns the sends still in flight."""
    messages = plan(len(kv_caches), segments)
    depth = _pipeline_depth(pipeline_bytes, max(segments) * block_bytes, len(messages))
    in_flight: deque[dist.Work] = deque()
    for i, (layer, half, start, length) in enumerate(messages):
        if len(in_flight) == depth:
            group.wait_data(in_flight.popleft(), deadline)
        kv = kv_caches[layer]
        wire = None if staging.host else blocks.direct(kv, half, start, length)
        if wire is None:
            work, wire = staging.slot(i % depth, length * block_bytes)
            blocks.gather(kv, half, start, length, work)
            if wire is not work:
                wire.copy_(work)
        in_flight.append(group.data_op(True, wire, i))
    return in_flight


def receive_messages(
    group: PairGroup,
    staging: Staging,
    num_layers: int,
    segments: tuple[int, ...],
    block_bytes: int,
    pipeline_bytes: int,
    deadline: float,
    target: tuple[Blocks, Sequence[torch.Tensor]] | None,
) -> None:
    """Receives every message into the target's blocks, or into the staging buffers only (a rejected transfer is
    drained, so the pair stays in step) when target is None."""
    messages = plan(num_layers, segments)
    depth = _pipeline_depth(pipeline_bytes, max(segments) * block_bytes, len(messages))

    def post(i: int) -> tuple[dist.Work, torch.Tensor, torch.Tensor, bool]:
        layer, half, start, length = messages[i]
        direct = None
        if target is not None and not staging.host:
            direct = target[0].direct(target[1][layer], half, start, length)
        if direct is not None:
            return group.data_op(False, direct, i), direct, direct, True
        work, wire = staging.slot(i % depth, length * block_bytes)
        return group.data_op(False, wire, i), work, wire, False

    posted = deque(post(i) for i in range(min(depth, len(messages))))
    unwaited: list[dist.Work] = []  # alive until a later wait: dropping a gloo Work cancels its receive
    for i, (layer, half, start, length) in enumerate(messages):
        op, work, wire, direct = posted.popleft()
        if direct and i < len(messages) - 1:
            unwaited.append(op)  # a pair delivers in order: the next wait covers it
        else:
            group.wait_data(op, deadline)
            unwaited.clear()
        if target is not None and not direct:
            if wire is not work:
                work.copy_(wire)
            blocks, kv_caches = target
            blocks.scatter(work, kv_caches[layer], half, start, length)
        if i + depth < len(messages):
            posted.append(post(i + depth))
    if target is not None and staging.device.type == "cuda":
        # This thread's stream only (the waits above ordered it after the wire's work): a device-wide synchronize
        # would also wait for every other pair's NCCL receive, a dead peer's until its deadline.
        torch.cuda.current_stream(staging.device).synchronize()
