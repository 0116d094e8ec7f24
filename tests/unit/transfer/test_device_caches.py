"""A transfer between caches on each device this machine has: CPU always, CUDA when present (gloo then carries
the CUDA caches through pinned host staging). Both ends live in this process: a pair group is two ranks,
wherever they run."""

from __future__ import annotations

import threading

import pytest
import torch

from pdserve.transfer.layout import KVLayout
from pdserve.transfer.torch_dist import TorchDistReceiver, TorchDistSender

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
IDS = {"runs": (list(range(3, 10)), list(range(12, 19))), "scattered": ([9, 2, 17, 5], [3, 20, 7, 14])}

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("ids", list(IDS))
@pytest.mark.parametrize("device", DEVICES)
def test_blocks_land_bit_exact_on_the_device(device: str, ids: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    g = torch.Generator().manual_seed(0)
    src = [torch.randn(2, 24, 4, 2, 8, generator=g).to(torch.bfloat16).to(device) for _ in range(3)]
    dst = [torch.zeros_like(t) for t in src]
    src_ids, dst_ids = IDS[ids]
    receiver = TorchDistReceiver("127.0.0.1", device, "fp", backend="gloo", connect_timeout_s=10)
    sender = TorchDistSender("127.0.0.1", device, "fp", backend="gloo", connect_timeout_s=10)
    received: dict[str, int] = {}
    try:
        rendezvous = receiver.rendezvous("prefill-here")
        recv = threading.Thread(target=lambda: received.update(n=receiver.recv("prefill-here", 1, dst, dst_ids, 30)))
        recv.start()
        sent = sender.send(rendezvous, 1, src, src_ids, 30)
        recv.join(30)
    finally:
        sender.close()
        receiver.close()
    assert sent == received["n"] == KVLayout.from_caches(src, "fp").bytes_for(len(src_ids))
    others = [b for b in range(24) if b not in dst_ids]
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[:, dst_ids].cpu().view(torch.int16), s[:, src_ids].cpu().view(torch.int16))
        assert not d[:, others].any()
