"""The torch.distributed KV data plane between real processes (spawned), over gloo on loopback:
blocks land bit-exact, concurrently, and only under a matching layout and header.

The test process is the decode side (one TorchDistReceiver per module); prefill senders run in spawned processes
(pair_harness.py). Caches are rebuilt from seeds on both sides, so the expected blocks never travel through the
harness.
"""

from __future__ import annotations

import gc
import time

import pytest
import torch

from pdserve.transfer.base import (
    LayoutMismatchError,
    PeerLostError,
    TransferError,
)
from pdserve.transfer.layout import KVLayout
from pdserve.transfer.rendezvous import listening
from pdserve.transfer.torch_dist import TorchDistReceiver
from tests.unit.transfer.pair_harness import FINGERPRINT, NUM_BLOCKS, Peer, Recv, assert_landed, bits, make_caches

pytestmark = pytest.mark.timeout(120)  # a hang fails the test instead of the whole run

IDS = {  # (src ids, dst ids); the sender sends a message per run of its ids (4 at most, else one message)
    "runs": (list(range(4, 13)), list(range(10, 19))),  # one run each side: no copy on either
    "scattered": ([9, 2, 17, 5], [3, 20, 7, 14]),  # single blocks: no copy either
    "mixed": ([4, 5, 6, 7, 15, 16, 2], [3, 20, 7, 8, 1, 2, 12]),  # a sender run lands on scattered blocks
    "many-runs": (list(range(23, 5, -1)), list(range(9)) + [12, 14, 16] + list(range(18, 24))),  # gathered
}


@pytest.mark.parametrize("ids", list(IDS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_blocks_land_bit_exact(receiver: TorchDistReceiver, peer: Peer, dtype: str, ids: str) -> None:
    src_ids, dst_ids = IDS[ids]
    tag = {"float32": 10, "bfloat16": 20}[dtype] + list(IDS).index(ids)
    kv = make_caches(100 + tag, dtype)  # the decode side's own content, which must survive outside dst_ids
    before = [t.clone() for t in kv]
    rendezvous = receiver.rendezvous("prefill-0")
    r = Recv(receiver, "prefill-0", tag, kv, dst_ids)
    sent = peer.call(op="send", rendezvous=rendezvous, tag=tag, seed=tag, dtype=dtype, ids=src_ids)
    got = r.join()
    expected = KVLayout.from_caches(kv, FINGERPRINT).bytes_for(len(dst_ids))
    assert sent == {"nbytes": expected}
    assert got == expected
    assert_landed(kv, before, make_caches(tag, dtype), src_ids, dst_ids)


def test_concurrent_transfers_over_one_pair_and_several_peers(receiver: TorchDistReceiver, peer: Peer) -> None:
    jobs = [  # (peer id, tag, src ids, dst ids): two share the pair of prefill-0, one goes over prefill-1
        ("prefill-0", 31, [1, 3, 5, 7], [0, 2, 4, 6]),
        ("prefill-0", 32, [20, 21, 22, 8, 9], [13, 19, 8, 9, 10]),
        ("prefill-1", 33, [0, 1, 2], [21, 22, 23]),
    ]
    kv = make_caches(7, "bfloat16")
    before = [t.clone() for t in kv]
    items = [
        {"rendezvous": receiver.rendezvous(p), "tag": tag, "seed": 1000 + tag, "dtype": "bfloat16", "ids": src}
        for p, tag, src, _ in jobs
    ]
    recvs = [Recv(receiver, p, tag, kv, dst) for p, tag, _, dst in jobs]
    replies = peer.call(op="send_many", items=items)
    for (_, tag, src, _dst), reply, r in zip(jobs, replies, recvs, strict=True):
        assert reply == {"nbytes": KVLayout.from_caches(kv, FINGERPRINT).bytes_for(len(src))}, tag
        assert isinstance(r.join(), int), r.result
    for _, tag, src, dst in jobs:
        want = make_caches(1000 + tag, "bfloat16")
        for layer in range(len(kv)):
            assert torch.equal(bits(kv[layer][:, dst]), bits(want[layer][:, src])), (tag, layer)
    untouched = [b for b in range(NUM_BLOCKS) if all(b not in dst for *_, dst in jobs)]
    for layer in range(len(kv)):
        assert torch.equal(bits(kv[layer][:, untouched]), bits(before[layer][:, untouched]))


def test_layout_mismatch_fails_both_sides_naming_the_field(receiver: TorchDistReceiver, peer: Peer) -> None:
    rendezvous = receiver.rendezvous("prefill-0")
    kv = make_caches(3)
    before = [t.clone() for t in kv]
    # The other model's sender is another process's: its own pair, under another peer id.
    cases = [("prefill-0", {"head_dim": 16}, "head_dim"), ("prefill-9", {"fingerprint": "other"}, "model_fingerprint")]
    for i, (peer_id, change, field) in enumerate(cases):
        address = receiver.rendezvous(peer_id)
        r = Recv(receiver, peer_id, 40 + i, kv, [1, 2])
        reply = peer.call(op="send", rendezvous=address, tag=40 + i, seed=5, ids=[3, 4], **change)
        err = r.join()
        assert isinstance(err, LayoutMismatchError) and field in str(err), err
        assert reply["error"] == "LayoutMismatchError" and field in reply["message"], reply
    for got, old in zip(kv, before, strict=True):
        assert torch.equal(bits(got), bits(old))
    # A wrong block count is refused too, and the pair still carries the next transfer.
    r = Recv(receiver, "prefill-0", 42, kv, [1, 2, 3])
    reply = peer.call(op="send", rendezvous=rendezvous, tag=42, seed=5, ids=[3, 4])
    assert isinstance(r.join(), TransferError) and reply["error"] == "TransferError"
    r = Recv(receiver, "prefill-0", 43, kv, [1, 2])
    assert peer.call(op="send", rendezvous=rendezvous, tag=43, seed=5, ids=[3, 4]) == {"nbytes": r.join()}


def test_a_forged_header_is_refused_and_the_real_transfer_still_lands(receiver: TorchDistReceiver, peer: Peer) -> None:
    """A sender without the cluster secret aims at a pending recv's tag: refused (FORGED) and drained, nothing
    written; the recv keeps waiting and takes the real transfer, bit exact."""
    rendezvous = receiver.rendezvous("prefill-0")
    kv = make_caches(77)
    before = [t.clone() for t in kv]
    r = Recv(receiver, "prefill-0", 44, kv, [5, 6, 7])
    forged = peer.call(op="send", rendezvous=rendezvous, tag=44, seed=666, ids=[1, 2, 3], secret="not-the-secret")
    assert forged["error"] == "TransferError" and "MAC" in forged["message"], forged
    assert r.thread.is_alive()  # still waiting for the real one
    for got, old in zip(kv, before, strict=True):
        assert torch.equal(bits(got), bits(old))
    sent = peer.call(op="send", rendezvous=rendezvous, tag=44, seed=44, ids=[1, 2, 3])
    assert sent == {"nbytes": r.join()}
    assert_landed(kv, before, make_caches(44), [1, 2, 3], [5, 6, 7])


def test_a_forged_header_sized_as_no_awaited_transfer_drops_the_pair_and_its_port(receiver: TorchDistReceiver) -> None:
    """Its sizes are the forger's word alone (a huge layer count or block size would be allocated to drain it):
    never drained, the pair goes at once, and with it the store's listening port (not at the next gc). The port
    closes on the store's own server thread, a moment after the sender sees the pair's sockets close: waited for."""
    rendezvous = receiver.rendezvous("prefill-forger")
    kv = make_caches(78)
    r = Recv(receiver, "prefill-forger", 45, kv, [5, 6, 7])
    forger = Peer()
    gc.disable()  # the port must close on the drop itself
    try:
        forged = forger.call(op="send", rendezvous=rendezvous, tag=45, seed=1, ids=[1, 2, 3, 4], secret="not-it")
        assert forged["error"] == "PeerLostError", forged
        err = r.join()
        assert isinstance(err, PeerLostError) and "a header whose MAC fails, sized as no awaited" in str(err), err
        deadline = time.monotonic() + 10
        while listening(rendezvous, 1) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not listening(rendezvous, 1)
    finally:
        gc.enable()
        forger.close()
